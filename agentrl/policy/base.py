"""The policy protocol: token ids in; token ids, logprobs and entropies out.

Every backend (``hf``, ``mock``, ``vllm``, ``openai``) implements
``generate(requests) -> results`` (sync, a batch), ``await agenerate(request)``
(one request; the backend batches concurrent calls: a micro-batcher for ``hf``,
continuous batching for ``vllm``) and ``update_weights(state_dict)``, and counts
its weight ``version`` so each sampled token can be traced to the weights that
sampled it.

Stop strings, the same in every backend: generation ends at the token that
completes the first stop string. ``token_ids`` keep every sampled token up to
and including that one (token-exact: a token is never split). A stop string
matches the text as the env and the user see it: decoded without special
tokens (vLLM's ``skip_special_tokens``), so one that a special token splits
matches, and a special token's own text (``<|im_end|>``) never does; stop on
such a token with ``stop_token_ids``. The env sees ``action_text``: that text,
cut right after the stop string, which stays in the text.

Seeds: each request draws from its own random stream, seeded by
``SamplingParams.seed``, so its sample does not depend on which other requests
share its batch. ``request_seed`` derives independent seeds from a run seed and
an episode's coordinates.

Live requests: a request may carry a ``RequestControl``, through which its
caller cancels it while it runs, and sees its tokens as they are sampled (to
stream them). A backend honours what it can (see ``RequestControl``).
"""

from __future__ import annotations

import contextlib
import hashlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from ..errors import PolicyError

__all__ = ["GenerateRequest", "GenerateResult", "Policy", "RequestControl", "SamplingParams", "action_text",
           "request_seed", "stop_string_hit"]

FinishReason = Literal["stop", "length", "stop_string", "cancelled"]
# The lowest temperature that samples: vLLM decodes greedily below it (_SAMPLING_EPS), and far
# below it fp32 logits divided by the temperature overflow (hf then samples token 0, logprob NaN).
MIN_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How to sample. ``temperature=0`` is greedy; a sampling temperature is at least
    ``MIN_TEMPERATURE``. ``top_k=0`` and ``top_p=1`` disable them.

    ``logprobs`` is how many top-k alternatives to return per token (0: none).
    ``seed`` seeds this request's own random stream (None: a fresh random seed).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        bad = [f"{name}={getattr(self, name)!r} ({rule})" for name, ok, rule in (
            ("temperature", self.temperature == 0 or self.temperature >= MIN_TEMPERATURE,
             f"0 for greedy, or >= {MIN_TEMPERATURE}"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= 0, ">= 0"),
            ("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
            ("logprobs", self.logprobs >= 0, ">= 0"),
            ("stop", all(self.stop), "no empty string: it is in every text"),
        ) if not ok]
        if bad:
            raise PolicyError("invalid sampling parameters: " + ", ".join(bad))


class RequestControl:
    """A caller's live handle on one request while a backend works on it.

    - ``cancel()``: the caller will not read the result (its client left).
      The request still returns a result, with finish reason ``cancelled``:
      cancelling a control never raises ``CancelledError`` out of a backend.
      ``hf`` drops the row from its running batch at the next decode step,
      with the tokens sampled so far, so an abandoned long reply stops holding
      up the requests batched after it; ``vllm`` aborts the request in the
      engine, with the tokens it reported so far (none unless the request
      streams through ``on_token``). A cancelled *awaiting task* is another
      thing: its ``CancelledError`` is the caller's own and propagates, and
      the backend drops the request too (``MicroBatcher`` cancels its
      control; ``vllm`` aborts it).
    - ``on_token``: called with each token id as it is sampled, on the
      backend's thread, so that a server can stream a reply while it is
      decoded (``hf``, ``vllm``; other backends never call it). It must be quick
      and must not raise.
    """

    __slots__ = ("cancelled", "on_token")

    def __init__(self, on_token: Callable[[int], None] | None = None):
        self.cancelled = False
        self.on_token = on_token

    def cancel(self) -> None:
        self.cancelled = True


@dataclass(slots=True)
class GenerateRequest:
    """One prompt, as token ids, and how to continue it; ``control`` is the caller's live handle.

    ``admissible``: the reply must spell one of these actions, then end
    (``policy.constrain``; a backend without ``constrains_actions`` refuses it).
    ``admissible_head``: how many of the prompt's last tokens already begin
    that reply (a segment fork continues a turn).
    """

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    control: RequestControl | None = None
    admissible: tuple[str, ...] | None = None
    admissible_head: int = 0


@dataclass(slots=True)
class GenerateResult:
    """What was sampled for one request.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the
    distribution it was sampled from (after temperature, top-k and top-p).
    ``entropies[i]`` is the entropy of that distribution. Greedy decoding
    (``temperature=0``) samples from a point mass, which has no useful
    logprobs; there both are those of the model's unprocessed distribution
    (temperature 1, no top-k or top-p), as vLLM reports by default. ``top_logprobs[i]``
    lists ``(token_id, logprob)`` of the most likely tokens when asked for.
    ``finish_reason`` is ``stop`` (EOS or a stop token), ``stop_string``,
    ``length`` (hit ``max_new_tokens``: the turn is truncated) or ``cancelled``
    (its ``RequestControl`` was cancelled; a result nobody reads).
    ``cached_tokens`` counts the prompt tokens served from a prefix cache
    instead of prefilled.
    """

    token_ids: list[int]
    logprobs: list[float]
    entropies: list[float]
    finish_reason: FinishReason
    version: int
    top_logprobs: list[list[tuple[int, float]]] | None = None
    cached_tokens: int = 0


@runtime_checkable
class Policy(Protocol):
    """What the rollout code needs from a model backend."""

    version: int
    tokenizer: Any

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]: ...

    async def agenerate(self, request: GenerateRequest) -> GenerateResult:
        """One request, awaited; the backend batches concurrent calls itself."""
        ...

    def update_weights(self, state_dict: dict[str, Any]) -> None: ...


def request_seed(*coords: int) -> int:
    """A 63-bit seed from coordinates such as (run seed, episode, turn, branch).

    Hashing keeps nearby coordinates' streams unrelated: seeds ``s + i`` would
    make episode i's turn t+1 replay episode i+1's turn t.
    """
    digest = hashlib.blake2b(repr(tuple(int(c) for c in coords)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def stop_string_hit(tokenizer: Any, token_ids: Sequence[int], stop: Sequence[str]) -> bool:
    """Whether the text of ``token_ids``, decoded without special tokens as ``action_text``
    decodes it, ends in a tail that contains a stop string.

    Called after every new token, so only a tail long enough to hold the
    longest stop string is decoded: a token decodes to at least one character,
    or a quarter of one for byte-fallback pieces, except a special token, which
    decodes to nothing and so does not count toward the tail's length.
    """
    if not stop:
        return False
    need, silent = 4 * max(map(len, stop)) + 4, special_ids(tokenizer)
    start = len(token_ids)
    while start > 0 and need > 0:
        start -= 1
        need -= token_ids[start] not in silent
    tail = tokenizer.decode(list(token_ids[start:]), skip_special_tokens=True)
    return any(s in tail for s in stop)


_SPECIAL_IDS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids that ``decode(..., skip_special_tokens=True)`` drops: the named special tokens
    and every added token marked special (SmolLM2's ``<repo_name>`` is one, though not named).

    Kept per tokenizer: ``stop_string_hit`` asks after every sampled token, and a tokenizer's
    special tokens are fixed once a model's embeddings are sized to its vocabulary."""
    try:
        return _SPECIAL_IDS[tokenizer]
    except (KeyError, TypeError):  # TypeError: a tokenizer that cannot be weakly referenced
        pass
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, tok in added.items() if getattr(tok, "special", False))
    found = frozenset(ids)
    with contextlib.suppress(TypeError):
        _SPECIAL_IDS[tokenizer] = found
    return found


def action_text(tokenizer: Any, token_ids: Sequence[int], stop: Sequence[str] = ()) -> str:
    """The text an env sees for an action: decoded, cut right after the first stop string."""
    text = tokenizer.decode(list(token_ids), skip_special_tokens=True)
    ends = [i + len(s) for s in stop if (i := text.find(s)) >= 0]
    return text[:min(ends)] if ends else text
