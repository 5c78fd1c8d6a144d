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


def test_wire_weights_sends_a_tied_weight_once_from_any_device(monkeypatch):
    """A tied LM head is sent once. On a GPU each ``.cpu()`` makes its own copy, so a check of
    the copies' addresses never found the twin: the embedding went twice per sync. Simulated
    here on the CPU, where ``.cpu()`` is a no-op, by making it copy as a device transfer does."""
    from agentrl.distributed.weights import wire_weights

    emb = torch.randn(16, 4)
    bias = torch.zeros(0)  # empty tensors share address 0 and are never deduplicated
    state = {"embed.weight": emb, "lm_head.weight": emb, "other": torch.ones(3), "b1": bias, "b2": torch.zeros(0)}
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self: self.clone())
    out = wire_weights(state)
    assert list(out) == ["embed.weight", "other", "b1", "b2"]
    assert (out["embed.weight"] == emb.numpy()).all()
    head = emb.t()  # same address, another shape: not a twin
    assert list(wire_weights({"a": emb, "b": head})) == ["a", "b"]
