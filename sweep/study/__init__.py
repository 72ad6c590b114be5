"""The study: its config read and checked whole (configfiles, study_schema, config_schema, checks,
study_check), the grid and its points (grid, points, axes), each run's and evaluation's config (run_configs,
evaluations), what its outputs were made with (changes, rerun), what is left and the jobs that do it (jobs,
the job ledger), what that costs and how it will run (budget, plan, executor_settings), where each point
stands (status) and whose results directory and lock it is (owner, study_lock). No MLflow, no plotting."""
