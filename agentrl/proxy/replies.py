"""OpenAI response bodies and server-sent-event chunks, built from sampled results.

Pure functions of plain data: the server decides what was sampled and records
it; these only write it in the shapes the OpenAI clients parse. Streams are
cut from a finished result: the backends return whole results, so a stream
starts once its choices are sampled (the chunks are still token-sized).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from agentrl.policy.base import GenerateResult

__all__ = ["Choice", "chat_body", "chat_chunks", "completion_body", "completion_chunks",
           "sse", "token_logprobs_chat", "token_logprobs_completion", "token_strings"]


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


def text_pieces(tokenizer: Any, ids: list[int], text: str) -> list[str]:
    """``text`` cut where tokens end (one piece a token), for streaming.

    Falls back to one piece when per-token decoding does not rebuild the text
    (a character split across tokens).
    """
    pieces = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=True)
    if not "".join(pieces).startswith(text):
        return [text] if text else []
    out, pos = [], 0
    for p in pieces:
        take = p[:len(text) - pos]
        if take:
            out.append(take)
            pos += len(take)
    return out


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def chat_chunks(call_id: str, model: str, choices: list[Choice], prompt_ids: list[int], reused: int,
                opts: dict[str, Any], tokenizer: Any) -> list[bytes]:
    """``chat.completion.chunk`` events for finished choices, ending with ``[DONE]``."""
    created = int(time.time())

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None, **extra}
        return sse({"id": call_id, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": [choice]})

    events = []
    for ch in choices:
        msg = ch.message or {}
        events.append(chunk(ch.index, {"role": "assistant", "content": ""}))
        content = msg.get("content") or ""
        if msg.get("tool_calls"):
            if content:
                events.append(chunk(ch.index, {"content": content}))
            calls = [{"index": k, **c} for k, c in enumerate(msg["tool_calls"])]
            events.append(chunk(ch.index, {"tool_calls": calls}))
        else:
            events += [chunk(ch.index, {"content": p}) for p in text_pieces(tokenizer, ch.result.token_ids, content)]
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


def completion_chunks(call_id: str, model: str, choices: list[Choice], prompts: list[list[int]],
                      reused: int, opts: dict[str, Any], tokenizer: Any) -> list[bytes]:
    """``text_completion`` events for finished choices, ending with ``[DONE]``."""
    created = int(time.time())

    def chunk(index: int, text: str, finish: str | None = None, **extra: Any) -> bytes:
        return sse({"id": call_id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": index, "text": text, "finish_reason": finish,
                                 "logprobs": None, **extra}]})

    events = []
    for ch in choices:
        events += [chunk(ch.index, p) for p in text_pieces(tokenizer, ch.result.token_ids, ch.text)]
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
