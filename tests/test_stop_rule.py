"""The off-policy diagnostics of every step (`ess`, `ess_seq`, `mismatch_kl`) and `train.stop_if`, the rule that
ends a run as failed, with its reason, once its importance weights have degenerated: the formulas on known
weights, the processes' parts adding up to one process's, the streak counted across a resume, and a toy run
that meets its rule, after which `sweep status` lists it failed and says why."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from run_helpers import trainer_in_process

from sweep.study import run_configs, status
from sweep.study.grid import load_study
from trainer.config import ConfigError, StopIf, from_dict
from trainer.run.metrics import effective_sample_size, importance_parts
from trainer.run.stop_rule import StoppedByRule, StopRule
from trainer.run_files import read_failure, read_metrics

REPO = Path(__file__).resolve().parent.parent
QUICK = yaml.safe_load((REPO / "workflow" / "config" / "toy_quick.yaml").read_text())


def test_ess_is_one_for_equal_weights_and_the_textbook_formula_otherwise():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    same = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.1, -3.0]])
    parts = importance_parts(same, same, mask)
    assert effective_sample_size([parts["token"]]) == pytest.approx(1.0)
    assert effective_sample_size([parts["sequence"]]) == pytest.approx(1.0)
    trainer = same + torch.tensor([[0.3, -0.2, 5.0], [0.0, 0.7, -0.4]])  # the masked token's 5.0 does not count
    parts = importance_parts(same, trainer, mask)
    w = [math.exp(x) for x in (0.3, -0.2, 0.0, 0.7, -0.4)]
    assert effective_sample_size([parts["token"]]) == pytest.approx(sum(w) ** 2 / (5 * sum(x * x for x in w)))
    s = [math.exp(0.3 - 0.2), math.exp(0.0 + 0.7 - 0.4)]  # a completion's weight: its tokens' product
    assert effective_sample_size([parts["sequence"]]) == pytest.approx(sum(s) ** 2 / (2 * sum(x * x for x in s)))


def test_the_processes_parts_add_up_to_one_processs_without_overflow():
    torch.manual_seed(0)
    engine = torch.randn(6, 5) * 3
    trainer = engine + torch.randn(6, 5) * 400  # weights of e^(+-1000): float64 overflows without the shift
    mask = (torch.rand(6, 5) > 0.3).double()
    whole = importance_parts(engine, trainer, mask)
    halves = [importance_parts(engine[rows], trainer[rows], mask[rows]) for rows in (slice(0, 2), slice(2, 6))]
    for kind in ("token", "sequence"):
        one = effective_sample_size([whole[kind]])
        assert 0 < one <= 1 and math.isfinite(one)
        assert effective_sample_size([h[kind] for h in halves]) == pytest.approx(one, rel=1e-9)
    assert effective_sample_size([importance_parts(engine, trainer, torch.zeros(6, 5))["token"]]) == 1.0  # no token


def test_the_rule_counts_steps_in_a_row_and_goes_on_counting_after_a_resume():
    rule = StopIf(ess_below=0.3, for_steps=3)
    lines = [{"step": s, "ess": e} for s, e in enumerate([0.9, 0.2, 0.1, 0.5, 0.2, 0.25], 1)]
    counted = StopRule(rule)
    for line in lines:
        counted.check(line)  # 0.2, 0.1 then 0.5 breaks the streak; 0.2, 0.25: two in a row
    resumed = StopRule(rule, history=lines)  # the same run, resumed: metrics.jsonl's lines
    assert resumed.streak == counted.streak == [(5, 0.2), (6, 0.25)]
    with pytest.raises(StoppedByRule, match=r"^train.stop_if: ess below 0.3 for 3 step\(s\) in a row \(0.2, 0.25, "
                       r"0.1 at steps 5 to 7\)"):
        resumed.check({"step": 7, "ess": 0.1})
    never = StopRule(StopIf())
    never.check({"step": 1, "ess": 0.0})  # ess_below 0: no rule


def test_the_rule_is_checked_with_the_run_config():
    def config(stop_if):
        return from_dict({"model": {"path": "a-model"}, "train": {"stop_if": stop_if}})

    assert config({"ess_below": 0.3, "for_steps": 5}).train.stop_if == StopIf(0.3, 5)
    for bad, key in (({"ess_below": 1.5}, "ess_below"), ({"for_steps": 0}, "for_steps"),
                     ({"ess_under": 0.3}, "ess_under")):
        with pytest.raises(ConfigError) as error:
            config(bad)
        assert error.value.key == f"train.stop_if.{key}", error.value


def test_a_run_that_meets_its_rule_ends_failed_and_sweep_status_says_why(warm_model, tmp_path):
    """Rollouts two steps behind (async_level 2) at a learning rate that moves the policy far in a step: the
    weights degenerate at once (ess about 0.05-0.6 from step 1 on, 1 at step 0, whose sampler is the policy), and
    the rule (ess below 0.9 in two steps in a row) stops the run as failed, every step's diagnostics in
    metrics.jsonl and its reason in FAILED; `sweep status` lists the point failed with it."""
    train = {**QUICK["run"]["train"], "steps": 8, "lr": 3e-3, "async_level": 2,
             "stop_if": {"ess_below": 0.9, "for_steps": 2}}
    study = load_study({**QUICK, "results": str(tmp_path), "models": {"toy-sft": {"path": str(warm_model)}},
                        "run": {**QUICK["run"], "train": train}})
    run_id = study.runs[0].run_id
    [config] = run_configs.write(study, [run_id])
    out = tmp_path / "runs" / run_id
    done = trainer_in_process("train", "--config", str(config), "--out", str(out))
    assert done.returncode == 1, done.stderr[-3000:]
    lines = read_metrics(out / "metrics.jsonl")
    assert all(0 < line["ess"] <= 1 and 0 < line["ess_seq"] <= 1 and line["mismatch_kl"] >= 0 for line in lines)
    assert lines[0]["ess"] == pytest.approx(1.0)  # step 0: sampled by the policy it trains
    assert 3 <= len(lines) < 8 and all(line["ess"] < 0.9 for line in lines[-2:])
    reason = read_failure(out)["reason"]
    assert reason.startswith("train.stop_if: ess below 0.9 for 2 step(s) in a row"), reason
    [point] = [p for p in status.study_status(study) if p.run_id == run_id]
    assert point.state == "failed" and point.detail["reason"] == reason
    assert reason in "\n".join(status.report(study, [point], ("failed",)))
    print(f"\nstopped at step {len(lines)}: ess {[round(line['ess'], 4) for line in lines]}; {json.dumps(reason)}")
