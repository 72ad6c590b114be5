"""The audits: exact gradient and variance audits over tabular policies, convergence, the optimum
and the objective measurement, the peers' settings, pass rates."""
