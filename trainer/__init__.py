"""klstudy's trainer. Importing it keeps scikit-learn out of transformers' start-up in this process
(eval.lean_transformers): about a second of CPU in every process that loads a model."""

from eval.lean_transformers import install as _install_lean_transformers

_install_lean_transformers()
