"""klstudy's trainer. Importing it keeps scikit-learn out of transformers' start-up
(trainer.model.lean_transformers): a second of CPU in every process that loads a model."""

from trainer.model.lean_transformers import install as _install_lean_transformers

_install_lean_transformers()
