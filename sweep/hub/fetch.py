"""The fetch step: a study's hub models and data sets into the shared cache, on the submitting node.

It runs where Snakemake runs (the login node, which has the network and the token), before any job:
by itself as `python -m sweep fetch --configfile STUDY.yaml`, and inside every Snakemake run that
is to run jobs (the Snakefile's onstart) for whatever the cache lacks. The jobs then run offline
(sweep.hub.job_env). A gated model without a token here is one error naming the model and the fix.
"""

from __future__ import annotations

import shlex

from sweep.hub.hub_needs import Need, cached
from sweep.study import configfiles
from sweep.study.checks import StudyError


class FetchError(StudyError):
    """A model or data set that could not be fetched; the message names its study key."""


def command(files) -> str:
    """The command that fetches a study's models and data sets (for messages and docs)."""
    return shlex.join(["python", "-m", "sweep", "fetch", *configfiles.arguments(files)])


def fetch_missing(needs: list[Need], say=print) -> list[Need]:
    """Fetch each need the cache lacks (saying so through `say`); the ones fetched. A fetch that fails (the hub
    away mid-way) is one error naming it and what is still missing; what was fetched stays in the cache, and
    the next fetch takes only what it lacks."""
    missing = [need for need in needs if not cached(need)]
    for number, need in enumerate(missing):
        say(f"klstudy fetch: {need} ({need.key}) into the Hugging Face cache")
        try:
            (_model if need.kind == "model" else _dataset)(need)
        except FetchError as error:
            left = missing[number + 1:]
            still = f"; still missing after it: {', '.join(map(str, left))}" if left else ""
            raise FetchError(f"{error}{still} ({number} of {len(missing)} fetched and kept: fetch again once the hub "
                             "answers, and only what the cache lacks is fetched)") from None
    return missing


def _model(need: Need) -> None:
    from huggingface_hub import get_token, snapshot_download
    from huggingface_hub.errors import GatedRepoError

    from trainer.model.models import FETCH_PATTERNS

    try:
        snapshot_download(need.hub_id, allow_patterns=list(FETCH_PATTERNS))
    except GatedRepoError:
        hint = ("the token this node has is not allowed it (ask for access on the model's hub page)" if get_token()
                else "this node has no token (export HF_TOKEN=hf_... or run `hf auth login` here, then run again; "
                "the token stays on this node: no job gets it)")
        raise FetchError(f"{need.key}: {need.hub_id} is a gated model and {hint}") from None
    except Exception as error:  # network, no such repository: many exception types
        raise FetchError(f"{need.key}: could not fetch {need.hub_id} ({_first_line(error)})") from None


def _dataset(need: Need) -> None:
    import datasets

    try:
        datasets.load_dataset(need.hub_id, need.subset)
    except Exception as error:  # network, authentication, format: many exception types
        raise FetchError(f"{need.key}: could not fetch {need} ({_first_line(error)})") from None


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
