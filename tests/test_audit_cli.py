"""`python -m trainer audit` end to end, and the convergence audit's ranking."""

import csv
import json
import subprocess
import sys

import pytest

from trainer.audits import convergence
from trainer.objective import presets


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "trainer", "audit", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_audit_prints_the_table_and_writes_csv_json_markdown(tmp_path):
    result = run_cli("--skip-convergence", "--seeds", "0", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "| on-policy | k3 | loss | none |" in result.stdout
    assert "per-prefix forward (agrees)" in result.stdout
    assert "DISAGREES" not in result.stdout
    rows = list(csv.DictReader((tmp_path / "gradient_audit.csv").open()))
    # per estimator (k1, k2, k3, k3+, full) and placement with a KL term (the four in the reward alone
    # and the three with a loss): on-policy 4 + 3 x 2; off-policy 4 + 3 x 3; sequence 7
    assert len(rows) == 5 * (10 + 13 + 7)
    assert "| on-policy | k1 | reward-to-go | - | token |" in result.stdout
    assert "| entropy bonus | entropy_coef 0.1 | on-policy |" in result.stdout  # the peers' settings, below
    assert (tmp_path / "peers_audit.csv").is_file() and (tmp_path / "peers_audit.md").is_file()
    data = json.loads((tmp_path / "gradient_audit.json").read_text())
    assert data["setup"]["seeds"] == [0] and len(data["rows"]) == len(rows)
    verdicts = {(r["estimator"], r["placement"]): r["verdict"] for r in rows
                if r["sampling"] == "on-policy" and r["kl_loss_ratio"] == "none"}
    assert verdicts[("k1", "reward")] == "unbiased" and verdicts[("k1", "loss")] == "zero"
    assert (tmp_path / "gradient_audit.md").read_text().startswith("Exact gradient audit")


def test_audit_with_convergence_writes_the_plot(tmp_path):
    result = run_cli("--seeds", "0", "--conv-steps", "60", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "Convergence audit" in result.stdout
    png = (tmp_path / "convergence.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    curves = json.loads((tmp_path / "convergence.json").read_text())["curves"]
    assert set(curves) == set(convergence.on_policy_configs(0.3, "rloo"))
    assert len(list(csv.DictReader((tmp_path / "convergence.csv").open()))) == 7  # steps 0, 10, ..., 60


@pytest.mark.parametrize("args,message", [
    (["--advantage", "ppo"], "objective.advantage: 'ppo' is not one of"),
    (["--vocab", "10", "--length", "4"], "keep it under 200,000"),
    (["--length", "0"], "need vocab >= 2 and length >= 1"),
])
def test_bad_audit_arguments_give_one_clear_error(args, message):
    result = run_cli("--skip-convergence", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_convergence_separates_unbiased_from_biased_configurations():
    audit = convergence.convergence_audit(steps=300, groups_per_step=16, progress=False)
    final = audit.final
    start = audit.setup["start_kl_to_optimum"]
    assert convergence.unbiased_labels() == {"k1 reward", "k1 reward+loss", "k3 reward+loss", "full reward+loss",
                                             "k1 reward-to-go", "k1 reward-to-go+loss", "k3 reward-to-go+loss",
                                             "full reward-to-go+loss"}
    unbiased = [final[name] for name in convergence.unbiased_labels()]
    biased = [final[name] for name in ("k2 loss", "k3 loss", "k2 reward+loss", "k2 reward", "k3 reward", "full loss",
                                       "full reward")]
    assert max(unbiased) < start / 100          # the unbiased ones close in on pi*
    assert max(unbiased) < min(biased)          # every biased one ends further away
    assert final["k1 reward"] < 1e-6            # zero-variance fixed point: all shaped rewards equal at pi*
    assert final["none"] > 1 and final["k1 loss"] > 0.5  # no regularisation: the reward's argmax


def test_audit_presets_explains_each_librarys_default(tmp_path):
    result = run_cli("--presets", "--seeds", "0", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    rows = {r["preset"]: r for r in csv.DictReader((tmp_path / "presets_audit.csv").open())}
    assert set(rows) == set(presets.NAMES) and (tmp_path / "presets_audit.md").is_file()
    # whitened with the return, verl's and OpenRLHF's reward KL no longer follow grad KL; TRL's RLOO does
    assert {name for name, r in rows.items() if r["on_policy"] == "unbiased"} == {"trl-rloo"}
    assert {name for name, r in rows.items() if r["objective_on"] == "exact"} == {
        "trl-rloo", "paper-k1-reward", "paper-k1-reward-reset50"}
    assert {rows[name]["objective_on"] for name in ("verl-reward", "openrlhf", "nemo-rl-reward")} == {"biased"}
    assert {r["on_policy"] for name, r in rows.items() if r["placement"] == "loss"} == {
        "per-prefix forward", "per-prefix reverse", "scaled per-prefix forward", "scaled per-prefix reverse", "zero"}
    assert rows["skyrl"]["on_policy"] == "scaled per-prefix forward"  # per response: 1 / T of it, T = 2
    # OpenRLHF's unbiased_gradient, said to be grad KL: token ratios give the per-prefix reverse KL's (a token mean)
    assert rows["openrlhf-unbiased"]["on_policy"] == "scaled per-prefix reverse"
    assert rows["openrlhf-unbiased"]["off_policy"] == "biased"
    assert rows["paper-k1-reward"]["on_policy"] == "scaled"           # (G - 1) / G grad KL
    assert rows["slime-grpo-reward-kl"]["on_policy"] == "zero"
    assert all(r["off_policy"] != "unbiased" for r in rows.values())  # token ratios: none of them off-policy
    assert "| trl-rloo | TRL RLOOTrainer | 0.05 | rloo | k1 | reward |" in result.stdout
    assert "huggingface/trl@f2cd5771" in result.stdout and "bbartoldson/tba-prime@59c2f8ae" in result.stdout
    whitening = {(r["advantage"], r["placement"]): r for r in csv.DictReader((tmp_path / "whitening_audit.csv").open())}
    assert "| reinforce-whiten | k1 | reward-to-go |" in result.stdout
    assert whitening["reinforce", "reward-to-go"]["verdict"] == "exact"
    assert {r["verdict"] for (a, _), r in whitening.items() if "whiten" in a} == {"biased"}
