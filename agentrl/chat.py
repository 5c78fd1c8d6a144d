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

Templates that are not prefix-stable (say, ones that drop an earlier
``<think>`` block when later messages are rendered) make the appended context
differ from a full re-render. ``ChatContext`` keeps what the policy saw, and
reports the mismatch: ``prefix_stable`` turns False, ``mismatches`` records the
turn, and a ``TemplateMismatchWarning`` is issued once per context. The full
re-render costs time that grows with the episode, so ``check_prefix=N`` checks
the first two observations and then every N-th.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

from .errors import ContextOverflowError
from .types import Message

__all__ = ["ChatContext", "TemplateMismatchWarning", "render_ids"]

# (tokenizer id, template, kwargs) -> ((terminator, base rendering), per-role frames)
_PROBES: dict[tuple[Any, ...], tuple[tuple[str, str], dict[str, tuple[str, str] | None]]] = {}

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


def render_ids(tokenizer: Any, messages: Sequence[Message | dict[str, Any]],
               add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
    """Token ids of a full template rendering (used for the opening and for checks)."""
    text = _render_text(tokenizer, _as_dicts(messages), add_generation_prompt, **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


class ChatContext:
    """The growing token sequence of one episode, with a loss mask and logprobs.

    ``ids`` are all tokens so far; ``mask`` is 1 on sampled action tokens;
    ``logprobs`` holds behaviour logprobs on action tokens (0.0 elsewhere).
    ``max_tokens`` is the context budget: an append that crosses it raises
    ``ContextOverflowError`` and leaves the context unchanged.
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
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.prefix_stable = True
        self.mismatches: list[int] = []
        self._last_action: list[int] = []
        self._observations = 0
        self._frames: dict[str, tuple[str, str] | None] = {}  # shared per template (see _PROBES)
        self._terminator, self._delta_base = self._template_probe()
        self._terminator_ids: list[int] = tokenizer.encode(self._terminator, add_special_tokens=False)
        self._append(render_ids(tokenizer, self.messages, True, **template_kwargs))

    def fork(self) -> ChatContext:
        """An independent copy, for a branch: token lists and messages copied, tokenizer shared."""
        new = copy.copy(self)
        new.ids, new.mask, new.logprobs = list(self.ids), list(self.mask), list(self.logprobs)
        new.messages = [dict(m) for m in self.messages]
        new.mismatches = list(self.mismatches)
        new._last_action = list(self._last_action)
        return new

    # -- what the template puts around messages --------------------------------
    def _template_probe(self) -> tuple[str, str]:
        """The terminator and the base rendering; rendered once per tokenizer, template and kwargs."""
        key = (id(self.tokenizer), getattr(self.tokenizer, "name_or_path", ""),
               getattr(self.tokenizer, "chat_template", None), repr(sorted(
            self.template_kwargs.items())))
        if key not in _PROBES:
            _PROBES[key] = (self._probe_uncached(), {})
        probe, self._frames = _PROBES[key]
        return probe

    def _probe_uncached(self) -> tuple[str, str]:
        tok, kw = self.tokenizer, self.template_kwargs
        before = _render_text(tok, _BASE[:2], True, **kw)
        full = _render_text(tok, _BASE, False, **kw)
        if not full.startswith(before + "A"):
            raise ValueError("chat template does not render assistant content verbatim")
        return full[len(before) + 1:], full

    @property
    def terminator(self) -> str:
        """Text the template closes an assistant message with (e.g. ``<|im_end|>\\n``)."""
        return self._terminator

    def __len__(self) -> int:
        return len(self.ids)

    def _append(self, ids: list[int], mask: int = 0, logprobs: Sequence[float] | None = None) -> None:
        if self.max_tokens is not None and len(self.ids) + len(ids) > self.max_tokens:
            raise ContextOverflowError(
                f"context would grow to {len(self.ids) + len(ids)} tokens, "
                f"over the budget of {self.max_tokens}"
            )
        self.ids += ids
        self.mask += [mask] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)

    # -- appends ---------------------------------------------------------------
    def append_action(self, ids: Sequence[int], logprobs: Sequence[float] | None = None,
                      text: str | None = None) -> None:
        """Append sampled action tokens exactly as sampled.

        ``text`` is the assistant message recorded in ``messages`` (default: the
        ids decoded without special tokens). It is only used for consistency
        checks, never to produce tokens.
        """
        ids = list(ids)
        if logprobs is not None and len(logprobs) != len(ids):
            raise ValueError(f"{len(logprobs)} logprobs for {len(ids)} action tokens")
        self._append(ids, 1, logprobs if logprobs is not None else [0.0] * len(ids))
        if text is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": text})
        self._last_action = ids

    def _frame(self, role: str) -> tuple[str, str] | None:
        """The delta text before and after one ``role`` message's content, if the template is verbatim."""
        if role not in self._frames:
            probes = ["Q7xz", "k Z\n3{{"]
            deltas = [self._render_delta([{"role": role, "content": p}]) for p in probes]
            head, sep, tail = deltas[0].partition(probes[0])
            ok = sep and deltas[1] == head + probes[1] + tail and probes[0] not in head + tail
            self._frames[role] = (head, tail) if ok else None
        return self._frames[role]

    def _render_delta(self, new: list[dict[str, Any]]) -> str:
        full = _render_text(self.tokenizer, _BASE + new, True, **self.template_kwargs)
        if not full.startswith(self._delta_base):
            raise ValueError("chat template re-renders the base conversation; cannot take a delta")
        return full[len(self._delta_base):]

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
        return self.tokenizer.encode(closing + delta, add_special_tokens=False)

    def _unsampled_terminator(self) -> str:
        """The terminator text minus the longest head of its tokens that ends the action."""
        term, last = self._terminator_ids, self._last_action
        for k in range(min(len(term), len(last)), 0, -1):
            if last[-k:] == term[:k]:
                sampled = self.tokenizer.decode(term[:k], skip_special_tokens=False)
                if not self._terminator.startswith(sampled):
                    raise ValueError(f"terminator tokens {term} do not decode to {self._terminator!r}")
                return self._terminator[len(sampled):]
        return self._terminator

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

    def _check_prefix(self) -> None:
        """Compare the context with a full re-render; record and warn on a mismatch."""
        full = _render_text(self.tokenizer, self.messages, True, **self.template_kwargs)
        seen = self.tokenizer.decode(self.ids, skip_special_tokens=False)
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
