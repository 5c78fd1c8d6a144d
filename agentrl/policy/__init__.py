"""Policy backends behind one protocol: ``generate(requests) -> results``."""

from .base import GenerateRequest, GenerateResult, Policy, SamplingParams
from .hf import HFPolicy, sampling_logprobs
from .mock import MockPolicy
from .registry import BACKENDS, make_policy

__all__ = [
    "BACKENDS",
    "make_policy",
    "GenerateRequest",
    "GenerateResult",
    "HFPolicy",
    "MockPolicy",
    "Policy",
    "SamplingParams",
    "sampling_logprobs",
]
