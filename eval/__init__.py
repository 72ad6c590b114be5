"""Evaluation: lm-eval suites and math verifiers. Importing it keeps scikit-learn out of transformers'
start-up (eval.lean_transformers): about a second of CPU in every process that loads a model, the
evaluation's and the trainer's (which imports this package first)."""

from eval.lean_transformers import install as _install_lean_transformers

_install_lean_transformers()
