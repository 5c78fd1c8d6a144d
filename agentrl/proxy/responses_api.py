"""OpenAI Responses on the proxy: ``POST /v1/responses`` and ``/v1/responses/input_tokens``.

A thin adapter (``ResponsesWire``): the request becomes the internal
conversation (``handlers.Conversation``), and the sampled reply is written as
a ``response`` object or its server-sent events. Sessions, rendering,
recording, sampling and tool-call parsing are the Chat Completions code.

Request, in the internal conversation:

- ``instructions`` is the first system message (for this call only: as in
  OpenAI's API, it is not carried over by ``previous_response_id``);
- ``input`` is a string (one user message) or a list of items: ``message``
  items (``input_text`` and ``output_text`` parts; ``developer`` is
  ``system``), ``function_call`` and ``custom_tool_call`` items (joined to
  the assistant message before them, as its tool calls with their
  ``call_id``), ``function_call_output`` and ``custom_tool_call_output`` items
  (tool messages);
- ``previous_response_id``: the proxy keeps each stored response's
  conversation (``store``, default true; bounded by
  ``ProxyConfig.max_stored_responses``, oldest first) and puts it before
  ``input``. Only the session that made a response can name it;
- ``tools``: ``function`` tools as they are; freeform ``custom`` tools (Codex's
  ``apply_patch``) as a function of one string argument ``input``, answered as
  ``custom_tool_call`` items; ``namespace`` tools are flattened to their tools
  (a call of one carries its ``namespace``).
  ``tool_choice`` (``auto``, ``none``, ``required``, a named function or
  custom tool, ``allowed_tools``: its mode, and only its tools offered),
  ``parallel_tool_calls``
  (false: at most one call a reply), ``max_output_tokens``, ``temperature``,
  ``top_p``, ``stream``.

Accepted and ignored, counted in the session tree's ``meta["ignored"]``:
``reasoning`` items (the policy has none to continue) and hosted tools
(``web_search``, ``file_search``, ...: the proxy cannot run them, so the model
is not offered them; a ``tool_choice`` of ``required`` over hosted tools alone
is counted as ``tool_choice:required``). Ignored without a count, since they do not change what
is sampled: ``include``, ``prompt_cache_key``, ``metadata``, ``reasoning``
settings, ``truncation``, ``user``, ``client_metadata``. Refused with a 400
naming the field: image, file and audio parts, other item types, a
``text.format`` other than text, a ``tool_choice`` that names a tool not
offered, and ``conversation`` and ``prompt`` (stored state the proxy does
not keep, which would come before the input).

Reply: ``output`` holds a ``message`` item (``output_text``; the text outside
tool calls), then one ``function_call`` or ``custom_tool_call`` item per
parsed call. ``status`` is ``completed``, or ``incomplete`` with
``incomplete_details.reason = "max_output_tokens"``. Any ``model`` name is
served by the session's policy and echoed back. Streamed as the Responses
events, each with its ``sequence_number``: ``response.created``,
``response.in_progress``, per item ``response.output_item.added``, then
``response.content_part.added``, ``response.output_text.delta`` ... ``.done``
and ``response.content_part.done`` for a message,
``response.function_call_arguments.delta`` and ``.done`` (or
``response.custom_tool_call_input.delta`` and ``.done``) for a call,
``response.output_item.done``; then ``response.completed`` (or
``response.incomplete``) with ``usage``. A reply without tools streams live
as it is sampled.

``/v1/responses/input_tokens`` takes the same body (``input`` may be left out
where ``previous_response_id`` gives the conversation) and answers
``{"object": "response.input_tokens", "input_tokens": N}``: the tokens that
call's prompt renders to, outside any session's record; it samples and
records nothing.
"""

from __future__ import annotations

import itertools
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agentrl.httputil import HTTPError

from . import replies
from .handlers import Conversation, Out, Wire, internal_request
from .streaming import ErrorShape

if TYPE_CHECKING:
    from .app import Proxy
    from .sessions import Session

__all__ = ["RESPONSES_ERRORS", "ResponsesCountRequest", "ResponsesRequest", "ResponsesWire", "StoredResponse"]

_TEXT_PARTS = ("input_text", "output_text", "text")
_CUSTOM_INPUT = {"type": "object", "properties": {"input": {
    "type": "string", "description": "The tool's whole input, as free-form text."}}, "required": ["input"]}


def _error_event(err: HTTPError, seq: int = 0) -> bytes:
    """An ``error`` event; ``seq``: its sequence number, the next after the events a call sent."""
    return _event("error", {"type": "error", "code": err.code, "message": err.message, "param": err.param,
                            "sequence_number": seq})


RESPONSES_ERRORS = ErrorShape(lambda err: err.response(), _error_event)


# -- the request -----------------------------------------------------------------------
class Part(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str = Field(description="input_text or output_text (refusal is read as text).")
    text: str | None = Field(None, description="The text.")
    refusal: str | None = Field(None, description="type=refusal: the text.")


class Item(BaseModel):
    """One input item; its ``type`` decides which fields count (checked in ``_messages``)."""

    model_config = ConfigDict(extra="ignore")

    type: str | None = Field(None, description="message (default), function_call, function_call_output, "
                             "custom_tool_call, custom_tool_call_output, reasoning.")
    role: str | None = Field(None, description="message: user, assistant, system or developer.")
    content: str | list[Part] | None = Field(None, description="message: text or parts.")
    call_id: str | None = Field(None, description="Calls and their outputs: the call's id.")
    name: str | None = Field(None, description="Calls: the tool.")
    arguments: str | None = Field(None, description="function_call: JSON arguments.")
    input: str | None = Field(None, description="custom_tool_call: the free-form input.")
    output: str | list[Part] | None = Field(None, description="Outputs: the result.")


class ToolIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str = Field(description="function, custom or namespace; others are hosted tools (ignored).")
    name: str | None = Field(None, max_length=128, description="Tool name.")
    description: str | None = Field(None, description="What it does.")
    parameters: dict[str, Any] | None = Field(None, description="function: JSON schema of the arguments.")
    tools: list[ToolIn] | None = Field(None, description="namespace: its tools.")


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field("", description="Any name; served by the session's policy and echoed back.")
    input: str | list[Item] = Field(description="A user message, or the conversation's items.")
    instructions: str | None = Field(None, description="A system message for this call.")
    previous_response_id: str | None = Field(None, description="A stored response to continue.")
    store: bool = Field(True, description="Keep this response's conversation for previous_response_id.")
    tools: list[ToolIn] | None = Field(None, description="Tools the model may call.")
    tool_choice: str | dict[str, Any] | None = Field(None, description="auto, none, required or a named tool.")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call a reply.")
    max_output_tokens: int | None = Field(None, ge=1, description="Tokens to sample at most.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus mass.")
    stream: bool = Field(False, description="Answer as server-sent events.")
    text: dict[str, Any] | None = Field(None, description="Only {format: {type: text}}.")
    metadata: dict[str, Any] | None = Field(None, description="Echoed back.")
    conversation: str | dict[str, Any] | None = Field(
        None, description="Not supported: the proxy keeps no conversations (previous_response_id does).")
    prompt: dict[str, Any] | None = Field(None, description="Not supported: the proxy keeps no prompt templates.")

    @field_validator("conversation", "prompt")
    @classmethod
    def _kept_elsewhere(cls, v: Any) -> Any:
        # OpenAI puts what they name before the input: dropped, the model would answer without it
        if v:
            raise ValueError("not supported: the proxy keeps no stored conversations or prompts; send the "
                             "items in input (or continue with previous_response_id)")
        return v


class ResponsesCountRequest(ResponsesRequest):
    """``POST /v1/responses/input_tokens``: a create body whose input may be left out (with a
    ``previous_response_id``); its sampling fields are read and not used."""

    input: str | list[Item] | None = Field(None, description="A user message, or the conversation's items.")


def _text(content: str | list[Part] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, p in enumerate(content):
        if p.type in _TEXT_PARTS:
            parts.append(p.text or "")
        elif p.type == "refusal":
            parts.append(p.refusal or "")
        else:
            raise HTTPError(400, f"{where}.{j}.type: only text parts are supported, not {p.type!r}",
                            param=f"{where}.{j}.type")
    return "".join(parts)


def _messages(items: list[Item], ignored: list[str]) -> list[dict[str, Any]]:
    """The internal conversation's messages for ``input`` items (see the module docstring)."""
    out: list[dict[str, Any]] = []
    for i, it in enumerate(items):
        kind, where = it.type or "message", f"input.{i}"
        if kind == "message":
            if it.role not in ("user", "assistant", "system", "developer"):
                raise HTTPError(400, f"{where}.role: must be user, assistant, system or developer",
                                param=f"{where}.role")
            out.append({"role": "system" if it.role == "developer" else it.role,
                        "content": _text(it.content, f"{where}.content")})
        elif kind in ("function_call", "custom_tool_call"):
            if not it.name or it.call_id is None:
                raise HTTPError(400, f"{where}: a {kind} item needs a name and a call_id", param=where)
            args: Any = (it.arguments or "{}") if kind == "function_call" else {"input": it.input or ""}
            call = {"id": it.call_id, "type": "function", "function": {"name": it.name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # made here, so appended in place
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if it.call_id is None:
                raise HTTPError(400, f"{where}.call_id: a {kind} item needs the call_id it answers",
                                param=f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": it.call_id, "content": _text(it.output, f"{where}.output")})
        elif kind == "reasoning":
            ignored.append("reasoning_item")
        else:
            raise HTTPError(400, f"{where}.type: {kind!r} items are not supported", param=f"{where}.type")
    return out


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response kept for ``previous_response_id``: the messages it added (its input's, then its
    reply) after the stored response it continued. Chained, not copied: a chain of n calls holds
    each message once, where a copy of the whole conversation per response held n^2/2."""

    owner: str | None  # the session that made it; only it may name it
    parent: StoredResponse | None
    added: tuple[dict[str, Any], ...]

    def messages(self) -> list[dict[str, Any]]:
        """The whole conversation this response ends (fresh dicts: a caller may change them)."""
        parts, node = [], self
        while node is not None:
            parts.append(node.added)
            node = node.parent
        return [dict(m) for part in reversed(parts) for m in part]


@dataclass(slots=True)
class _State:
    """What one call keeps between its request and its reply."""

    previous: StoredResponse | None  # the stored response it continues
    added: list[dict[str, Any]]  # its input's messages (no instructions), stored with the reply
    custom: set[str] = field(default_factory=set)  # freeform tools' names
    namespace: dict[str, str] = field(default_factory=dict)  # a namespaced tool's name -> its namespace
    message_id: str = field(default_factory=lambda: f"msg_{secrets.token_hex(12)}")
    seq: itertools.count = field(default_factory=itertools.count)
    echo: dict[str, Any] = field(default_factory=dict)  # the request fields the response repeats


def _tools(tools: list[ToolIn], state: _State, ignored: list[str], where: str = "tools",
           namespace: str | None = None) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tools):
        if t.type in ("function", "custom"):
            if not t.name:
                raise HTTPError(400, f"{where}.{i}.name: a {t.type} tool needs a name", param=f"{where}.{i}.name")
            spec = {"name": t.name, "description": t.description or "",
                    "parameters": t.parameters or {"type": "object", "properties": {}}}
            if t.type == "custom":
                state.custom.add(t.name)
                spec["parameters"] = _CUSTOM_INPUT
            if namespace is not None:
                state.namespace[t.name] = namespace
            out.append({"type": "function", "function": spec})
        elif t.type == "namespace":
            out += _tools(t.tools or [], state, ignored, f"{where}.{i}.tools", t.name)
        else:
            ignored.append(f"hosted_tool:{t.type}")
    return out


def _tool_choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]]) -> tuple[Any, list[dict]]:
    """The internal tool choice, and the tools offered (``allowed_tools`` offers its subset)."""
    if choice is None or isinstance(choice, str):
        if choice not in (None, "auto", "none", "required"):
            raise HTTPError(400, "tool_choice: must be auto, none, required or a named tool", param="tool_choice")
        return choice, tools
    kind = choice.get("type")
    if kind in ("function", "custom") and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, tools
    allowed = choice.get("tools")
    if kind == "allowed_tools" and choice.get("mode") in ("auto", "required") and isinstance(allowed, list):
        names = {t.get("name") for t in allowed if isinstance(t, dict)}
        return choice["mode"], [t for t in tools if t["function"]["name"] in names]
    raise HTTPError(400, f"tool_choice: {kind!r} is not supported (auto, none, required, a function or custom "
                    "tool by name, allowed_tools with a mode and its tools)", param="tool_choice")


def _echo(body: ResponsesRequest) -> dict[str, Any]:
    """What the response repeats of the request, checked now that JSON can write it: a reply
    that could not be written would fail after its call was recorded."""
    echo = {"tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "metadata": body.metadata or {}, "tool_choice": body.tool_choice or "auto"}
    for key, value in echo.items():
        try:
            json.dumps(value, allow_nan=False)
        except (ValueError, RecursionError):
            raise HTTPError(400, f"{key}: cannot be written back as JSON (NaN, Infinity or nested too deeply)",
                            param=key) from None
    return echo


def conversation(body: ResponsesRequest, previous: StoredResponse | None) -> Conversation:
    """A Responses request as the internal conversation; ``previous`` is the stored response it continues."""
    fmt = (body.text or {}).get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") != "text":
        raise HTTPError(400, "text.format: only type 'text' is supported (no constrained decoding)",
                        param="text.format")
    ignored: list[str] = []
    items = [Item(role="user", content=body.input)] if isinstance(body.input, str) else body.input or []
    added = _messages(items, ignored)
    history = [*(previous.messages() if previous is not None else []), *added]
    if not history:
        raise HTTPError(400, "input: the conversation is empty", param="input")
    state = _State(previous, added, echo=_echo(body))
    choice, tools = _tool_choice(body.tool_choice, _tools(body.tools or [], state, ignored))
    if choice == "required" and not tools:  # only hosted tools were offered: nothing to require
        ignored.append("tool_choice:required")
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
    chat = internal_request({
        "model": body.model, "messages": messages, "tools": tools or None,
        "tool_choice": choice if tools or isinstance(choice, dict) else None,  # a named tool must be offered: checked
        "parallel_tool_calls": body.parallel_tool_calls, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream})
    return Conversation(chat, ignored, state)


# -- the reply -------------------------------------------------------------------------
def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def _items(out: Out) -> list[dict[str, Any]]:
    state: _State = out.conv.state
    msg = out.choices[0].message or {}
    items: list[dict[str, Any]] = []
    if msg.get("content") or not msg.get("tool_calls"):
        items.append({"type": "message", "id": state.message_id, "status": _status(out), "role": "assistant",
                      "content": [{"type": "output_text", "text": msg.get("content") or "", "annotations": [],
                                   "logprobs": []}]})
    for c in msg.get("tool_calls") or []:
        name, args = c["function"]["name"], c["function"]["arguments"]
        if name in state.custom:
            value = json.loads(args)
            text = value["input"] if isinstance(value.get("input"), str) and len(value) == 1 else args
            items.append({"type": "custom_tool_call", "id": f"ctc_{c['id'][5:]}", "call_id": c["id"],
                          "name": name, "input": text, "status": "completed"})
        else:
            item = {"type": "function_call", "id": f"fc_{c['id'][5:]}", "call_id": c["id"], "name": name,
                    "arguments": args, "status": "completed"}
            if name in state.namespace:
                item["namespace"] = state.namespace[name]
            items.append(item)
    return items


def _response(out: Out, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
    body: ResponsesRequest = out.body
    return {
        "id": out.call_id, "object": "response", "created_at": out.created, "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None, "model": out.model, "output": output, "usage": usage,
        "instructions": body.instructions, **out.conv.state.echo,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id, "store": body.store,
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "reasoning": None, "user": None}


def _usage(out: Out) -> dict[str, Any]:
    n = len(out.choices[0].result.token_ids)
    # cache_write_tokens: the openai client's types require it; the proxy writes no provider cache
    return {"input_tokens": len(out.prompt_ids),
            "input_tokens_details": {"cached_tokens": out.reused, "cache_write_tokens": 0},
            "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": len(out.prompt_ids) + n}


def _status(out: Out) -> str:
    return "incomplete" if out.choices[0].finish_reason == "length" else "completed"


class ResponsesWire(Wire):
    """OpenAI Responses (see the module docstring)."""

    api, schema, call_prefix = "responses", ResponsesRequest, "resp_"
    prompt_param, max_tokens_param = "input", "max_output_tokens"
    errors = RESPONSES_ERRORS

    def conversation(self, body: Any, proxy: Proxy, session: Session | None) -> Conversation:
        previous = None
        if body.previous_response_id is not None:
            previous = proxy.stored_response(body.previous_response_id, session)
        return conversation(body, previous)

    def recorded(self, out: Out, proxy: Proxy) -> None:
        if out.body.store:
            state: _State = out.conv.state
            owner = out.session.session_id if out.session is not None else None
            proxy.store_response(out.call_id, StoredResponse(
                owner, state.previous, (*state.added, out.choices[0].message or {})))

    def body(self, out: Out) -> dict[str, Any]:
        return _response(out, _status(out), _items(out), _usage(out))

    def errors_for(self, out: Out) -> ErrorShape:
        # numbered on from the call's events: after response.created and deltas, not 0 again
        return ErrorShape(RESPONSES_ERRORS.response, lambda err: _error_event(err, next(out.conv.state.seq)))

    def _ev(self, out: Out, event: str, **data: Any) -> bytes:
        return _event(event, {"type": event, "sequence_number": next(out.conv.state.seq), **data})

    def _head(self, out: Out) -> list[bytes]:
        started = _response(out, "in_progress", [], None)
        return [self._ev(out, "response.created", response=started),
                self._ev(out, "response.in_progress", response=started)]

    def _message_open(self, out: Out) -> list[bytes]:
        item_id = out.conv.state.message_id
        return [self._ev(out, "response.output_item.added", output_index=0, item={
                    "type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []}),
                self._ev(out, "response.content_part.added", item_id=item_id, output_index=0, content_index=0,
                         part={"type": "output_text", "text": "", "annotations": []})]

    def _delta(self, out: Out, text: str) -> bytes:
        return self._ev(out, "response.output_text.delta", item_id=out.conv.state.message_id, output_index=0,
                        content_index=0, delta=text, logprobs=[])

    def live_chunk(self, out: Out) -> Callable[[int, str, bool], list[bytes]]:
        def chunk(i: int, text: str, first: bool) -> list[bytes]:
            head = [*self._head(out), *self._message_open(out)] if first else []
            return [*head, self._delta(out, text)]
        return chunk

    def events(self, out: Out, sent: list[str | None] | None) -> list[bytes]:
        done = sent[0] if sent is not None else None
        events = [] if done is not None else self._head(out)
        items = _items(out)
        for index, item in enumerate(items):
            item_id = item["id"]
            if item["type"] == "message":
                text = item["content"][0]["text"]
                if done is None:
                    events += self._message_open(out)
                events += [self._delta(out, p) for p in replies.text_pieces(
                    out.tokenizer, out.choices[0].result.token_ids, text, len(done or ""))]
                events.append(self._ev(out, "response.output_text.done", item_id=item_id, output_index=index,
                                       content_index=0, text=text, logprobs=[]))
                events.append(self._ev(out, "response.content_part.done", item_id=item_id, output_index=index,
                                       content_index=0, part=item["content"][0]))
            else:
                custom = item["type"] == "custom_tool_call"
                key, kind = ("input", "custom_tool_call_input") if custom else ("arguments", "function_call_arguments")
                events.append(self._ev(out, "response.output_item.added", output_index=index,
                                       item={**item, key: "", "status": "in_progress"}))
                events.append(self._ev(out, f"response.{kind}.delta", item_id=item_id, output_index=index,
                                       delta=item[key]))
                events.append(self._ev(out, f"response.{kind}.done", item_id=item_id, output_index=index,
                                       name=item["name"], **{key: item[key]}))
            events.append(self._ev(out, "response.output_item.done", output_index=index, item=item))
        status = _status(out)
        final = _response(out, status, items, _usage(out))
        return [*events, self._ev(out, f"response.{status}", response=final)]

