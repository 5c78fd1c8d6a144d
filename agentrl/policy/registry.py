"""Backends by name: ``make_policy(PolicyConfig)`` builds the one a config asks for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import PolicyConfig
from ..errors import PolicyError
from ..models import load_model, load_tokenizer
from .base import Policy
from .hf import HFPolicy
from .mock import MockPolicy

__all__ = ["BACKENDS", "make_policy"]


def _hf(cfg: PolicyConfig) -> Policy:
    model, tokenizer = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
    return HFPolicy(model, tokenizer, max_batch_size=cfg.max_batch_size, prefix_cache_mb=cfg.prefix_cache_mb)


def _mock(cfg: PolicyConfig) -> Policy:
    return MockPolicy(load_tokenizer(cfg.model), cfg.mock_responses)


BACKENDS: dict[str, Callable[[PolicyConfig], Any]] = {"hf": _hf, "mock": _mock}


def make_policy(cfg: PolicyConfig) -> Policy:
    if cfg.backend not in BACKENDS:
        raise PolicyError(f"unknown policy backend {cfg.backend!r}; known: {sorted(BACKENDS)}")
    return BACKENDS[cfg.backend](cfg)
