"""The loop of one run: build its parts, then step, measure when due, checkpoint when due or on SIGTERM.

`train(config, out_dir)` runs (or resumes, or skips if finished) one run. The run directory holds
config.yaml, metrics.jsonl (one line per step), checkpoints/step_N/, final/ (an HF model directory
with the tokenizer) and COMPLETE. SIGTERM makes the run checkpoint after the current step and exit
with EXIT_PREEMPTED, so that a scheduler can requeue it and the same command resumes it.

Started by `accelerate launch` (or torchrun) as several processes, the run shards the policy and
the reference with FSDP2 (`trainer.distributed`). Each process generates, scores and trains on its
share of every minibatch's prompts; the main process writes everything in the run directory. The
update is the one a single process would make: each prompt samples from its own seed, and every
loss part is normalised by the whole minibatch's rows and tokens.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eval.verify import Verifier
from trainer.config import ConfigError, RunConfig
from trainer.distributed import World, full_parameters, full_state_dict
from trainer.lease import Lease, LeaseHeld, LeaseLost
from trainer.measure.objective import ObjectiveProbe
from trainer.model.models import load_tokenizer, resolve, save_pretrained_atomic
from trainer.progress import progress_bar
from trainer.rollout import make_engine
from trainer.run import directory, state
from trainer.run.directory import DirectoryTaken
from trainer.run.errors import EXIT_PREEMPTED, Preempted
from trainer.run.measurement import ObjectiveMeasurement
from trainer.run.policies import Policies
from trainer.run.producer import Producer
from trainer.run.step import Learner, run_step
from trainer.run.stop_rule import StopRule
from trainer.run_files import METRICS, OBJECTIVE, read_metrics
from trainer.tasks import Task, make_task

log = logging.getLogger(__name__)


class SigtermFlag:
    """Records SIGTERM instead of dying, so the loop can checkpoint first. `train-runs` holds one over all
    its runs: a SIGTERM during one run (even in its last step, which then completes) starts no other."""

    def __init__(self) -> None:
        self.raised = False
        self._previous: Any = None

    def __enter__(self) -> "SigtermFlag":
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def reached_any(self, world: World) -> bool:
        """Whether SIGTERM reached any process of `world` (one collective): all of them must stop together."""
        return any(world.gather(self.raised))

    def _handle(self, signum: int, frame: Any) -> None:
        log.warning("SIGTERM received: checkpointing after this step, then exiting with %d", EXIT_PREEMPTED)
        self.raised = True

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self._previous)


def check_before_loading(config: RunConfig) -> Task:
    """Everything that can be checked before a model loads: the model's location and the data."""
    try:
        resolve(config.model.path)
    except ValueError as error:
        raise ConfigError("model.path", str(error)) from None
    return make_task(config.task.name, config.task.options)


def check_world(config: RunConfig, world: World) -> None:
    """Every process must hold whole groups of every minibatch, in whole micro-batches."""
    t = config.train
    per_minibatch = t.prompts_per_step // t.minibatches
    if per_minibatch % world.size:
        raise ConfigError("train.prompts_per_step", f"{t.prompts_per_step} prompts in {t.minibatches} minibatch(es) "
                          f"do not split evenly over {world.size} processes")
    rows = per_minibatch // world.size * t.group_size
    if t.micro_batch_size and rows % t.micro_batch_size:
        raise ConfigError("train.micro_batch_size", f"{t.micro_batch_size} does not divide the {rows} completions "
                          f"each process trains on per minibatch")
    if config.measure.prompts % world.size:
        raise ConfigError("measure.prompts", f"{config.measure.prompts} held-out prompts do not split evenly over "
                          f"{world.size} processes")


class Run:
    """One training run in `out_dir`, as its parts: the policies, the engine, the producer of batches, the
    train state; `train()` is the entry point."""

    def __init__(self, config: RunConfig, out_dir: Path, world: World | None = None) -> None:
        world = world or World()
        self.config, self.out, self.world = config, Path(out_dir), world
        self.task = check_before_loading(config)
        check_world(config, world)
        self.lease: Lease | None = directory.claim(self.out, config, world)  # the main process's
        c = config
        self.tokenizer = load_tokenizer(c.model.path)
        self.policies = Policies(c, world, directory.checkpoints_dir(self.out))
        self.engine = make_engine(c, self.policies.engine_model, self.tokenizer, world,
                                  weights=lambda: full_parameters(self.policies.policy, prefix="lm."))
        resumed = self.policies.resumed
        if resumed is not None:
            self.engine.sync_weights()
        self.state = state.TrainState.new(c, self.policies.policy)
        self.state.saved_step = resumed[0] if resumed is not None else None
        self.learner = Learner(self.policies, self.state, c.train, world)
        self.checkpoints = state.Checkpoints(self.out, c, world, self.tokenizer)
        self.verifier = Verifier(timeout=c.verifier.timeout, workers=c.verifier.workers)
        self.producer = Producer(c, self.task, self.tokenizer, world, self.policies, self.engine, self.verifier)
        self.measurement = None
        if c.measure.prompts:
            probe = ObjectiveProbe(c, self.tokenizer, world)
            self.measurement = ObjectiveMeasurement(probe, self.engine, self.verifier, self.out, world.main)
        torch.manual_seed(c.train.seed)
        np.random.seed(c.train.seed)
        random.seed(c.train.seed)

    # the parts tests and benchmarks read
    @property
    def lm(self):
        return self.policies.lm

    @property
    def policy(self):
        return self.policies.policy

    @property
    def pending(self):
        return self.producer.pending

    @property
    def step(self) -> int:
        return self.state.step

    def run_step(self) -> dict[str, Any]:
        return run_step(self.config, self.learner, self.producer, self.engine, self.verifier)

    def save_checkpoint(self) -> None:
        self.checkpoints.save(self.state, self.policies, self.producer, self.verifier, self.lease)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def _due_for_measurement(self) -> bool:
        every, step = self.config.measure.every, self.state.step
        return self.measurement is not None and (step == self.config.train.steps or (every and step % every == 0))

    def train(self, sigterm: SigtermFlag) -> None:
        c, main, s = self.config, self.world.main, self.state
        self.checkpoints.restore(self.state, self.policies, self.producer, self.verifier)
        if self.measurement is not None and s.step < c.train.steps:
            self.measurement.prepare(s.step)
        done = read_metrics(self.out / METRICS) if c.train.stop_if.ess_below else []  # a resumed run's streak
        rule = StopRule(c.train.stop_if, [m for m in done if m["step"] < s.step])  # truncated or not yet
        metrics_file = (self.out / METRICS).open("a") if main else None
        bar = progress_bar(c.train.steps, "train", show=None if main else False)
        bar.update(s.step)
        try:
            if s.step < c.train.steps and sigterm.reached_any(self.world):  # SIGTERM while loading
                raise Preempted
            while s.step < c.train.steps:
                metrics = self.run_step()
                if metrics_file is not None:
                    self.lease.check()
                    metrics_file.write(json.dumps(metrics) + "\n")
                    metrics_file.flush()
                bar.update()
                bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", kl=f"{metrics['kl_k3']:.4f}")
                rule.check(metrics)  # every process: their metrics are the same
                if self._due_for_measurement():
                    beta = s.coefficient.objective(c.objective).beta
                    measured = self.measurement.measure(s.step, self.policies, beta)
                    if main:
                        with (self.out / OBJECTIVE).open("a") as handle:
                            handle.write(json.dumps(measured) + "\n")
                stopping = sigterm.reached_any(self.world)  # one collective per step
                if s.step % c.checkpoint.every == 0 or stopping:
                    self.save_checkpoint()
                if stopping and s.step < c.train.steps:
                    raise Preempted
        except Preempted:
            if s.step and s.saved_step != s.step:
                self.save_checkpoint()
            raise
        finally:
            bar.close()
            if metrics_file is not None:
                metrics_file.close()
            self.verifier.close()
        weights = full_state_dict(self.policies.policy, prefix="lm.")
        if main:
            self.lease.check()
            save_pretrained_atomic(self.out / "final", self.policies.lm, self.tokenizer, state_dict=weights)
            log.info("run complete: %s (final model written)", self.out)
        self.world.barrier()


def train(config: RunConfig, out_dir: Path, sigterm: SigtermFlag | None = None, world: World | None = None) -> int:
    """Run, resume or skip (if complete) the run in `out_dir`; the process exit status. `sigterm` and `world`:
    the flag and the process group of a process that trains several runs (else the run holds its own). A
    process joins its group once: joined again for a second run, rank 0 waited to re-form it while the others
    went on in the old one.

    A finished run is left exactly as it is: nothing in it is opened for writing. A run that fails
    records why in FAILED (trainer.run_files), with its log, `train.log`, which every attempt appends
    to; a trainer stopped because another one holds the directory writes nothing there."""
    out_dir = Path(out_dir)
    if directory.is_complete(out_dir):
        log.info("%s is already complete; nothing to do", out_dir)
        return 0
    # from the start: a SIGTERM during loading also ends in a clean exit
    with contextlib.nullcontext(sigterm) if sigterm is not None else SigtermFlag() as sigterm:
        own_world = world is None
        world = World.from_environment(config.model.device) if own_world else world
        run, trained = None, False
        try:
            if sigterm.reached_any(world):  # during an earlier run of this process: this one waits
                log.warning("%s not started: SIGTERM came before it; exiting with %d", out_dir, EXIT_PREEMPTED)
                return EXIT_PREEMPTED
            with directory.run_log(out_dir, world.main):
                try:
                    run = Run(config, out_dir, world)
                    run.train(sigterm)
                    trained = True
                except Preempted:
                    saved = "checkpoint written" if run.step else "no step to checkpoint yet"  # stopped while loading
                    log.warning("preempted at step %d; %s, exiting with %d", run.step, saved, EXIT_PREEMPTED)
                    return EXIT_PREEMPTED
                except (LeaseHeld, LeaseLost, DirectoryTaken):
                    raise  # the directory is another trainer's, or another run's: nothing is recorded in it
                except Exception as error:
                    directory.record_error(out_dir, error, run.step if run is not None else None, world.main)
                    raise
                finally:
                    if run is not None:
                        run.engine.close()  # before the process group goes: vLLM tears down its groups in it
            if trained and world.main:
                directory.mark_complete(out_dir, run.lease, run.step, config)
        finally:
            if run is not None:
                run.release()
            if own_world:
                world.close()
    return 0
