"""klstudy's trainer. Its first import is the evaluation package's, which keeps scikit-learn out of
transformers' start-up in this process too (eval.lean_transformers)."""

import eval  # noqa: F401
