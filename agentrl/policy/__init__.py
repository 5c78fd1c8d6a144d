"""Policy backends behind one protocol: ``generate(requests) -> results``."""

from .base import (
    GenerateRequest,
    GenerateResult,
    Policy,
    RequestControl,
    SamplingParams,
    action_text,
    request_seed,
    stop_string_hit,
)
from .batching import MicroBatcher
from .hf import HFPolicy, sampling_logprobs
from .mock import MockPolicy
from .openai import OpenAIPolicy
from .prefix_cache import CacheStats, PrefixCache
from .registry import BACKENDS, make_policy

__all__ = [
    "BACKENDS",
    "CacheStats",
    "make_policy",
    "GenerateRequest",
    "GenerateResult",
    "HFPolicy",
    "MicroBatcher",
    "MockPolicy",
    "OpenAIPolicy",
    "Policy",
    "PrefixCache",
    "RequestControl",
    "SamplingParams",
    "action_text",
    "request_seed",
    "sampling_logprobs",
    "stop_string_hit",
]
