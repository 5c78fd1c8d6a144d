"""The grouped-query attention the hf backend uses on CPU equals transformers' sdpa; on
CUDA, PyTorch's cuDNN attention is switched off."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from agentrl.errors import ConfigError
from agentrl.models import load_model
from agentrl.policy.attention import (
    GQA_SDPA,
    avoid_cudnn_attention,
    gqa_sdpa_attention,
    use_gqa_sdpa,
)
from agentrl.policy.hf import _gumbel_max_sample


class _Module:
    num_key_value_groups = 3
    is_causal = True


@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("masked", [True, False])
def test_gqa_attention_equals_transformers_sdpa(q_len, masked):
    torch.manual_seed(0)
    b, kv_len = 2, 12
    query, key, value = torch.randn(b, 9, q_len, 8), torch.randn(b, 3, kv_len, 8), torch.randn(b, 3, kv_len, 8)
    mask = None
    if masked:  # row 1 is left-padded by 4, and the queries are causal over the last q_len keys
        mask = torch.ones(b, 1, q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
        mask[1, :, :, :4] = False
    elif q_len > 1:
        key, value = key[:, :, :q_len], value[:, :, :q_len]  # no mask: plain causal self-attention
    ours, _ = gqa_sdpa_attention(_Module(), query, key, value, mask, scaling=1 / math.sqrt(8))
    theirs, _ = sdpa_attention_forward(_Module(), query, key, value, mask, scaling=1 / math.sqrt(8))
    assert ours.shape == theirs.shape == (b, q_len, 9, 8)
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_switched_model_gives_the_logits_of_eager_attention(tokenizer):
    model, _ = load_model("tiny-random")
    ids = torch.tensor([tokenizer.encode("one two three four five six")] * 2)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    model.set_attn_implementation("sdpa")
    assert use_gqa_sdpa(model) and model.config._attn_implementation == GQA_SDPA
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(got[0], want[0], atol=1e-4)
    assert torch.allclose(got[1, 2:], want[1, 2:], atol=1e-4)


def test_gumbel_max_sampling_follows_the_probabilities():
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]])).expand(4000, 4)
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    draws = _gumbel_max_sample(logp, gens)
    freq = torch.bincount(draws, minlength=4).float() / 4000
    assert freq[3] == 0  # a token of probability 0 is never drawn
    assert torch.allclose(freq[:3], torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


# --- avoid_cudnn_attention: PyTorch's cuDNN attention off on CUDA (per-shape graphs) ---------


def _recording_switch(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: calls.append(on))
    return calls


def test_cudnn_attention_is_switched_off_on_cuda_only(monkeypatch):
    calls = _recording_switch(monkeypatch)
    monkeypatch.delenv("AGENTRL_CUDNN_ATTENTION", raising=False)
    assert avoid_cudnn_attention("cpu") is False and calls == []
    assert avoid_cudnn_attention(torch.device("cuda", 0)) is True and calls == [False]
    assert avoid_cudnn_attention("cuda") is True and calls == [False, False]


def test_agentrl_cudnn_attention_1_keeps_it_and_a_bad_value_is_named(monkeypatch):
    calls = _recording_switch(monkeypatch)
    monkeypatch.setenv("AGENTRL_CUDNN_ATTENTION", "1")
    assert avoid_cudnn_attention("cuda") is False and calls == []
    monkeypatch.setenv("AGENTRL_CUDNN_ATTENTION", "yes")
    with pytest.raises(ConfigError, match="AGENTRL_CUDNN_ATTENTION must be 0 or 1, not 'yes'"):
        avoid_cudnn_attention("cuda")
    assert calls == []
    monkeypatch.setenv("AGENTRL_CUDNN_ATTENTION", "")  # set but empty reads as unset
    assert avoid_cudnn_attention("cuda") is True and calls == [False]


def test_loading_a_model_onto_cuda_switches_cudnn_attention_off_first(monkeypatch):
    """load_model is the one door every model (policy, trained copy, teacher) comes through."""
    calls = _recording_switch(monkeypatch)
    monkeypatch.delenv("AGENTRL_CUDNN_ATTENTION", raising=False)
    import agentrl.models as models

    models.load_model("tiny-random", device="cpu")
    assert calls == []

    class Stop(Exception):
        pass

    def no_model(seed=0):  # stop before anything touches a GPU this machine lacks
        raise Stop

    monkeypatch.setattr(models, "_tiny_random", no_model)
    monkeypatch.setattr(models, "check_device", lambda device: None)  # as if this machine had a GPU
    with pytest.raises(Stop):
        models.load_model("tiny-random", device="cuda")
    assert calls == [False]
