"""The policy protocol: token ids in; token ids, logprobs and entropies out.

Every backend (``hf``, ``mock``, later ``vllm`` and ``openai``) implements
``generate(requests) -> results`` and ``update_weights(state_dict)``, and counts
its weight ``version`` so each sampled token can be traced to the weights that
sampled it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = ["GenerateRequest", "GenerateResult", "Policy", "SamplingParams"]

FinishReason = Literal["stop", "length", "stop_string"]


@dataclass(slots=True)
class SamplingParams:
    """How to sample. ``temperature=0`` is greedy. ``top_k=0`` and ``top_p=1`` disable them.

    ``logprobs`` is how many top-k alternatives to return per token (0: none).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0
    seed: int | None = None


@dataclass(slots=True)
class GenerateRequest:
    """One prompt, as token ids, and how to continue it."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(slots=True)
class GenerateResult:
    """What was sampled for one request.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the
    distribution it was sampled from (after temperature, top-k and top-p).
    ``entropies[i]`` is the entropy of that distribution. ``top_logprobs[i]``
    lists ``(token_id, logprob)`` of the most likely tokens when asked for.
    ``finish_reason`` is ``stop`` (EOS or a stop token), ``stop_string`` or
    ``length`` (hit ``max_new_tokens``: the turn is truncated).
    """

    token_ids: list[int]
    logprobs: list[float]
    entropies: list[float]
    finish_reason: FinishReason
    version: int
    top_logprobs: list[list[tuple[int, float]]] | None = None


@runtime_checkable
class Policy(Protocol):
    """What the rollout code needs from a model backend."""

    version: int
    tokenizer: Any

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]: ...

    def update_weights(self, state_dict: dict[str, Any]) -> None: ...
