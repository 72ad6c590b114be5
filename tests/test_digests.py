"""One digest per resolved run and per evaluation: what each is a digest of, what leaves it as it was, and that
the report and MLflow carry them beside every number. (A study run for real, whose COMPLETE records, status,
report and evaluations agree on them: tests/test_study_changes.py.)"""

import csv
import hashlib
import json

import yaml
from study_fixture import write_study
from test_tracking import child_runs

from eval import provenance
from sweep.report.build import report
from sweep.runs import load_runs
from sweep.tracking.experiment import sync
from trainer import config as run_config

BASE = {"model": {"path": "m"}}


def digest(data: dict) -> str:
    return run_config.digest(run_config.from_dict(data))


def test_a_runs_digest_is_of_what_its_config_sets_apart_from_the_defaults():
    """Canonical JSON of the non-default values, so that spelling a default, an int for a float, or a
    config.yaml written before a key existed (read at the key's default) give the same digest, and any value
    set otherwise gives another."""
    expected = hashlib.sha256(json.dumps({"model": {"path": "m"}, "objective": {"beta": 0.2}},
                                         sort_keys=True).encode()).hexdigest()
    assert digest({**BASE, "objective": {"beta": 0.2}}) == expected
    assert digest({**BASE, "objective": {"beta": 0.2, "estimator": "k1", "kl_to": "reference"},
                   "train": {"lr": run_config.TrainConfig.lr}}) == expected
    assert digest({**BASE, "objective": {"beta": 1}}) == digest({**BASE, "objective": {"beta": 1.0}})

    older = run_config.from_dict({**BASE, "objective": {"beta": 0.2}}).to_dict()
    del older["objective"]["kl_to"], older["rollout"]["vllm_cpu_kvcache_gib"]
    assert digest(older) == expected

    changed = [{"objective": {"beta": 0.3}}, {"objective": {"estimator": "k3"}}, {"objective": {"placement": "loss"}},
               {"train": {"seed": 2}}, {"train": {"lr": 3e-4}}, {"task": {"options": {"max_operand": 9}}},
               {"model": {"path": "n"}}, {"rollout": {"max_new_tokens": 5}}, {"objective": {"preset": "trl-grpo"}}]
    digests = {digest(run_config.apply_overrides(BASE, [f"{section}.{key}={json.dumps(value)}"]))
               for change in changed for section, values in change.items() for key, value in values.items()}
    assert len(digests) == len(changed) and expected not in digests


def test_an_evaluations_digest_is_of_what_made_it_not_of_where_it_lies():
    """Settings, data and model by content: the same record under another results directory keeps its digest;
    another setting, data file content or model record does not."""
    made = {"settings": {"tasks": ["toy"], "samples": 2, "seed": 0},
            "data": {"toy": {"source": "/a/results/data/heldout.jsonl", "sha256": "d" * 64}},
            "model": {"record": "/a/results/runs/r/COMPLETE", "sha256": "c" * 64}}
    moved = {**made, "data": {"toy": {"source": "/b/results/data/heldout.jsonl", "sha256": "d" * 64}},
             "model": {"record": "/b/results/runs/r/COMPLETE", "sha256": "c" * 64}}
    assert provenance.digest(made) == provenance.digest(moved) == provenance.digest({**made, "digest": "x"})
    others = [{**made, "settings": {**made["settings"], "samples": 3}},
              {**made, "data": {"toy": {"source": made["data"]["toy"]["source"], "sha256": "e" * 64}}},
              {**made, "model": {"record": made["model"]["record"], "sha256": "f" * 64}},
              {**made, "data": {"toy": {"source": "hub/other", "sha256": None}}}]
    assert len({provenance.digest(record) for record in [made, *others]}) == 5


def test_the_report_and_mlflow_name_every_runs_and_evaluations_digest(tmp_path):
    results = write_study(tmp_path / "results")
    made = {}
    for scores in sorted((results / "eval").glob("*/all/metrics.json")):
        run = scores.parent.parent.name
        made[run] = {"settings": {"tasks": ["math500"], "samples": 1}, "data": {},
                     "model": {"record": f"runs/{run}/COMPLETE", "sha256": hashlib.sha256(run.encode()).hexdigest()}}
        scores.write_text(json.dumps({**json.loads(scores.read_text()), "provenance": made[run]}))
    report(results)
    rows = list(csv.DictReader((results / "tables" / "provenance.csv").open()))
    records = load_runs(results)
    assert [row["run_id"] for row in rows if not row["evaluation"]] == [r.run_id for r in records]
    for row in rows:
        config = yaml.safe_load((results / "runs" / row["run_id"] / "config.yaml").read_text())
        assert row["config_sha256"] == digest(config)
    named = {row["run_id"]: row["evaluation_sha256"] for row in rows if row["evaluation"] == "all"}
    assert named == {run: provenance.digest(record) for run, record in made.items()}
    assert len(set(named.values())) == len(named) == 5

    sync(results, "digests")
    children, _ = child_runs(f"sqlite:///{(results / 'mlflow.db').resolve()}", "digests")
    by_id = {record.run_id: record for record in records}
    for run in children:
        run_id = run.data.tags["klstudy.run_id"]
        assert run.data.tags["klstudy.config_digest"] == by_id[run_id].config_digest == digest(by_id[run_id].config)
        assert run.data.tags["klstudy.eval_made_by.all"] == named[run_id]
