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
from .for_run import open_policy, policy_for_run
from .hf import HFPolicy, sampling_logprobs
from .mock import MockPolicy
from .openai import OpenAIPolicy
from .prefix_cache import CacheStats, PrefixCache
from .registry import BACKENDS, make_policy
from .snapshot import SnapshotPolicy

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
    "SnapshotPolicy",
    "action_text",
    "open_policy",
    "policy_for_run",
    "request_seed",
    "sampling_logprobs",
    "stop_string_hit",
]
