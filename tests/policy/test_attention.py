"""The grouped-query attention the hf backend uses on CPU equals transformers' sdpa."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from agentrl.models import load_model
from agentrl.policy.attention import GQA_SDPA, gqa_sdpa_attention, use_gqa_sdpa
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
