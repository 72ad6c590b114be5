"""SmolLM2-135M-Instruct through the pipeline: training steps with each engine, preempted and resumed;
lm-eval on it with the chat template, scored by the verifier. Short lengths and few samples: these
check that a real model runs through every part, not what it learns."""

import json
import signal
import subprocess
import sys

import pytest
from run_helpers import metrics, start_cli, train_cli, wait_for_lines
from vllm_required import require_vllm

from eval.verify import score
from trainer.model.models import format_prompt, load_tokenizer
from trainer.run import COMPLETE, EXIT_PREEMPTED
from trainer.tasks import make_task

# 2 prompts x 2 samples of up to 24 tokens a step: one-digit sums asked in words, through the chat template
SMOL_RUN = {
    "model.chat_template": "true",
    "task.options": "{prompt: natural, max_operand: 9}",
    "rollout.max_new_tokens": 24,
    "rollout.vllm_max_model_len": 256,
    "objective.estimator": "k3",
    "objective.placement": "reward+loss",
    "objective.beta": 0.05,
    "train.steps": 3,
    "train.prompts_per_step": 2,
    "train.group_size": 2,
    "train.lr": "1e-5",
    "checkpoint.every": 1,
}


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_smollm2_trains_with_each_engine_and_resumes_after_preemption(smollm2, tmp_path, engine):
    """SIGTERM after the first step: the run checkpoints and exits 75; the same command resumes it. The
    engine samples from the trainer's weights at every step (the weights change: lr 1e-5), and the
    final model is a whole HF directory with SmolLM2's tokenizer and chat template."""
    if engine == "vllm":
        require_vllm()
    out = tmp_path / engine
    process = start_cli(out, smollm2, base=SMOL_RUN, **{"rollout.engine": engine})
    wait_for_lines(out, 1, process, timeout=900)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=600) == EXIT_PREEMPTED, process.stderr.read()[-3000:]
    assert not (out / COMPLETE).exists()
    resumed = train_cli(out, smollm2, timeout=900, base=SMOL_RUN, **{"rollout.engine": engine})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint step_" in resumed.stderr
    lines = metrics(out)
    assert [m["step"] for m in lines] == [0, 1, 2]
    for m in lines:
        assert m["mismatch_logp_max"] < (1e-3 if engine == "vllm" else 1e-4), m
        assert m["generated_tokens"] > 0 and m["skipped_updates"] == 0
    assert sum(m["stop_frac"] for m in lines) > 0  # some completions ended with <|im_end|>
    imported, final = load_tokenizer(str(smollm2)), load_tokenizer(str(out / "final"))
    assert final.chat_template == imported.chat_template and final.eos_token_id == imported.eos_token_id == 2
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["tie_word_embeddings"] and "quantization_config" not in config


def test_lm_eval_runs_smollm2_with_its_chat_template_on_the_training_prompts(smollm2, tmp_path):
    """`python -m eval run` (lm-eval's hf backend) on arithmetic asked in words: the prompt lm-eval gives
    the model is the trainer's, character for character, and every response is scored by the verifier
    that scores training rewards."""
    data = tmp_path / "arith.jsonl"
    export = subprocess.run([sys.executable, "-m", "trainer", "export-data", "--task", "arithmetic", "--option",
                             "max_operand=9", "--option", "seed=1", "--n", "3", "--out", str(data)],
                            capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr
    out = tmp_path / "eval"
    done = subprocess.run([sys.executable, "-m", "eval", "run", "--model", str(smollm2), "--suite", "arith_natural",
                           "--chat-template", "--samples", "2", "--max-gen-toks", "48", "--batch-size", "6",
                           "--data", f"arith_natural={data}", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "metrics.json").read_text())["tasks"]["arith_natural"]
    assert result["n"] == 3 and 0 <= result["value"] <= 1
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    tokenizer = load_tokenizer(str(smollm2))
    task = make_task("arithmetic", {"prompt": "natural", "max_operand": 9, "seed": 1})
    scores = []
    for sample in samples:
        problem = task.problem(sample["doc_id"])
        assert sample["prompt"] == task.prompt(problem, tokenizer, chat=True)
        assert sample["prompt"] == format_prompt(tokenizer, problem.question, chat=True)
        assert len(sample["responses"]) == 2 and not any("<|im_end|>" in r for r in sample["responses"])
        scores += [score(r, problem.answer) for r in sample["responses"]]
    assert result["value"] == pytest.approx(sum(scores) / len(scores))
