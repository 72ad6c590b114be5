"""vLLM for the tests that run it: skipped where it is not installed, unless KLSTUDY_REQUIRE_VLLM=1
(set by .ci/run, after `make setup-vllm`), where a missing vLLM fails them instead."""

import os

import pytest


def require_vllm():
    """The vllm module, or skip (fail under KLSTUDY_REQUIRE_VLLM=1) with the command that installs it."""
    try:
        import vllm
    except ImportError as error:
        if os.environ.get("KLSTUDY_REQUIRE_VLLM") == "1":
            pytest.fail(f"KLSTUDY_REQUIRE_VLLM=1 but vllm does not import ({error}): run make setup-vllm")
        pytest.skip("vllm is not installed (make setup-vllm installs its CPU build)")
    return vllm
