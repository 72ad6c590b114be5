"""The regularized objective J(pi) = E[r] - beta KL(pi || pi_ref): its analytic optimum pi* over a finite
answer set (optimum.py) and its measurement on held-out prompts while a run trains (objective.py). Apart
from the audits, which check the objective's gradients, so that a run measures without importing them."""
