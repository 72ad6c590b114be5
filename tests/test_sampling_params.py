"""Sampling parameters every rollout engine takes: bad ones are refused with the config key's name. (The
engines' contract: tests/test_rollout_contract.py.)"""

import pytest

from trainer.rollout.base import SamplingParams


@pytest.mark.parametrize("kwargs,message", [
    ({"n": 0}, "n and max_new_tokens must be >= 1"),
    ({"temperature": 0.0}, "rollout.temperature"),
    ({"top_p": 1.5}, "rollout.top_p"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
