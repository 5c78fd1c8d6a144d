"""sampling_logprobs: hand-computed temperature, top-k and top-p cases."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.errors import PolicyError
from agentrl.policy import SamplingParams, sampling_logprobs


def _lp(logits, **kw):
    return sampling_logprobs(torch.tensor([logits]), SamplingParams(**kw))[0]


def test_temperature_scales_logits():
    lp = _lp([0.0, math.log(3.0)], temperature=1.0)
    assert torch.allclose(lp.exp(), torch.tensor([0.25, 0.75]))
    # T=0.5 squares the odds: 1:9
    lp = _lp([0.0, math.log(3.0)], temperature=0.5)
    assert torch.allclose(lp.exp(), torch.tensor([0.1, 0.9]))


def test_top_k_renormalizes_over_the_k_best():
    lp = _lp([math.log(1), math.log(2), math.log(3), math.log(4)], top_k=2)
    assert torch.allclose(lp.exp(), torch.tensor([0.0, 0.0, 3 / 7, 4 / 7]))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = [math.log(p) for p in probs]
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: keep the first two, renormalize.
    lp = _lp(logits, top_p=0.7)
    assert torch.allclose(lp.exp(), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # p just above the first mass keeps exactly the first two as well
    lp = _lp(logits, top_p=0.51)
    assert torch.allclose(lp.exp(), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # a tiny p keeps only the most likely token
    lp = _lp(logits, top_p=0.01)
    assert torch.allclose(lp.exp(), torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_greedy_returns_the_unscaled_distribution():
    lp = _lp([0.0, math.log(3.0)], temperature=0.0)
    assert torch.allclose(lp.exp(), torch.tensor([0.25, 0.75]))


@pytest.mark.parametrize("bad", [{"max_new_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0},
                                 {"top_k": -1}, {"logprobs": -2}])
def test_invalid_sampling_parameters_fail_naming_the_field(bad):
    with pytest.raises(PolicyError, match=next(iter(bad))):
        SamplingParams(**bad)
