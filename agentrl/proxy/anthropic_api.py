"""Anthropic Messages on the proxy: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

A thin adapter (``MessagesWire``): the request becomes the internal
conversation (``handlers.Conversation``), and the sampled reply is written as
a ``message`` object or its server-sent events. Sessions, rendering,
recording, sampling and tool-call parsing are the Chat Completions code.

Request, in the internal conversation:

- ``system`` (a string or text blocks; ``cache_control`` ignored) is the first
  system message; ``system`` messages inside ``messages`` (a beta Claude Code
  sends) stay where they are;
- consecutive messages of one role are one turn, as Anthropic joins them;
- a user message's ``text`` blocks are one user message; each ``tool_result``
  block is a tool message answering ``tool_use_id`` (its text content); an
  assistant message's ``text`` blocks are its content and its ``tool_use``
  blocks its tool calls, with their ids;
- ``tools`` (``name``, ``description``, ``input_schema``), ``tool_choice``
  (``auto``, ``any`` = required, ``tool``, ``none``;
  ``disable_parallel_tool_use`` returns at most one call), ``max_tokens``,
  ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``stream``.

Accepted and ignored, counted in the session tree's ``meta["ignored"]``:
``thinking`` (the policy has no thinking mode; ``thinking`` and
``redacted_thinking`` blocks in the history are dropped), structured outputs
(``output_config.format``, the beta ``output_format``: counted as
``structured_output``; the reply is sampled free, not constrained to the
schema; Claude Code asks for its session title this way, so a refusal failed
one of its calls), and tools with a
server ``type`` (web search and the like: the proxy cannot run them, so the
model is not offered them; a ``tool_choice`` of ``any`` over server tools alone
is counted as ``tool_choice:any``). Ignored without a count, since they do not change
what is sampled: ``metadata``, ``cache_control``, ``context_management``,
``output_config.effort``, ``service_tier``. Refused with a 400 naming the field:
image and document blocks, block types the proxy does not know, and a
``tool_choice`` that names a tool not offered.

A final assistant message is a prefill: the reply continues it
(``continue_final_message`` in the internal conversation). Its text is
appended, as tokens, after the generation prompt, and the reply's content is
the continuation only, as Anthropic's is. The next call's history holds the
prefill and the continuation as one assistant message, which is the recorded
path. Refused, as Anthropic refuses them: a prefill ending in whitespace, and
one with ``tool_use`` blocks. An empty one is dropped.

Auth arrives as ``x-api-key`` or ``Authorization: Bearer`` (``Proxy.resolve``);
``anthropic-version`` and ``anthropic-beta`` are accepted and not needed. Any
``model`` name is served by the session's policy and echoed back. Errors use
Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``.

Reply: ``content`` holds a ``text`` block (the text outside tool calls) and
one ``tool_use`` block per parsed call (``id`` ``toolu_…``). ``stop_reason``
is ``tool_use``, ``max_tokens``, ``stop_sequence`` (with ``stop_sequence``)
or ``end_turn``. ``usage.input_tokens`` counts the prompt tokens rendered for
this call, ``cache_read_input_tokens`` those reused from the session's record.
Streamed: ``message_start``, per block ``content_block_start``,
``content_block_delta`` (``text_delta`` or ``input_json_delta``),
``content_block_stop``, then ``message_delta`` (stop reason, usage) and
``message_stop``. A reply without tools streams live as it is sampled.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.responses import JSONResponse, Response

from agentrl.httputil import HTTPError

from . import replies
from .handlers import Conversation, Out, Wire, internal_request
from .streaming import ErrorShape

if TYPE_CHECKING:
    from .app import Proxy
    from .sessions import Session

__all__ = ["ANTHROPIC_ERRORS", "CountTokensRequest", "MessagesRequest", "MessagesWire", "anthropic_error"]

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}
_IGNORED_BLOCKS = ("thinking", "redacted_thinking")


def anthropic_error(err: HTTPError) -> Response:
    """An ``HTTPError`` in Anthropic's error shape."""
    body = {"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "api_error"),
                                       "message": err.message}}
    return JSONResponse(body, err.status, headers=err.headers)


def _error_event(err: HTTPError) -> bytes:
    return _event("error", {"type": "error", "error": {
        "type": _ERROR_TYPES.get(err.status, "api_error"), "message": err.message}})


ANTHROPIC_ERRORS = ErrorShape(anthropic_error, _error_event)


# -- the request -----------------------------------------------------------------------
class Block(BaseModel):
    """One content block; its ``type`` decides which fields count (checked in ``_blocks``)."""

    model_config = ConfigDict(extra="ignore")

    type: str = Field(description="text, tool_use, tool_result, thinking, redacted_thinking.")
    text: str | None = Field(None, description="type=text: the text.")
    id: str | None = Field(None, description="type=tool_use: the call's id.")
    name: str | None = Field(None, description="type=tool_use: the tool.")
    input: Any = Field(None, description="type=tool_use: the arguments (an object).")
    tool_use_id: str | None = Field(None, description="type=tool_result: the call it answers.")
    content: str | list[Block] | None = Field(None, description="type=tool_result: text or text blocks.")
    is_error: bool | None = Field(None, description="type=tool_result: accepted, not rendered.")


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant", "system"] = Field(description="Speaker.")
    content: str | list[Block] = Field(description="Text or content blocks.")


class ToolIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=128, description="Tool name.")
    description: str = Field("", description="What it does.")
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}},
                                         description="JSON schema of its input.")
    type: str | None = Field(None, description="None or 'custom': a client tool; else a server tool (ignored).")


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["auto", "any", "tool", "none"] = Field(description="How tools may be used.")
    name: str | None = Field(None, description="type=tool: the tool to call.")
    disable_parallel_tool_use: bool | None = Field(None, description="true: at most one call a reply.")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    effort: Any = Field(None, description="Ignored: the policy has one effort.")
    format: Any = Field(None, description="Structured outputs: ignored (counted); the reply is sampled free.")


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field("", description="Any name; served by the session's policy and echoed back.")
    messages: list[MessageIn] = Field(min_length=1, description="The conversation so far.")
    system: str | list[Block] | None = Field(None, description="System prompt: text or text blocks.")
    tools: list[ToolIn] | None = Field(None, description="Tools the model may call.")
    tool_choice: ToolChoice | None = Field(None, description="auto (default), any, tool or none.")
    thinking: dict[str, Any] | None = Field(None, description="Ignored (counted): the policy does not think.")


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1, description="Tokens to sample at most.")
    stop_sequences: list[str] | None = Field(None, description="Strings that end the reply.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus mass.")
    top_k: int | None = Field(None, ge=0, description="Top-k; 0 disables.")
    stream: bool = Field(False, description="Answer as server-sent events.")
    output_config: OutputConfig | None = Field(None, description="effort ignored; a format ignored (counted).")
    output_format: Any = Field(None, description="Beta structured outputs: ignored (counted).")

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if v and (len(v) > 16 or any(not s for s in v)):
            raise ValueError("at most 16 non-empty stop sequences")
        return v


def _text(blocks: str | list[Block] | None, where: str) -> str:
    """The text of a string or of text blocks; any other block is refused."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    parts = []
    for j, b in enumerate(blocks):
        if b.type != "text":
            raise HTTPError(400, f"{where}.{j}.type: only text blocks are supported here, not {b.type!r}",
                            param=f"{where}.{j}.type")
        parts.append(b.text or "")
    return "\n".join(parts)


def _user(blocks: list[Block], where: str) -> list[dict[str, Any]]:
    """A user message's blocks: runs of text blocks are user messages, each tool_result a tool message."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, b in enumerate(blocks):
        if b.type == "text":
            texts.append(b.text or "")
            continue
        if b.type != "tool_result":
            raise HTTPError(400, f"{where}.{j}.type: {b.type!r} blocks are not supported in user messages "
                            "(text and tool_result only: no images or documents)", param=f"{where}.{j}.type")
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
            texts = []
        out.append({"role": "tool", "tool_call_id": b.tool_use_id or "",
                    "content": _text(b.content, f"{where}.{j}.content")})
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(blocks: list[Block], where: str, ignored: list[str]) -> dict[str, Any]:
    """An assistant message's blocks: its text, and its tool_use blocks as tool calls with their ids."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        at = f"{where}.{j}"
        if b.type == "text":
            texts.append(b.text or "")
        elif b.type in _IGNORED_BLOCKS:
            ignored.append(f"{b.type}_block")
        elif b.type == "tool_use":
            if not b.name or not isinstance(b.input, dict | None):
                raise HTTPError(400, f"{at}: a tool_use block needs a name and an input object", param=at)
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input or {}}})
        else:
            raise HTTPError(400, f"{at}.type: {b.type!r} blocks are not supported in assistant messages "
                            "(text, tool_use and thinking only)", param=f"{at}.type")
    return {"role": "assistant", "content": "\n".join(texts) or None, "tool_calls": calls or None}


def _messages(body: CountTokensRequest, ignored: list[str]) -> list[dict[str, Any]]:
    """The internal conversation's messages (see the module docstring)."""
    out: list[dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": _text(body.system, "system")})
    for i, m in enumerate(body.messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str) or m.role == "system":
            out.append({"role": m.role, "content": _text(m.content, where)})
        elif m.role == "assistant":
            out.append(_assistant(m.content, where, ignored))
        else:
            out += _user(m.content, where)
    return _joined_turns(out)


def _joined_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user (or assistant) messages as one, as Anthropic joins consecutive turns of
    one role: their texts one after the other (joined as a message's text blocks are), an
    assistant's tool calls in order. Rendered apart, they were two turns of one speaker, which a
    chat template that wants the roles to alternate refuses."""
    out: list[dict[str, Any]] = []
    for m in messages:
        last = out[-1] if out else None
        if last is None or m["role"] not in ("user", "assistant") or last["role"] != m["role"]:
            out.append(m)
            continue
        text = "\n".join(t for t in (last.get("content"), m.get("content")) if t)
        calls = [*(last.get("tool_calls") or ()), *(m.get("tool_calls") or ())]
        out[-1] = {**last, "content": text or (None if calls else ""), **({"tool_calls": calls} if calls else {})}
    return out


def _prefill(messages: list[dict[str, Any]], last: int) -> bool:
    """Whether the final assistant message is a prefill the reply continues; an empty one is
    dropped (the reply starts the turn). Refused as Anthropic does: trailing whitespace, tool_use."""
    final = messages[-1]
    if final.get("tool_calls"):
        raise HTTPError(400, f"messages.{last}: a final assistant message (a prefill) cannot hold tool_use blocks",
                        param=f"messages.{last}")
    text = final.get("content") or ""
    if text != text.rstrip():
        raise HTTPError(400, f"messages.{last}: final assistant content cannot end with trailing whitespace",
                        param=f"messages.{last}")
    if not text:
        messages.pop()
        return False
    if len(messages) < 2:
        raise HTTPError(400, f"messages.{last}: a final assistant message (a prefill) needs a message or "
                        "a system prompt before it", param=f"messages.{last}")
    return True


def conversation(body: CountTokensRequest) -> Conversation:
    """An Anthropic request as the internal conversation."""
    ignored: list[str] = []
    if body.thinking and body.thinking.get("type") != "disabled":
        ignored.append("thinking")
    config = getattr(body, "output_config", None)
    if getattr(body, "output_format", None) is not None or (config is not None and config.format is not None):
        ignored.append("structured_output")
    messages = _messages(body, ignored)
    tools = []
    for t in body.tools or []:
        if t.type not in (None, "custom"):
            ignored.append(f"server_tool:{t.type}")
            continue
        tools.append({"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}})
    choice: Any = None
    parallel = None
    if body.tool_choice is not None:
        c = body.tool_choice
        if c.type == "tool" and not c.name:
            raise HTTPError(400, "tool_choice.name: type 'tool' needs the tool's name", param="tool_choice.name")
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(
            c.type, {"type": "function", "function": {"name": c.name}})
        parallel = False if c.disable_parallel_tool_use else None
        if choice == "required" and not tools:  # only server tools were offered: nothing to require
            ignored.append("tool_choice:any")
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "tools": tools or None,
                              # a named tool must be offered (checked with the chat's), even with no tools
                              "tool_choice": choice if tools or isinstance(choice, dict) else None,
                              "parallel_tool_calls": parallel}
    if body.messages[-1].role == "assistant":
        fields["continue_final_message"] = _prefill(messages, len(body.messages) - 1)
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences or None,
                      temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, stream=body.stream)
    return Conversation(internal_request(fields), ignored)


# -- the reply -------------------------------------------------------------------------
def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def _blocks(msg: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if msg.get("content") or not msg.get("tool_calls"):
        out.append({"type": "text", "text": msg.get("content") or ""})
    for c in msg.get("tool_calls") or []:
        out.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                    "input": json.loads(c["function"]["arguments"])})
    return out


def _stop(out: Out) -> tuple[str, str | None]:
    """The stop reason and, for ``stop_sequence``, the sequence that ended the reply."""
    ch = out.choices[0]
    if ch.finish_reason == "tool_calls":
        return "tool_use", None
    if ch.finish_reason == "length":
        return "max_tokens", None
    stops = out.conv.chat.stops()
    if ch.result.finish_reason == "stop_string" and stops:
        raw = out.tokenizer.decode(ch.result.token_ids, skip_special_tokens=True)
        hits = [(i, s) for s in stops if (i := raw.find(s)) >= 0]
        if hits:
            return "stop_sequence", min(hits)[1]
    return "end_turn", None


def _usage(out: Out, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": len(out.prompt_ids) - out.reused, "output_tokens": output_tokens,
            "cache_read_input_tokens": out.reused, "cache_creation_input_tokens": 0}


def _message(out: Out, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
             output_tokens: int) -> dict[str, Any]:
    return {"id": out.call_id, "type": "message", "role": "assistant", "model": out.model,
            "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": _usage(out, output_tokens)}


class MessagesWire(Wire):
    """Anthropic Messages (see the module docstring)."""

    api, schema, call_prefix, tool_prefix = "messages", MessagesRequest, "msg_", "toolu_"
    errors = ANTHROPIC_ERRORS

    def conversation(self, body: Any, proxy: Proxy, session: Session | None) -> Conversation:
        return conversation(body)

    def body(self, out: Out) -> dict[str, Any]:
        ch = out.choices[0]
        return _message(out, _blocks(ch.message or {}), _stop(out), len(ch.result.token_ids))

    def _start(self, out: Out) -> list[bytes]:
        return [_event("message_start", {"type": "message_start", "message": _message(out, [], (None, None), 0)}),
                _event("content_block_start", {"type": "content_block_start", "index": 0,
                                               "content_block": {"type": "text", "text": ""}})]

    def live_chunk(self, out: Out) -> Callable[[int, str, bool], list[bytes]]:
        def chunk(i: int, text: str, first: bool) -> list[bytes]:
            delta = _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                   "delta": {"type": "text_delta", "text": text}})
            return [*self._start(out), delta] if first else [delta]
        return chunk

    def events(self, out: Out, sent: list[str | None] | None) -> list[bytes]:
        ch = out.choices[0]
        done = sent[0] if sent is not None else None
        events = [] if done is not None else self._start(out)[:1]
        for index, block in enumerate(_blocks(ch.message or {})):
            if block["type"] == "text":
                if not (index == 0 and done is not None):
                    events.append(_event("content_block_start", {"type": "content_block_start", "index": index,
                                                                 "content_block": {"type": "text", "text": ""}}))
                skip = len(done) if index == 0 and done else 0
                events += [_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                          "delta": {"type": "text_delta", "text": p}})
                           for p in replies.text_pieces(out.tokenizer, ch.result.token_ids, block["text"], skip)]
            else:
                events.append(_event("content_block_start", {"type": "content_block_start", "index": index,
                                                             "content_block": {**block, "input": {}}}))
                events.append(_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}}))
            events.append(_event("content_block_stop", {"type": "content_block_stop", "index": index}))
        stop_reason, stop_sequence = _stop(out)
        events.append(_event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": _usage(out, len(ch.result.token_ids))}))
        return [*events, _event("message_stop", {"type": "message_stop"})]
