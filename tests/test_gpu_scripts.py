"""The GPU session's scripts, run on the CPU as far as they go: the step harness (benchmarks/gpu_step.py)
on the toy model, the wheel resolver's reading of requirements and conflicts (benchmarks/gpu_wheels.py)
on wheels written here, and the peak-memory reading of an allocator history (benchmarks/gpu_peak_memory.py)
on a history written here. Its downloads and the bundle's journey need the network and a GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_peak_memory  # noqa: E402
import gpu_wheels  # noqa: E402


@pytest.mark.slow
def test_the_step_harness_times_each_variant_and_sets_it_against_its_bounds(toy_model, tmp_path):
    tiny = ["model.device=cpu", "model.chat_template=false", "train.prompts_per_step=2", "train.group_size=2",
            "train.micro_batch_size=4", "rollout.max_new_tokens=6"]
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_step.py", "--model", str(toy_model), "--out", str(tmp_path), "--steps", "3",
         *[f"--set={s}" for s in tiny], "--variant", "one=rollout.hf_decoding=eager",
         "--variant", "two@2=rollout.hf_decoding=eager;train.gradient_checkpointing=false",
         "--variant", "mixed=rollout.hf_decoding=eager;train.mixed_precision=bf16"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_step.json").read_text())
    one, two, mixed = result["rows"]
    assert (one["processes"], one["timed_steps"], two["processes"], two["timed_steps"]) == (1, 2, 2, 4)
    for row in (one, two):
        assert row["step_s"] > 0 and row["compute_s"] > 0 and row["memory_s"] > 0
        assert row["tokens_per_s"] == row["tokens"] / row["step_s"]
    # two processes: twice the tokens and the work; no recompute without gradient checkpointing (5 passes, not 6)
    per_token_one, per_token_two = one["flop"] / one["tokens"], two["flop"] / two["tokens"]
    assert abs(per_token_two / per_token_one - 5 / 6) < 0.05
    assert result["rates"]["float32"]["flops_per_s"] > 0 and "| one | 1 |" in (tmp_path / "gpu_step.md").read_text()
    # bf16 arithmetic over float32 weights: its bound takes bfloat16's measured rate
    assert set(result["rates"]) == {"float32", "bfloat16"} and mixed["timed_steps"] == 2


def _wheel(directory: Path, name: str, version: str, requires: list[str]) -> Path:
    path = directory / f"{name}-{version}-py3-none-any.whl"
    meta = "\n".join([f"Name: {name}", f"Version: {version}", *[f"Requires-Dist: {r}" for r in requires]])
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def test_the_resolver_reads_requirements_for_the_gpu_machine_and_extras_asked_for(tmp_path):
    wheel = _wheel(tmp_path, "pkg", "1.0", ["always>=1", 'only_new; python_version >= "3.13"',
                                            'for_312; python_version == "3.12"', 'image_extra; extra == "image"'])
    assert [r.name for r in gpu_wheels.requirements_of(wheel, set())] == ["always", "for_312"]
    assert [r.name for r in gpu_wheels.requirements_of(wheel, {"image"})] == ["always", "for_312", "image_extra"]


def test_the_resolver_names_each_requirement_the_bundle_leaves_unmet(tmp_path):
    wheels = {"apache-tvm-ffi": _wheel(tmp_path, "apache_tvm_ffi", "0.1.10", [])}
    asked = {"apache-tvm-ffi": [("vllm-0.26.0", Requirement("apache-tvm-ffi==0.1.10")),
                                ("xgrammar-0.2.8", Requirement("apache-tvm-ffi>=0.1.11"))]}
    assert gpu_wheels.conflicts(wheels, asked) == [
        "xgrammar-0.2.8 asks for apache-tvm-ffi>=0.1.11, the bundle has 0.1.10"]


def test_the_peak_is_found_in_an_allocator_history_with_the_blocks_alive_then():
    def frames(*files):
        return [{"filename": f, "line": 1, "name": "f"} for f in files]

    model = frames("/x/site-packages/transformers/modeling.py", "/repo/trainer/model/models.py")
    logits = frames("/repo/trainer/model/chunked_logprobs.py", "/repo/trainer/run/step.py")
    events = [{"action": "alloc", "addr": 1, "size": 100, "frames": model},
              {"action": "alloc", "addr": 2, "size": 40, "frames": logits},
              {"action": "free_requested", "addr": 2, "size": 40},
              {"action": "free_completed", "addr": 2, "size": 40},  # the same release: not counted twice
              {"action": "alloc", "addr": 3, "size": 30, "frames": logits},
              {"action": "alloc", "addr": 4, "size": 30, "frames": logits},  # the peak: 160
              {"action": "free_requested", "addr": 3, "size": 30},
              {"action": "alloc", "addr": 5, "size": 25, "frames": logits}]
    peak, at, alive = gpu_peak_memory.blocks_at_peak(events)
    assert (peak, at, sorted(b["addr"] for b in alive)) == (160, 5, [1, 3, 4])
    assert gpu_peak_memory.by_site(alive) == [
        ("modeling.py:1:f | models.py:1:f", 100, 1), ("| chunked_logprobs.py:1:f < step.py:1:f", 60, 2)]
