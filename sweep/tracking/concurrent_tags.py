"""An experiment tag set by several processes at once (followers opening a study together).

MLflow's stores insert a new experiment tag rather than upsert it, so two first writers of one key
race: one of them gets the database's uniqueness error (sqlite's "UNIQUE constraint failed",
PostgreSQL's "duplicate key", MySQL's "Duplicate entry"). The tag is then there, written by the
other process; for the values written here (the same kind, a saved view that the track job rewrites
whole) that is what was wanted, so the loser goes on.
"""

from __future__ import annotations

_DUPLICATE = ("UNIQUE constraint failed", "duplicate key", "Duplicate entry")


def set_experiment_tag(client, experiment_id: str, key: str, value: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.set_experiment_tag(experiment_id, key, value)
    except MlflowException as error:
        if not any(sign in str(error) for sign in _DUPLICATE):
            raise
