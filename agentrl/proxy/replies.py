"""OpenAI response bodies and server-sent-event chunks, built from sampled results.

Pure functions of plain data: the server decides what was sampled and records
it; these only write it in the shapes the OpenAI clients parse.

Streams. A backend that reports tokens as it samples them (``hf``, ``vllm``:
``RequestControl.on_token``) is streamed live: ``TextStream`` turns each
choice's tokens into the text that may be sent so far, sent as
``chat_chunk``/``completion_chunk`` events. Once the choices are sampled and
recorded, ``chat_chunks``/``completion_chunks`` write the rest (``sent``: what
went out already), the finish reasons, logprobs and usage. A backend that
returns whole results only is streamed from the finished result (the chunks
are still token-sized).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from agentrl.policy.base import GenerateResult

from .conversation import cut_at_stop

log = logging.getLogger("agentrl.proxy")

__all__ = ["Choice", "TextStream", "chat_body", "chat_chunk", "chat_chunks", "completion_body", "completion_chunk",
           "completion_chunks", "sse", "token_logprobs_chat", "token_logprobs_completion", "token_strings"]


@dataclass(slots=True)
class Choice:
    """One sampled choice as the client will see it."""

    index: int
    result: GenerateResult
    prompt_ids: list[int]
    text: str  # completions: the text; chat: the content before tool parsing
    message: dict[str, Any] | None = None  # chat only
    finish_reason: str = "stop"


def _lp(x: float) -> float:
    """A JSON-safe logprob: OpenAI writes -9999.0 for an impossible token."""
    return x if x > -9999.0 else -9999.0


def finish_reason(res: GenerateResult, called_tools: bool = False) -> str:
    if called_tools:
        return "tool_calls"
    return "length" if res.finish_reason == "length" else "stop"


def token_strings(tokenizer: Any, ids: list[int], as_ids: bool = False) -> list[str]:
    if as_ids:
        return [f"token_id:{i}" for i in ids]
    return tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)


def _usage(choices: list[Choice], prompts: list[list[int]], reused: int) -> dict[str, Any]:
    p = sum(map(len, prompts))
    c = sum(len(ch.result.token_ids) for ch in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": reused}}


def token_logprobs_chat(tokenizer: Any, res: GenerateResult, top: int) -> dict[str, Any]:
    strs = token_strings(tokenizer, res.token_ids)
    content = []
    for k, (s, lp) in enumerate(zip(strs, res.logprobs, strict=True)):
        alts = []
        if top and res.top_logprobs:
            alt_ids = [t for t, _ in res.top_logprobs[k][:top]]
            alt_strs = token_strings(tokenizer, alt_ids)
            alts = [{"token": a, "logprob": _lp(v), "bytes": list(a.encode())}
                    for a, (_, v) in zip(alt_strs, res.top_logprobs[k][:top], strict=True)]
        content.append({"token": s, "logprob": _lp(lp), "bytes": list(s.encode()), "top_logprobs": alts})
    return {"content": content}


def token_logprobs_completion(tokenizer: Any, res: GenerateResult, top: int,
                              as_ids: bool) -> dict[str, Any]:
    strs = token_strings(tokenizer, res.token_ids, as_ids)
    offsets, pos = [], 0
    for s in strs:
        offsets.append(pos)
        pos += len(s)
    tops = None
    if top and res.top_logprobs:
        tops = []
        for alts in res.top_logprobs:
            names = token_strings(tokenizer, [t for t, _ in alts[:top]], as_ids)
            tops.append({n: _lp(v) for n, (_, v) in zip(names, alts[:top], strict=True)})
    return {"tokens": strs, "token_logprobs": [_lp(x) for x in res.logprobs], "top_logprobs": tops,
            "text_offset": offsets}


def chat_body(call_id: str, model: str, choices: list[Choice], prompt_ids: list[int], reused: int,
              opts: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """A ``chat.completion`` object."""
    out = []
    for ch in choices:
        item: dict[str, Any] = {"index": ch.index, "message": ch.message,
                                "finish_reason": ch.finish_reason, "logprobs": None}
        if opts.get("logprobs"):
            item["logprobs"] = token_logprobs_chat(tokenizer, ch.result, opts.get("top_logprobs") or 0)
        if opts.get("return_token_ids"):
            item["token_ids"] = list(ch.result.token_ids)
        out.append(item)
    body = {"id": call_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": _usage(choices, [prompt_ids], reused),
            "system_fingerprint": f"agentrl-v{min(c.result.version for c in choices)}"}
    if opts.get("return_token_ids"):
        body["prompt_token_ids"] = list(prompt_ids)
    return body


def completion_body(call_id: str, model: str, choices: list[Choice], prompts: list[list[int]],
                    reused: int, opts: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """A ``text_completion`` object."""
    out = []
    for ch in choices:
        item: dict[str, Any] = {"index": ch.index, "text": ch.text, "finish_reason": ch.finish_reason,
                                "logprobs": None}
        if opts.get("logprobs") is not None:
            item["logprobs"] = token_logprobs_completion(
                tokenizer, ch.result, opts["logprobs"], opts.get("return_tokens_as_token_ids", False))
        if opts.get("return_token_ids"):
            item["prompt_token_ids"] = list(ch.prompt_ids)
            item["token_ids"] = list(ch.result.token_ids)
        out.append(item)
    return {"id": call_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": _usage(choices, prompts, reused)}


def text_pieces(tokenizer: Any, ids: list[int], text: str, skip: int = 0) -> list[str]:
    """``text`` cut where tokens end (one piece a token), for streaming, without its first ``skip``
    characters (already sent).

    Falls back to one piece when per-token decoding does not rebuild the text
    (a character split across tokens).
    """
    pieces = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=True)
    if not "".join(pieces).startswith(text):
        return [text[skip:]] if text[skip:] else []
    out, pos = [], 0
    for p in pieces:
        take = p[:len(text) - pos]
        if pos + len(take) > skip and take:
            out.append(take[max(0, skip - pos):])
        pos += len(take)
    return out


class TextStream:
    """The text of one choice as its tokens arrive: what may be sent so far.

    What it releases is always a prefix of the finished choice's text
    (``action_text`` cut by ``cut_at_stop``), so the chunks a client joins
    spell that text. Held back: a character whose bytes have not all arrived
    (the decoder shows U+FFFD until then) and, while a stop string could still
    begin there, the last ``len(longest stop) - 1`` characters. Once a stop
    string appears, the text ends before it (or after it, with ``keep_stop``).

    Decoding is incremental, as in vLLM's detokenizer: each push decodes a
    window of the last few tokens and keeps the text they add, so a reply of n
    tokens costs O(n) decoding, not O(n^2).
    """

    def __init__(self, tokenizer: Any, stops: tuple[str, ...] = (), keep_stop: bool = False):
        self.tokenizer, self.stops, self.keep_stop = tokenizer, stops, keep_stop
        self.ids: list[int] = []
        self.text = ""  # every complete character decoded so far
        self.sent = ""  # what ``push`` released
        self._prefix = self._read = 0  # the window: ids[_prefix:] is decoded, ids[_prefix:_read] known
        self._hold = max(map(len, stops), default=1) - 1
        self._ended = False

    def push(self, ids: list[int]) -> str:
        """Add sampled token ids; returns the text that may be sent now ('' for none yet)."""
        if self._ended or not ids:
            return ""
        self.ids += ids
        decode = self.tokenizer.decode
        known = decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        window = decode(self.ids[self._prefix:], skip_special_tokens=True)
        if len(window) > len(known) and not window.endswith("\ufffd"):
            self.text += window[len(known):]
            self._prefix, self._read = self._read, len(self.ids)
        ends = [i + len(s) for s in self.stops if (i := self.text.find(s)) >= 0]
        if ends:  # as ``action_text`` then ``cut_at_stop`` cut the finished text
            visible, self._ended = cut_at_stop(self.text[:min(ends)], self.stops, self.keep_stop), True
        else:
            visible = self.text[:len(self.text) - self._hold]
        if len(visible) <= len(self.sent) or not visible.startswith(self.sent):
            return ""
        new, self.sent = visible[len(self.sent):], visible
        return new


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def chat_chunk(call_id: str, model: str, created: int, index: int, delta: dict[str, Any],
               finish: str | None = None, **extra: Any) -> bytes:
    """One ``chat.completion.chunk`` event."""
    choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None, **extra}
    return sse({"id": call_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice]})


def chat_chunks(call_id: str, model: str, choices: list[Choice], prompt_ids: list[int], reused: int,
                opts: dict[str, Any], tokenizer: Any, sent: list[str] | None = None,
                created: int | None = None) -> list[bytes]:
    """``chat.completion.chunk`` events for finished choices, ending with ``[DONE]``.

    ``sent``: the content each choice streamed live already (its role chunk too);
    only the rest is written.
    """
    created = int(time.time()) if created is None else created

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        return chat_chunk(call_id, model, created, index, delta, finish, **extra)

    events = []
    for ch in choices:
        msg = ch.message or {}
        done = sent[ch.index] if sent is not None else None
        if done is None:
            events.append(chunk(ch.index, {"role": "assistant", "content": ""}))
        content = msg.get("content") or ""
        if msg.get("tool_calls"):
            if content:
                events.append(chunk(ch.index, {"content": content}))
            calls = [{"index": k, **c} for k, c in enumerate(msg["tool_calls"])]
            events.append(chunk(ch.index, {"tool_calls": calls}))
        else:
            skip = _streamed(content, done)
            events += [chunk(ch.index, {"content": p})
                       for p in text_pieces(tokenizer, ch.result.token_ids, content, skip)]
        extra: dict[str, Any] = {}
        if opts.get("logprobs"):
            extra["logprobs"] = token_logprobs_chat(tokenizer, ch.result, opts.get("top_logprobs") or 0)
        if opts.get("return_token_ids"):
            extra["token_ids"] = list(ch.result.token_ids)
        events.append(chunk(ch.index, {}, ch.finish_reason, **extra))
    if (opts.get("stream_options") or {}).get("include_usage"):
        events.append(sse({"id": call_id, "object": "chat.completion.chunk", "created": created,
                           "model": model, "choices": [], "usage": _usage(choices, [prompt_ids], reused)}))
    return events + [sse("[DONE]")]


def _streamed(text: str, sent: str | None) -> int:
    """How much of ``text`` went out live; ``TextStream`` only sends a prefix of it."""
    if not sent:
        return 0
    if not text.startswith(sent):  # not with TextStream; the client has it, so only the rest is sent
        log.warning("streamed text %r is not a prefix of the reply %r", sent[:40], text[:40])
    return len(sent)


def completion_chunk(call_id: str, model: str, created: int, index: int, text: str,
                     finish: str | None = None, **extra: Any) -> bytes:
    """One ``text_completion`` event."""
    return sse({"id": call_id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": None, **extra}]})


def completion_chunks(call_id: str, model: str, choices: list[Choice], prompts: list[list[int]],
                      reused: int, opts: dict[str, Any], tokenizer: Any, sent: list[str] | None = None,
                      created: int | None = None) -> list[bytes]:
    """``text_completion`` events for finished choices, ending with ``[DONE]``; ``sent`` as in
    ``chat_chunks``."""
    created = int(time.time()) if created is None else created

    def chunk(index: int, text: str, finish: str | None = None, **extra: Any) -> bytes:
        return completion_chunk(call_id, model, created, index, text, finish, **extra)

    events = []
    for ch in choices:
        skip = _streamed(ch.text, sent[ch.index] if sent is not None else None)
        events += [chunk(ch.index, p) for p in text_pieces(tokenizer, ch.result.token_ids, ch.text, skip)]
        extra: dict[str, Any] = {}
        if opts.get("logprobs") is not None:
            extra["logprobs"] = token_logprobs_completion(
                tokenizer, ch.result, opts["logprobs"], opts.get("return_tokens_as_token_ids", False))
        if opts.get("return_token_ids"):
            extra["prompt_token_ids"], extra["token_ids"] = list(ch.prompt_ids), list(ch.result.token_ids)
        events.append(chunk(ch.index, "", ch.finish_reason, **extra))
    if (opts.get("stream_options") or {}).get("include_usage"):
        events.append(sse({"id": call_id, "object": "text_completion", "created": created,
                           "model": model, "choices": [], "usage": _usage(choices, prompts, reused)}))
    return events + [sse("[DONE]")]
