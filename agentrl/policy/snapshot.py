"""An ``hf`` policy over its own copy of a model's weights, refreshed only between two batches.

Asynchronous training (``agentrl.train.asynchronous``) samples the next steps
while the trainer updates its model in place: the sampler must not see those
updates mid-batch. ``SnapshotPolicy.of(policy)`` copies the weights once, and
``refresh`` copies new ones in under ``weights_lock``, so every token keeps the
version that sampled it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..errors import ConfigError
from .hf import HFPolicy

__all__ = ["SnapshotPolicy"]


class SnapshotPolicy(HFPolicy):
    """An ``hf`` policy over its own copy of a model's weights, refreshed only by ``refresh``.

    ``generate`` and ``refresh`` take ``weights_lock``, so a batch is sampled
    under one set of weights and its logprobs and version are exact.
    """

    @classmethod
    def of(cls, policy: Any) -> SnapshotPolicy:
        """A snapshot of ``policy``'s weights now, with its sampling settings and version."""
        if not isinstance(policy, HFPolicy):
            raise ConfigError(f"train.asynchronous samples from a copy of the weights, which only the hf "
                              f"backend keeps here; got a {type(policy).__name__}: set policy.backend=hf")
        with policy.weights_lock:  # not mid-batch, when the model's head may be patched (fp32_head)
            model = copy.deepcopy(policy.model)
        for p in model.parameters():  # the trainer's gradients, if any, are no part of the copy
            p.grad = None  # requires_grad stays: bf16 autocast caches casts of such weights only
        mb = policy.prefix_cache.max_bytes // 2**20 if policy.prefix_cache is not None else 0
        snap = cls(model, policy.tokenizer, policy.max_batch_size, mb, policy.prefill_pad_tokens,
                   policy.deterministic, policy.precision)
        snap.version = policy.version
        return snap

    @torch.no_grad()
    def refresh(self, net: torch.nn.Module, version: int) -> None:
        """Copy ``net``'s weights in (between two batches) and take its ``version``."""
        with self.weights_lock:
            own = self.model.state_dict()
            for k, v in net.state_dict().items():
                own[k].copy_(v)
            self.weights_updated()  # drops the keys and values of the old weights
            self.version = version
