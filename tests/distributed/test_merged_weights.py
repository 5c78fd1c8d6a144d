"""merged_weights: what a rollout worker holding the plain model loads when the trainer trains LoRA adapters."""

from __future__ import annotations

import pytest
import torch

from agentrl.distributed.rollout_workers import merged_weights
from agentrl.models import load_model
from agentrl.train.config import TrainConfig
from agentrl.train.model import make_trainable

pytest.importorskip("peft", reason="trainable=lora needs peft (pip install peft)")


def test_merged_weights_make_the_plain_model_compute_what_the_adapted_one_does():
    torch.manual_seed(0)
    adapted, _ = load_model("tiny-random")
    plain, _ = load_model("tiny-random")
    make_trainable(adapted, TrainConfig(trainable="lora", lora={"r": 4}))
    with torch.no_grad():  # trained adapters: B is zero at init, so move it
        for n, p in adapted.named_parameters():
            if "lora_B" in n:
                p.add_(0.5 * torch.randn_like(p))
    weights = merged_weights(adapted)
    assert not [k for k in weights if "lora_" in k or "base_layer" in k]
    assert set(weights) == set(plain.state_dict())
    ids = torch.tensor([[1, 5, 9, 42, 7, 3]])
    with torch.no_grad():
        before = plain(ids).logits
        want = adapted(ids).logits
    assert (before - want).abs().max() > 1e-3  # the adapters change the output
    plain.load_state_dict(weights)
    with torch.no_grad():
        got = plain(ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    # the adapted model itself is untouched: still unmerged, still computing the same
    assert any("lora_A" in n for n, _ in adapted.named_parameters())
    with torch.no_grad():
        assert torch.equal(adapted(ids).logits, want)


def test_merged_weights_without_adapters_is_the_state_dict():
    model, _ = load_model("tiny-random")
    w = merged_weights(model)
    assert w.keys() == model.state_dict().keys()
    assert all(torch.equal(w[k], v) for k, v in model.state_dict().items())
