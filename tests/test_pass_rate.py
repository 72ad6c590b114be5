"""`python -m trainer pass-rate`: a task's pass@1 over a grid of options, scored by the trainer's verifier."""

import copy
import json
import subprocess
import sys

import pytest
import torch

from eval.verify import Verifier
from trainer.audits import pass_rate
from trainer.model.models import load_model, load_tokenizer
from trainer.rollout.base import SamplingParams, sample_seeds
from trainer.rollout.hf import HFEngine
from trainer.tasks import make_task


def test_a_grid_is_every_combination_of_its_values():
    grid = pass_rate.parse_grid(["terms=2,3", "max_operand=9,20", "ops=+"])
    assert grid == {"terms": [2, 3], "max_operand": [9, 20], "ops": ["+"]}
    assert pass_rate.grid_points(grid)[:3] == [{"terms": 2, "max_operand": 9, "ops": "+"},
                                               {"terms": 2, "max_operand": 20, "ops": "+"},
                                               {"terms": 3, "max_operand": 9, "ops": "+"}]
    with pytest.raises(ValueError, match="--grid 'terms': expected KEY=V1,V2"):
        pass_rate.parse_grid(["terms"])


def test_pass_at_1_is_the_mean_verifier_score_and_the_kl_is_zero_to_itself(warm_model):
    tokenizer, model = load_tokenizer(str(warm_model)), load_model(str(warm_model))
    engine, task = HFEngine(model, tokenizer), make_task("arithmetic", {"max_operand": 9, "seed": 1})
    verifier = Verifier()
    params = SamplingParams(n=3, max_new_tokens=4, stop=("\n",))
    try:
        measured = pass_rate.measure(engine, tokenizer, task, {"max_operand": 9}, 10, params, 5, False, verifier,
                                     batch=4, kl_between=(model, model))
        problems = [task.problem(i) for i in range(10)]
        again = engine.generate(task.prompt_ids(problems, tokenizer, False), params, sample_seeds(5, 0, 10))
        scores = task.reward(again.texts, [p for p in problems for _ in range(3)], verifier)
        moved = copy.deepcopy(model)
        with torch.no_grad():
            for p in moved.parameters():
                p.add_(0.05 * torch.randn_like(p))
        apart = pass_rate.measure(HFEngine(moved, tokenizer), tokenizer, task, {}, 10, params, 5, False, verifier,
                                  kl_between=(moved, model))
    finally:
        verifier.close()
    assert measured.pass_at_1 == pytest.approx(sum(scores) / len(scores)) and 0 < measured.pass_at_1 < 1
    assert measured.problems == 10 and measured.samples == 3 and measured.kl == 0.0 and apart.kl > 0
    assert measured.tokens == pytest.approx(sum(len(t) for t in again.token_ids) / 30)


def test_the_command_measures_each_grid_point_with_one_engine(warm_model, tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "-m", "trainer", "pass-rate", "--model", str(warm_model), "--task",
                           "arithmetic", "--option", "seed=1", "--grid", "max_operand=9,50", "--problems", "12",
                           "--samples", "2", "--max-new-tokens", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["options"] for r in rows] == [{"max_operand": 9}, {"max_operand": 50}]
    assert rows[0]["pass_at_1"] > rows[1]["pass_at_1"]  # the warm model learnt one-digit sums only
    assert "| max_operand | pass@1 |" in done.stdout
