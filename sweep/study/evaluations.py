"""A study's evaluations as commands: the options of `python -m eval run` each evaluation gets, and what it
would record (eval.provenance) if it ran now, read through the command's own option parser (eval.cli),
so that the study compares an evaluation with exactly what its job would be given."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from sweep.study.grid import Study
from sweep.study.jobs import EvalTarget
from trainer.run_files import COMPLETE


def shared_arguments(study: Study, run_id: str) -> list[str]:
    """The options of a run's evaluations (final model and checkpoints alike) but the per-model ones."""
    spec, model = study.evaluate, study.run(run_id).config.get("model", {})
    args = [f"--samples={spec['samples']}", f"--batch-size={spec['batch_size']}",
            f"--temperature={spec['temperature']}", f"--top-p={spec['top_p']}", f"--backend={spec['backend']}",
            f"--dtype={model.get('dtype', 'float32')}", f"--device={model.get('device', 'cpu')}"]
    args += [f"--{name.replace('_', '-')}={spec[name]}" for name in ("limit", "max_gen_toks") if spec[name] is not None]
    args += [f"--data={task}={source}" for task, source in study.eval_data().items()]
    return args + (["--chat-template"] if model.get("chat_template") else [])


def model_dir(study: Study, target: EvalTarget) -> Path:
    """The model an evaluation reads: its run's final/ or its checkpoint's model/."""
    run = study.results / "runs" / target.run
    return run / ("final" if target.step is None else f"checkpoints/step_{target.step}/model")


def model_record(study: Study, target: EvalTarget) -> Path:
    """The file that names the model an evaluation scores: its run's COMPLETE, which a run trained again
    writes anew (a checkpoint's model is the run's too)."""
    return study.results / "runs" / target.run / COMPLETE


def own_arguments(study: Study, target: EvalTarget) -> list[str]:
    """One evaluation's own options: its model, where it goes, its seed (its run's), its model's record."""
    return [f"--model={model_dir(study, target)}", f"--out={study.results / 'eval' / target.key}",
            f"--seed={study.run(target.run).seed}", f"--model-record={model_record(study, target)}"]


class Expected:
    """What each of a study's evaluations would record if it ran now (its model: the run's COMPLETE as it is
    now; no digest where the run is not finished). The command line is parsed once per kind of evaluation
    and each data file read once, however many evaluations a study has."""

    def __init__(self, study: Study) -> None:
        from eval import provenance

        self.study = study
        self.identify = functools.cache(provenance.data_identity)
        self.parsed: dict[tuple[str, ...], Any] = {}

    def __call__(self, target: EvalTarget) -> dict[str, Any]:
        from eval import provenance

        settings = dataclasses.replace(self._settings(target), model=str(model_dir(self.study, target)),
                                       seed=self.study.run(target.run).seed)
        return provenance.record(settings, model_record(self.study, target), self.identify)

    def _settings(self, target: EvalTarget):
        """The settings `python -m eval run` reads from the options of the target's kind (model and seed aside)."""
        from eval.cli import parser, requests

        shared = ("--suite", target.suite, *shared_arguments(self.study, target.run))
        if shared not in self.parsed:
            args = parser().parse_args(["run", "--model", "-", "--out", "-", *shared])
            self.parsed[shared] = requests(args)[0].settings
        return self.parsed[shared]
