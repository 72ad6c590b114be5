"""The study level, above the trainer and the evaluation, in rooms by what they do: the study (study/), the
hub (hub/), tracking in MLflow (tracking/) and the report (report/); runs.py reads what training and
evaluation wrote, for all of them; `python -m sweep` is the command line."""
