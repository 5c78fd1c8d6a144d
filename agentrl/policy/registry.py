"""Backends by name: ``make_policy(PolicyConfig)`` builds the one a config asks for."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from ..config import PolicyConfig
from ..errors import PolicyError
from ..models import load_model, load_tokenizer
from ..precision import resolved_precision
from .base import Policy
from .hf import HFPolicy
from .mock import MockPolicy

__all__ = ["BACKENDS", "make_policy", "resolve_backend"]


def _hf(cfg: PolicyConfig) -> Policy:
    precision = resolved_precision(cfg.precision, cfg.device, "policy.precision")
    model, tokenizer = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
    return HFPolicy(model, tokenizer, max_batch_size=cfg.max_batch_size, prefix_cache_mb=cfg.prefix_cache_mb,
                    precision=precision)


def _vllm(cfg: PolicyConfig) -> Policy:
    from .vllm import VLLMPolicy  # imports vLLM lazily; its constructor says how to install it

    v = cfg.vllm
    extra = {} if v.gpu_memory_utilization is None else {"gpu_memory_utilization": v.gpu_memory_utilization}
    return VLLMPolicy(cfg.model, dtype=v.dtype or cfg.dtype, max_model_len=v.max_model_len,
                      enforce_eager=v.enforce_eager, kv_cache_gb=v.kv_cache_gb,
                      tensor_parallel_size=v.tensor_parallel_size, **extra)


def _openai(cfg: PolicyConfig) -> Policy:
    from .openai import OpenAIPolicy

    if not cfg.base_url:
        raise PolicyError("backend openai needs policy.base_url (the server's URL, ending in /v1)")
    return OpenAIPolicy(cfg.base_url, cfg.served_model or cfg.model, load_tokenizer(cfg.model),
                        api_key=cfg.api_key)


def _mock(cfg: PolicyConfig) -> Policy:
    return MockPolicy(load_tokenizer(cfg.model), cfg.mock_responses)


BACKENDS: dict[str, Callable[[PolicyConfig], Any]] = {"hf": _hf, "vllm": _vllm, "openai": _openai, "mock": _mock}


def resolve_backend(name: str) -> tuple[str, str]:
    """The backend ``auto`` stands for, and why: vLLM where it is installed (it was the
    faster one on the same batch: ``bench/backend_compare.json``), else ``hf``."""
    if name != "auto":
        return name, "configured"
    if importlib.util.find_spec("vllm") is not None:
        return "vllm", "auto: vllm is installed, and was faster than hf on the same batch"
    return "hf", "auto: vllm is not installed here (make vllm builds .venv-vllm)"


def make_policy(cfg: PolicyConfig) -> Policy:
    if cfg.backend == "auto":
        cfg = cfg.model_copy(update={"backend": resolve_backend("auto")[0]})
    if cfg.backend not in BACKENDS:
        raise PolicyError(f"unknown policy backend {cfg.backend!r}; known: {sorted(BACKENDS)}")
    return BACKENDS[cfg.backend](cfg)
