"""Token-exact chat context.

``ChatContext`` holds the exact token ids a policy has seen and sampled in one
episode. The opening messages are rendered with the tokenizer's chat template
once. Sampled action tokens are appended exactly as sampled. Each observation
is appended as the template rendering of the new messages only (the "delta"),
never by re-rendering the history, so the training sequence is the sampled one.

How a delta is rendered: the new messages are rendered after a fixed base
conversation (system, user, assistant with placeholder text) and the base's own
rendering is cut off the front. The text the template puts after an assistant
message (``<|im_end|>\\n`` for ChatML) is closed first, minus whatever of it the
action already sampled (usually the EOS token). What the action sampled is
decided from token ids, never from decoded text: an action cut at
``max_new_tokens`` whose text happens to end in ``<|`` sampled plain-text
tokens, not the special end token, so the whole terminator is still appended.

The template is rendered once per role to learn the text it puts around a
single message's content; a one-message delta (the usual observation) is then
built by string concatenation, not a template render. This is exact for
templates that insert content verbatim, which the probe checks; others, and
content with leading or trailing whitespace (which templates may trim), take
the full render.

The context holds token ids only. The loss mask and behaviour logprobs of a
training sequence come from the tree's nodes (``Episode.from_path``), which
keep the logprobs each action was sampled with.

Templates that are not prefix-stable (say, ones that drop an earlier
``<think>`` block when later messages are rendered) make the appended context
differ from a full re-render. ``ChatContext`` keeps what the policy saw, and
reports the mismatch: ``prefix_stable`` turns False, ``mismatches`` records the
turn, and a ``TemplateMismatchWarning`` is issued once per context. The full
re-render costs time that grows with the episode, so ``check_prefix=N`` checks
the first two observations and then every N-th.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .errors import ContextOverflowError
from .types import Message

__all__ = ["OFF_LOOP_CHARS", "ChatContext", "TemplateMismatchWarning", "decode_ids", "off_loop_if_long",
           "render_ids"]


@dataclass(slots=True)
class _Probe:
    """What one tokenizer's template puts around messages, learnt once (see ``_PROBES``).

    ``unsampled[k]``: the terminator text left to append after an action whose
    last k tokens are the terminator's first k (None: those tokens do not
    decode to a head of the terminator text). ``frames``: per role, the text
    before and after a single message's content, or None when the template
    does not insert content verbatim.
    """

    terminator: str
    base: str
    terminator_ids: list[int]
    unsampled: dict[int, str | None]
    frames: dict[str, tuple[str, str] | None] = field(default_factory=dict)


# (tokenizer id, template, kwargs) -> its probe, shared by every context on that template
_PROBES: dict[tuple[Any, ...], _Probe] = {}

_BASE: list[dict[str, Any]] = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": "A"},
]


class TemplateMismatchWarning(UserWarning):
    """The chat template is not prefix-stable: a full re-render differs from the context."""


def _as_dicts(messages: Sequence[Message | dict[str, Any]]) -> list[dict[str, Any]]:
    return [m.to_template() if isinstance(m, Message) else dict(m) for m in messages]


def _render_text(tokenizer: Any, messages: list[dict[str, Any]], gen_prompt: bool, **kw: Any) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=gen_prompt, **kw
    )


def decode_ids(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    """``tokenizer.decode(ids)``, minus transformers' scan of every id.

    ``PreTrainedTokenizerBase.decode`` first walks the ids to convert tensors
    and arrays (``to_py_obj``), which on a long context costs more than the
    decode itself, then calls the tokenizer's ``_decode``. A tokenizer whose
    ``decode`` is transformers' own is sent straight to ``_decode`` (which
    takes any sequence of ints); any other is asked as usual.
    """
    if _decode_is_transformers(type(tokenizer)):
        return tokenizer._decode(ids, skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@functools.cache
def _decode_is_transformers(cls: type) -> bool:
    base = sys.modules.get("transformers.tokenization_utils_base")  # loaded if cls comes from it
    return (base is not None and hasattr(cls, "_decode")
            and getattr(cls, "decode", None) is base.PreTrainedTokenizerBase.decode)


_LONGEST: dict[tuple[Any, ...], int] = {}
# A normalizer may shorten text before it is tokenized: NFC composes up to 3 code points into
# one (Hangul jamo, a letter with two marks). 4 keeps the early overflow check a true bound.
_NORMALIZED_SHRINK = 4


def _longest_token(tokenizer: Any) -> int:
    """The most characters one token's vocabulary string holds (added tokens too), an upper bound
    on the characters of text one token covers; 0 when the tokenizer does not list its vocabulary."""
    key = (id(tokenizer), getattr(tokenizer, "name_or_path", ""), len(tokenizer) if hasattr(tokenizer, "__len__") else 0)
    if key not in _LONGEST:
        try:
            pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
            _LONGEST[key] = max(len(p) for p in pieces if isinstance(p, str))
        except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary list: no early check
            _LONGEST[key] = 0
    return _LONGEST[key]


def render_ids(tokenizer: Any, messages: Sequence[Message | dict[str, Any]],
               add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
    """Token ids of a full template rendering (used for the opening and for checks)."""
    text = _render_text(tokenizer, _as_dicts(messages), add_generation_prompt, **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


# Text past this many characters is rendered and tokenized on a thread (the tokenizer releases the
# GIL): on an event loop that episodes or proxy sessions share, a long page or history held every
# other one for about a second a megabyte.
OFF_LOOP_CHARS = 20_000
T = TypeVar("T")


async def off_loop_if_long(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, which renders or tokenizes ``size`` characters: on a thread when that is
    over ``OFF_LOOP_CHARS``, else here."""
    if size > OFF_LOOP_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


class ChatContext:
    """The growing token sequence of one episode.

    ``ids`` are all tokens so far; ``messages`` the conversation they render
    (for the prefix check). ``max_tokens`` is the context budget: an append
    that crosses it raises ``ContextOverflowError`` and leaves the context
    unchanged.
    """

    def __init__(
        self,
        tokenizer: Any,
        messages: Sequence[Message | dict[str, Any]],
        max_tokens: int | None = None,
        check_prefix: bool | int = True,
        **template_kwargs: Any,
    ):
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.check_prefix = check_prefix
        self.template_kwargs = template_kwargs
        self.messages: list[dict[str, Any]] = _as_dicts(messages)
        self.ids: list[int] = []
        self.prefix_stable = True
        self.mismatches: list[int] = []
        self._last_action: list[int] = []
        self._prefill = ""  # the start of the reply the next action continues (append_prefill)
        self._observations = 0
        self._probe = self._template_probe()
        opening = _render_text(tokenizer, self.messages, True, **template_kwargs)
        self._check_fits(opening)
        self._append(tokenizer.encode(opening, add_special_tokens=False))

    def fork(self) -> ChatContext:
        """An independent copy, for a branch: token list and message list copied, tokenizer shared."""
        new = copy.copy(self)
        new.ids = list(self.ids)
        new.messages = list(self.messages)  # message dicts are never changed in place: shared
        new.mismatches = list(self.mismatches)
        new._last_action = list(self._last_action)
        return new

    # -- what the template puts around messages --------------------------------
    def _template_probe(self) -> _Probe:
        """What the template puts around messages; learnt once per tokenizer, template and kwargs."""
        key = (id(self.tokenizer), getattr(self.tokenizer, "name_or_path", ""),
               getattr(self.tokenizer, "chat_template", None), repr(sorted(
            self.template_kwargs.items())))
        if key not in _PROBES:
            _PROBES[key] = self._probe_uncached()
        return _PROBES[key]

    def _probe_uncached(self) -> _Probe:
        tok, kw = self.tokenizer, self.template_kwargs
        before = _render_text(tok, _BASE[:2], True, **kw)
        full = _render_text(tok, _BASE, False, **kw)
        if not full.startswith(before + "A"):
            raise ValueError("chat template does not render assistant content verbatim")
        terminator = full[len(before) + 1:]
        term_ids = tok.encode(terminator, add_special_tokens=False)
        unsampled: dict[int, str | None] = {}
        for k in range(1, len(term_ids) + 1):
            sampled = decode_ids(tok, term_ids[:k])
            unsampled[k] = terminator[len(sampled):] if terminator.startswith(sampled) else None
        return _Probe(terminator, full, term_ids, unsampled)

    @property
    def terminator(self) -> str:
        """Text the template closes an assistant message with (e.g. ``<|im_end|>\\n``)."""
        return self._probe.terminator

    def __len__(self) -> int:
        return len(self.ids)

    def _check_fits(self, text: str) -> None:
        """Raise ``ContextOverflowError`` before tokenizing ``text`` where it cannot fit the budget
        whatever its tokens: tokenizing megabytes (a whole web page) takes seconds, on the event
        loop that every episode shares. A token covers at most ``_longest_token`` characters;
        ``_NORMALIZED_SHRINK`` leaves room for normalizers that shorten text."""
        longest = _longest_token(self.tokenizer)
        if self.max_tokens is None or not longest:
            return
        room, least = self.max_tokens - len(self.ids), len(text) // (_NORMALIZED_SHRINK * longest)
        if least > room:
            raise ContextOverflowError(
                f"context would grow past the budget of {self.max_tokens}: {len(text):,} characters "
                f"are at least {least:,} tokens, and {room} are left")

    def _append(self, ids: list[int]) -> None:
        if self.max_tokens is not None and len(self.ids) + len(ids) > self.max_tokens:
            raise ContextOverflowError(
                f"context would grow to {len(self.ids) + len(ids)} tokens, "
                f"over the budget of {self.max_tokens}"
            )
        self.ids += ids

    # -- appends ---------------------------------------------------------------
    def append_action(self, ids: Sequence[int], logprobs: Sequence[float] | None = None,
                      text: str | None = None) -> None:
        """Append sampled action tokens exactly as sampled.

        ``logprobs``, when given, must have one entry per token: a check that
        the caller's tokens and logprobs line up (the node keeps them; the
        context does not). ``text`` is the assistant message recorded in
        ``messages`` (default: the ids decoded without special tokens). It is
        only used for consistency checks, never to produce tokens.
        """
        ids = list(ids)
        if logprobs is not None and len(logprobs) != len(ids):
            raise ValueError(f"{len(logprobs)} logprobs for {len(ids)} action tokens")
        self._append(ids)
        if text is None:
            text = decode_ids(self.tokenizer, ids, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": self._prefill + text})
        self._last_action, self._prefill = ids, ""

    def append_prefill(self, text: str) -> list[int]:
        """At a generation prompt, append the start of the assistant reply (a prefill) that the
        next action continues; returns its ids. They are context: the model is shown them, it
        did not sample them. The reply's message is then the prefill plus the action's text."""
        if self._prefill or (self.messages and self.messages[-1]["role"] == "assistant"):
            raise ValueError("append_prefill needs a generation prompt")
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self._append(ids)
        self._prefill = text
        return ids

    def _frame(self, role: str) -> tuple[str, str] | None:
        """The delta text before and after one ``role`` message's content, if the template is verbatim."""
        frames = self._probe.frames
        if role not in frames:
            probes = ["Q7xz", "k Z\n3{{"]
            deltas = [self._render_delta([{"role": role, "content": p}]) for p in probes]
            head, sep, tail = deltas[0].partition(probes[0])
            ok = sep and deltas[1] == head + probes[1] + tail and probes[0] not in head + tail
            frames[role] = (head, tail) if ok else None
        return frames[role]

    def _render_delta(self, new: list[dict[str, Any]]) -> str:
        full = _render_text(self.tokenizer, _BASE + new, True, **self.template_kwargs)
        base = self._probe.base
        if not full.startswith(base):
            raise ValueError("chat template re-renders the base conversation; cannot take a delta")
        return full[len(base):]

    def observation_ids(self, messages: Sequence[Message | dict[str, Any]]) -> list[int]:
        """Token ids that ``append_observation(messages)`` would append."""
        new = _as_dicts(messages)
        closing = ""
        if self.messages and self.messages[-1]["role"] == "assistant":
            closing = self._unsampled_terminator()
        frame = None
        if len(new) == 1 and set(new[0]) == {"role", "content"} and isinstance(new[0]["content"], str) \
                and new[0]["content"] == new[0]["content"].strip():
            frame = self._frame(new[0]["role"])
        delta = frame[0] + new[0]["content"] + frame[1] if frame else self._render_delta(new)
        self._check_fits(closing + delta)
        return self.tokenizer.encode(closing + delta, add_special_tokens=False)

    def _unsampled_terminator(self) -> str:
        """The terminator text minus the longest head of its tokens that ends the action."""
        probe, last = self._probe, self._last_action
        term = probe.terminator_ids
        for k in range(min(len(term), len(last)), 0, -1):
            if last[-k:] == term[:k]:
                rest = probe.unsampled[k]
                if rest is None:
                    raise ValueError(f"terminator tokens {term} do not decode to {probe.terminator!r}")
                return rest
        return probe.terminator

    def append_observation(self, messages: Sequence[Message | dict[str, Any]]) -> list[int]:
        """Append the rendering of the new messages plus the generation prompt.

        Returns the appended ids (a ``Node``'s ``context_ids``).
        """
        ids = self.observation_ids(messages)
        self._append(ids)
        self.messages += _as_dicts(messages)
        self._observations += 1
        every = self.check_prefix
        if every is True or (every and (self._observations <= 2 or self._observations % every == 0)):
            self._check_prefix()
        return ids

    def append_reply_as_context(self, messages: Sequence[Message | dict[str, Any]]) -> list[int]:
        """At a generation prompt, append an assistant reply that was not sampled here (a
        harness's own rendering of one) and the messages after it, plus the generation prompt.

        The reply's tokens are context, not an action: the template's rendering of
        ``messages`` after an assistant turn, less the assistant header that the
        generation prompt already put in the context. Returns the appended ids;
        raises ``ValueError`` when the template does not open that turn with its
        generation prompt (then there is no such cut).
        """
        new = _as_dicts(messages)
        if not new or new[0]["role"] != "assistant" or (self.messages and self.messages[-1]["role"] == "assistant"):
            raise ValueError("append_reply_as_context needs a generation prompt and an assistant message first")
        tok, kw = self.tokenizer, self.template_kwargs
        header = _render_text(tok, _BASE[:2], True, **kw)[len(_render_text(tok, _BASE[:2], False, **kw)):]
        delta = self._render_delta(new)
        if not header or not delta.startswith(header):
            raise ValueError("the template does not open an assistant turn with its generation prompt")
        ids = tok.encode(delta[len(header):], add_special_tokens=False)
        self._append(ids)
        self.messages += new
        self._last_action = []
        self._observations += 1
        return ids

    def _check_prefix(self) -> None:
        """Compare the context with a full re-render; record and warn on a mismatch."""
        full = _render_text(self.tokenizer, self.messages, True, **self.template_kwargs)
        seen = decode_ids(self.tokenizer, self.ids)
        if full != seen:
            turn = sum(1 for m in self.messages if m["role"] == "assistant")
            self.mismatches.append(turn)
            if self.prefix_stable:
                warnings.warn(
                    f"chat template is not prefix-stable: at turn {turn} a full re-render "
                    "differs from the tokens the policy saw; the context keeps what was seen",
                    TemplateMismatchWarning,
                    stacklevel=3,
                )
            self.prefix_stable = False
