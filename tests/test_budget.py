"""The plan's budget (sweep.study.budget): training priced by steps x seconds per step x GPUs, the seconds measured
on the study's own runs before any estimate; the other jobs bounded by their time limits; and whether the
executor's signal delay leaves time for a step and the checkpoint, whose size it reckons from the model's
safetensors headers as the copies of the weights the train state saves (checked against checkpoints the trainer
writes, with and without a reference that moves)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from sweep.study import budget
from sweep.study.grid import load_study

REPO = Path(__file__).resolve().parents[1]


def paper_study(tmp_path: Path, **sections):
    config = yaml.safe_load((REPO / "workflow" / "config" / "paper.yaml").read_text())
    return load_study({**config, "results": str(tmp_path), **sections})


def log_steps(study, run_id: str, times: list[float]) -> None:
    run = study.results / "runs" / run_id
    run.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": i, "step_time": t}) for i, t in enumerate(times)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n{\"step\": 9, \"step_t")  # the last line cut by a kill


def test_seconds_per_step_are_measured_on_the_studys_runs_before_any_estimate(tmp_path):
    study = paper_study(tmp_path, budget={"step_seconds": {"Qwen2.5-7B": 40}})
    assert budget.step_cost(study, "Qwen2.5-7B") == budget.StepCost(40.0, "estimate: budget.step_seconds")
    assert budget.step_cost(study, "Qwen3-4B-Instruct-2507").seconds is None
    qwen = [run.run_id for run in study.runs if run.model == "Qwen2.5-7B"]
    log_steps(study, qwen[0], [10.0, 30.0, 31.0])
    log_steps(study, qwen[1], [29.0, 32.0])
    measured = budget.step_cost(study, "Qwen2.5-7B")
    assert measured == budget.StepCost(30.0, "measured: median of 5 steps of 2 runs of this study")
    one = paper_study(tmp_path, budget={"step_seconds": 12.5})  # one number prices every model
    assert budget.step_cost(one, "Qwen3-4B-Instruct-2507").seconds == 12.5


def test_the_paper_studys_budget_prices_what_it_can_and_says_what_it_cannot(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # no hub here: the sizes stay unknown
    study = paper_study(tmp_path, budget={"step_seconds": {"Qwen2.5-7B": 36, "Llama-3.1-8B-Instruct": 36}})
    steps_left = {run.run_id: 250 for run in study.runs}
    groups = [("evaluate, all", 666, study.resources_for("evaluate")), ("track", 1, study.resources_for("track"))]
    lines = budget.budget_lines(study, groups, steps_left, (120, "profiles/slurm/config.yaml"))
    # 111 runs x 250 steps x 36 s = 277.5 job-hours; x 8 GPUs = 2,220 GPU-hours per 8-GPU model
    assert ("    train, Qwen2.5-7B: 111 runs, 27,750 steps left x 36 s (estimate: budget.step_seconds): "
            "278 job-hours x 8 GPUs: 2,220 GPU-hours") in lines
    assert any(line.startswith("    train, Qwen3-4B-Instruct-2507: 111 runs, 27,750 steps left: unknown")
               for line in lines)
    assert "    evaluate, all: 666 jobs x 1 GPU x at most 240 min: at most 2,664 GPU-hours" in lines
    assert ("    study: 4,440 GPU-hours for training, and unknown for Qwen3-4B-Instruct-2507; "
            "at most 2,664 GPU-hours for the other jobs") in lines
    assert not any(line.startswith("    track") for line in lines)  # no GPU, no GPU-hours
    assert ("  saving on a stop: signal_delay 120 s (profiles/slurm/config.yaml) gives a training job 100 s to "
            "finish its step and write its checkpoint, at 500 MB/s (budget.write_mb_per_s):") in lines
    assert ("    Qwen2.5-7B: size unknown (its weights are neither on this node nor readable from the hub from "
            "here)") in lines


def test_a_resumed_run_counts_only_its_steps_left_and_nodes_multiply_gpus(tmp_path):
    study = paper_study(tmp_path, budget={"step_seconds": 36},
                        resources={"train": {"gpus": 8, "nodes": 2}, "evaluate": {"gpus": 1}})
    one = next(run for run in study.runs if run.model == "Qwen2.5-7B").run_id
    lines, gpu_hours, unknown = budget.train_lines(study, {one: 100})
    assert lines == ["    train, Qwen2.5-7B: 1 run, 100 steps left x 36 s (estimate: budget.step_seconds): "
                     "1 job-hours x 16 GPUs: 16 GPU-hours"]  # the model's own 8 GPUs per node, on 2 nodes
    assert budget.job_gpus({"gpus": 8, "nodes": 2}) == 16 and budget.job_gpus({"cpus": 4}) == 0


def write_model(directory: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    save_file({name: torch.zeros(shape) for name, shape in shapes.items()}, directory / "model.safetensors",
              metadata={"format": "pt"})


def test_the_checkpoint_check_says_whether_the_signal_delay_is_enough(tmp_path):
    weights = tmp_path / "qwen"
    write_model(weights, {"embed": (1000, 500), "layer.0": (500, 500)})  # 750,000 parameters
    study = paper_study(tmp_path, models={"Qwen2.5-7B": {"path": str(weights)}},
                        budget={"step_seconds": 50, "write_mb_per_s": 0.1})
    assert budget.parameter_count(study, "Qwen2.5-7B") == 750_000
    steps_left = {run.run_id: 250 for run in study.runs}
    # 750,000 x 3 x float32 = 9 MB, at 0.1 MB/s: 90 s, after a 50 s step: 140 s, more than 120 - 20
    short = budget.checkpoint_lines(study, steps_left, (120, "--submitit-signal-delay"))
    assert short[1] == ("    Qwen2.5-7B: 750,000 parameters x 3 (weights, AdamW's moments) x float32 = 9.0 MB, "
                        "written in 90 s after a step of 50 s: NOT enough: set the executor's signal delay to at least "
                        "160 s (`submitit-signal-delay` in the profile), or the job is killed mid-write and resumes "
                        "from its previous checkpoint")
    assert budget.checkpoint_lines(study, steps_left, (160, "x"))[1].endswith(": enough")
    bf16 = paper_study(tmp_path, models={"Qwen2.5-7B": {"path": str(weights)}}, budget={"step_seconds": 50},
                       run={"model": {"dtype": "bfloat16"}, "task": {"name": "math"}})
    assert "= 4.5 MB" in budget.checkpoint_lines(bf16, steps_left, (120, "x"))[1]


def test_a_training_runtime_within_the_warnings_reach_from_the_start_is_said(tmp_path):
    """SLURM may send its warning signal_delay + 60 s before the limit: a 3-minute job with the profile's
    120 s would be told to stop at its first check, each attempt."""
    weights = tmp_path / "qwen"
    write_model(weights, {"embed": (10, 10)})

    def lines(runtime: int, delay: int) -> list[str]:
        study = paper_study(tmp_path, models={"Qwen2.5-7B": {"path": str(weights),
                                                             "resources": {"train": {"runtime": runtime}}}})
        return budget.checkpoint_lines(study, {run.run_id: 10 for run in study.runs}, (delay, "x"))

    assert lines(3, 120)[1] == ("    Qwen2.5-7B: NOT enough: a training job's runtime of 3 min is within "
                                "signal_delay + 60 s of its start, so SLURM may tell it to stop at its first "
                                "check, every attempt; give train a runtime of more than 3 min, with its steps "
                                "on top, or lower the signal delay")
    assert not any("runtime" in line for line in lines(4, 120) + lines(3, 90))


def test_a_reference_that_moves_is_a_fourth_copy_for_the_runs_that_save_it(tmp_path):
    """paper_offpolicy.yaml's reset-every-50 run saves its reference too: 4 copies where its 6 other presets save 3
    (7.6B parameters in float32: 244 s, not 183 s, at 500 MB/s)."""
    weights = tmp_path / "qwen"
    write_model(weights, {"embed": (1000, 500), "layer.0": (500, 500)})  # 750,000 parameters
    config = yaml.safe_load((REPO / "workflow" / "config" / "paper_offpolicy.yaml").read_text())
    config["models"] = {"Qwen2.5-7B": {**config["models"]["Qwen2.5-7B"], "path": str(weights)}}
    study = load_study({**config, "results": str(tmp_path), "budget": {"step_seconds": 50, "write_mb_per_s": 0.1}})
    lines = budget.checkpoint_lines(study, {run.run_id: 10 for run in study.runs}, (300, "x"))
    reset = "Qwen2.5-7B__k1-reward-centred__b0.005__preset-paper-k1-reward-reset50__s0"
    assert reset in study.by_id and len(study.runs) == 7
    assert lines[1:] == [
        "    Qwen2.5-7B (6 of its runs, such as Qwen2.5-7B__k1-reward-centred__b0.005__preset-paper-k1-reward__s0): "
        "750,000 parameters x 3 (weights, AdamW's moments) x float32 = 9.0 MB, written in 90 s after a step of 50 s: "
        "enough",
        f"    Qwen2.5-7B (1 of its runs, such as {reset}): 750,000 parameters x 4 (weights, AdamW's moments, the "
        "reference) x float32 = 12.0 MB, written in 120 s after a step of 50 s: enough"]


@pytest.mark.parametrize("moving_reference", [False, True])
def test_the_copies_priced_are_what_the_train_state_saves(tmp_path, toy_model, moving_reference):
    """A checkpoint of a real run, as the trainer writes it, against the copies the budget prices for its config
    (the files' other bytes, the tokenizer, config and random states, are a few kilobytes)."""
    from run_helpers import overrides, trainer_in_process

    from trainer.checkpoint_copies import weight_copies
    from trainer.config import from_dict

    moving = {"objective.ref_refresh_every": 1} if moving_reference else {}
    extra = {"train.steps": 2, "checkpoint.every": 2, **moving}
    done = trainer_in_process("train", "--out", str(tmp_path / "run"), *overrides(toy_model, **extra))
    assert done.returncode == 0, done.stderr[-3000:]
    written = tmp_path / "run" / "checkpoints" / "step_2"
    size = sum(path.stat().st_size for path in written.rglob("*") if path.is_file())
    params = sum(budget._tensor_elements(path) for path in (written / "model").glob("*.safetensors"))
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    copies = sum(weight_copies(from_dict(config)).values())
    assert copies == (4 if moving_reference else 3)
    assert size == pytest.approx(params * 4 * copies, rel=0.05, abs=200_000)


def test_the_signal_delay_comes_from_the_command_line_the_environment_the_profile_or_the_default(tmp_path):
    profile = tmp_path / "profile"
    profile.mkdir()
    (profile / "config.yaml").write_text("executor: submitit\nsubmitit-signal-delay: 300\n")
    assert budget.signal_delay(["snakemake", "--submitit-signal-delay", "200"], {}) == (200, "--submitit-signal-delay")
    assert budget.signal_delay(["snakemake", "--submitit-signal-delay=210"], {}) == (210, "--submitit-signal-delay")
    env = {"SNAKEMAKE_SUBMITIT_SIGNAL_DELAY": "250"}
    assert budget.signal_delay(["snakemake", "--profile", str(profile)], env) == (250, next(iter(env)))
    assert budget.signal_delay(["snakemake", "--profile", str(profile)], {}) == (300, str(profile / "config.yaml"))
    assert budget.signal_delay(["snakemake"], {"SNAKEMAKE_PROFILE": str(profile)})[0] == 300
    assert budget.signal_delay(["snakemake"], {}) == (90, "the executor's default")
    assert budget.signal_delay(["snakemake", "--profile", str(REPO / "profiles" / "slurm")], {})[0] == 120


def test_a_budget_for_a_model_the_study_lacks_is_one_clear_error(tmp_path):
    from sweep.study.grid import StudyError

    with pytest.raises(StudyError, match=r"^budget.step_seconds.Qwen7B: not a model of the study \(Qwen2.5-7B, "):
        paper_study(tmp_path, budget={"step_seconds": {"Qwen7B": 30}})
