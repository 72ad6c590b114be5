"""The study's saved views and grid-point descriptions in MLflow (what they show: tests/test_mlflow_ui.py)."""

import json

import pytest
from study_fixture import write_run

from sweep.runs import load_runs
from sweep.tracking import study_page
from sweep.tracking.experiment import client_for, sync


def saved_views(client, experiment_id):
    tags = client.get_experiment(experiment_id).tags
    return {key: json.loads(tags[study_page.VIEW_PREFIX + key]) for key in study_page.VIEW_NAMES}


def test_the_views_gain_the_columns_of_later_runs_keep_those_of_others_and_change_only_when_they_must(tmp_path):
    results, uri = tmp_path / "results", f"sqlite:///{tmp_path / 'mlflow.db'}"
    write_run(results, "toy__k1-reward__b0.1__s0", "k1", "reward", 0.1, 0, [0.5, 0.6], {"arith": 0.6})
    synced = sync(results, "views", uri)
    client = client_for(uri)
    experiment_id = synced.runs_page.split("/experiments/")[1].split("/")[0]
    views = saved_views(client, experiment_id)
    grid = json.loads(views[study_page.GRID_VIEW]["state"])
    assert views[study_page.GRID_VIEW]["name"] == "klstudy: every grid point"
    assert grid["selectedColumns"] == grid["columnOrder"] == [
        "tags.`klstudy.config_label`", "tags.`klstudy.model`", "tags.`klstudy.beta`", "tags.`klstudy.seed`",
        "metrics.`eval/all/arith/pass_at_1`", "metrics.`reward_mean`"]
    assert grid["orderByKey"] == "tags.`mlflow.runName`" and "groupBy" not in grid  # a flat list, by name
    mean = json.loads(views[study_page.MEAN_VIEW]["state"])
    assert mean["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "klstudy.point"}]

    # a later run with an extra axis and the measured objective: its columns join, in their place
    write_run(results, "toy__k1-loss__b0.1__async2__s0", "k1", "loss", 0.1, 0, [0.5, 0.6], {"arith": 0.5},
              train={"async_level": 2}, measured=([0.7, 0.4], [0.2, 0.2]))
    write_run(results, "toy__k1-loss__b0.1__s0", "k1", "loss", 0.1, 0, [0.5, 0.6], {"arith": 0.5},
              train={"async_level": 0}, measured=([0.7, 0.4], [0.2, 0.2]))
    sync(results, "views", uri)
    grid = json.loads(saved_views(client, experiment_id)[study_page.GRID_VIEW]["state"])
    assert grid["selectedColumns"] == [
        "tags.`klstudy.config_label`", "tags.`klstudy.model`", "tags.`klstudy.beta`",
        "tags.`klstudy.train.async_level`", "tags.`klstudy.seed`", "metrics.`eval/all/arith/pass_at_1`",
        "metrics.`objective/gap`", "metrics.`objective/kl`", "metrics.`objective/reward`", "metrics.`reward_mean`"]

    # a follower that syncs one run keeps the others' columns; nothing new, nothing written
    before = saved_views(client, experiment_id)
    study_page.publish_views(client, experiment_id, load_runs(results)[:1])
    sync(results, "views", uri)
    assert saved_views(client, experiment_id) == before

    run = client.get_run(synced.child_run_ids["toy__k1-reward__b0.1__s0"])
    assert run.data.tags["klstudy.point"] == "toy__k1-reward__b0.1"
    assert run.data.tags["mlflow.note.content"].startswith("**k1-reward**, model toy, beta 0.1, ")


def test_a_tag_two_processes_write_first_at_once_is_not_an_error_for_the_loser():
    """MLflow's stores insert a new experiment tag: the second of two first writers gets the
    database's uniqueness error (seen in the two-process sync test: 'UNIQUE constraint failed:
    experiment_tags.key, experiment_tags.experiment_id'); the tag is there, so the loser goes on."""
    from mlflow.exceptions import MlflowException

    from sweep.tracking.concurrent_tags import set_experiment_tag

    class Racing:
        def __init__(self, message):
            self.message = message

        def set_experiment_tag(self, experiment_id, key, value):
            raise MlflowException(self.message)

    set_experiment_tag(Racing("(sqlite3.IntegrityError) UNIQUE constraint failed: experiment_tags.key, "
                              "experiment_tags.experiment_id"), "4", "mlflow.experimentKind", "x")
    with pytest.raises(MlflowException, match="PERMISSION_DENIED"):
        set_experiment_tag(Racing("PERMISSION_DENIED: no"), "4", "k", "v")
