"""The sampling endpoints: one handler for every chat-shaped protocol, one for token prompts.

A chat-shaped call, whatever its wire protocol (``Wire``), goes the same way:

1. the wire reads its body into the internal conversation (``Conversation``:
   a ``ChatRequest``, the parts it ignored, and its own state);
2. ``prompt_spec`` renders it and the session plans where it hangs
   (``Session.plan_chat``): the same code for every protocol;
3. the policy samples (``streaming.Reply``), each choice's text is cut at the
   stop strings and parsed for tool calls (``response_message``);
4. the session records it (``Session.record``), then the wire writes the
   reply (``Wire.body`` or ``Wire.events``) from the same ``Out``.

Only steps 1 and 4's writing differ between Chat Completions (``ChatWire``,
here), Responses (``responses_api.ResponsesWire``) and Anthropic Messages
(``anthropic_api.MessagesWire``).

A reply reported as cut short (``length``, ``max_tokens``, ``incomplete``) is
one that reached the limit the harness asked for (its ``max_tokens``), even
where it holds whole tool calls (they are returned all the same). A
reply cut by a limit the proxy set (``ProxyConfig.default_max_tokens`` when the
harness asked none, the room the prompt leaves in ``max_context_tokens``, or
the trained policy's ``sampling.max_new_tokens`` in harness training) is
reported as ended, as a short reply is: the harness goes on (Claude Code and
Codex end their whole run on a cut reply), and the recorded node keeps
``finish_reason: "length"`` for training.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentrl.chat import off_loop_if_long, render_ids
from agentrl.httputil import HTTPError, read_json, validation_problem
from agentrl.policy.base import GenerateResult, action_text

from . import replies
from .conversation import PromptSpec, cut_at_stop, prompt_spec, response_message
from .schemas import ChatRequest, CompletionRequest
from .sessions import Plan, Session
from .streaming import OPENAI_ERRORS, ErrorShape, Reply, live_for

if TYPE_CHECKING:
    from .app import Proxy

__all__ = ["ChatWire", "Conversation", "Out", "Wire", "chat_endpoint", "completions_endpoint",
           "check_chars_fit", "count_tokens_endpoint", "internal_request", "models_endpoint", "render_plan"]

Handler = Callable[[Request], Awaitable[Response]]


@dataclass(slots=True)
class Conversation:
    """A chat-shaped request as the shared path sees it: the internal conversation
    (``chat``: messages, tool calls with their ids, tool results, tools, sampling),
    the request parts the proxy ignored, and what its wire keeps for the reply."""

    chat: ChatRequest
    ignored: list[str] = field(default_factory=list)
    state: Any = None


@dataclass(slots=True)
class Out:
    """One sampled call, for its wire to write: recorded already when it has a session."""

    call_id: str
    model: str
    created: int
    choices: list[replies.Choice]
    prompt_ids: list[int]
    reused: int
    conv: Conversation
    body: Any  # the wire's own request model
    tokenizer: Any
    session: Session | None = None


def internal_request(fields: dict[str, Any]) -> ChatRequest:
    """The internal conversation from a wire's translation; what it cannot hold is a 400.

    The translated messages are validated with the rest, in one pass of
    pydantic-core: that costs about 1 us a message, less than building them
    with ``model_construct`` (4.6 us), and a long session's call translates
    its whole history (bench/proxy_overhead.py, growing sessions).
    """
    from pydantic import ValidationError

    if not fields.get("messages"):
        raise HTTPError(400, "messages: the conversation is empty", param="messages")
    try:
        return ChatRequest.model_validate(fields)
    except ValidationError as e:
        where, reason = validation_problem(e)
        raise HTTPError(400, f"the request translates to no valid conversation: {where}: {reason}",
                        param=where or None) from None


class Wire:
    """One wire protocol of chat-shaped calls: how its body becomes a ``Conversation`` and
    how an ``Out`` is written back. Subclasses set the class attributes and the methods."""

    api: ClassVar[str]
    schema: ClassVar[type[BaseModel]]
    call_prefix: ClassVar[str]  # the call (response) id's prefix
    tool_prefix: ClassVar[str] = "call_"  # the tool-call ids' prefix
    prompt_param: ClassVar[str] = "messages"
    max_tokens_param: ClassVar[str] = "max_tokens"
    errors: ClassVar[ErrorShape] = OPENAI_ERRORS

    def conversation(self, body: Any, proxy: Proxy, session: Session | None) -> Conversation:
        raise NotImplementedError

    def body(self, out: Out) -> dict[str, Any]:
        raise NotImplementedError

    def events(self, out: Out, sent: list[str | None] | None) -> list[bytes]:
        raise NotImplementedError

    def live_chunk(self, out: Out) -> Callable[[int, str, bool], list[bytes]]:
        """Writes streamed text as it is sampled (``out`` has no choices yet)."""
        raise NotImplementedError

    def recorded(self, out: Out, proxy: Proxy) -> None:
        """After the call is recorded, before it is written (Responses keeps what ``store`` asks)."""

    def errors_for(self, out: Out) -> ErrorShape:
        """How this call writes an error (Responses numbers its error event after the events sent)."""
        return self.errors


class ChatWire(Wire):
    """OpenAI Chat Completions: the internal conversation as it is."""

    api, schema, call_prefix = "chat", ChatRequest, "chatcmpl-"

    def conversation(self, body: ChatRequest, proxy: Proxy, session: Session | None) -> Conversation:
        return Conversation(body)

    def _args(self, out: Out) -> tuple[Any, ...]:
        opts = out.body.model_dump(include={"logprobs", "top_logprobs", "return_token_ids", "stream_options"})
        return (out.call_id, out.model, out.choices, out.prompt_ids, out.reused, opts, out.tokenizer)

    def body(self, out: Out) -> dict[str, Any]:
        return replies.chat_body(*self._args(out))

    def events(self, out: Out, sent: list[str | None] | None) -> list[bytes]:
        return replies.chat_chunks(*self._args(out), sent, out.created)

    def live_chunk(self, out: Out) -> Callable[[int, str, bool], list[bytes]]:
        def chunk(i: int, text: str, first: bool) -> list[bytes]:
            delta = replies.chat_chunk(out.call_id, out.model, out.created, i, {"content": text})
            if not first:
                return [delta]
            return [replies.chat_chunk(out.call_id, out.model, out.created, i,
                                       {"role": "assistant", "content": ""}), delta]
        return chunk


def _spec(proxy: Proxy, req: ChatRequest) -> PromptSpec:
    try:
        return prompt_spec(req, proxy.tokenizer, proxy.cfg.tool_call_style)
    except RecursionError:  # a schema nested just under the parser's limit cannot be written out
        raise HTTPError(400, "tools: a tool's schema is nested too deeply to render", param="tools") from None


def _render_whole(proxy: Proxy, spec: PromptSpec) -> list[int]:
    """A prompt rendered whole, outside any session: the messages, then a prefill's tokens."""
    ids = render_ids(proxy.tokenizer, spec.template, True, **spec.template_kwargs)
    if spec.prefill:
        ids += proxy.tokenizer.encode(spec.prefill, add_special_tokens=False)
    return ids


_MOST_BYTES: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _most_bytes_a_token_holds(tokenizer: Any) -> int:
    """The most UTF-8 bytes one token of ``tokenizer`` decodes to, plus 4 for what decoding
    one token alone drops (a SentencePiece token's leading space); once per tokenizer."""
    try:
        return _MOST_BYTES[tokenizer]
    except (KeyError, TypeError):
        pass
    pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    most = max(len(p.encode("utf-8", "surrogatepass")) for p in pieces) + 4
    with contextlib.suppress(TypeError):
        _MOST_BYTES[tokenizer] = most
    return most


def text_size(req: ChatRequest) -> int:
    """Characters of the messages' text and of the tools' descriptions and schemas (JSON), all
    of which the prompt renders."""
    size = 0
    for m in req.messages:
        texts = [m.content] if isinstance(m.content, str) else [p.text for p in m.content or ()]
        size += sum(map(len, texts))
    for t in req.tools or ():
        size += len(t.function.name) + len(t.function.description)
        with contextlib.suppress(RecursionError):  # nested too deeply to write: refused when rendered
            size += len(json.dumps(t.function.parameters, ensure_ascii=False))
    return size


def check_text_fits(proxy: Proxy, req: ChatRequest, param: str) -> int:
    """Refuse a prompt whose messages' and tools' text alone cannot fit the context budget, without
    rendering it: every token holds at most ``_most_bytes_a_token_holds`` bytes, and a character
    is at least one byte, so the prompt has at least (text characters) / that many tokens.
    Characters, not bytes: counted on every call, they cost no copy of the history. Tokenizing a
    7 MB body held the event loop, and with it every session and stream, for 7-10 s before the
    budget's 400."""
    return check_chars_fit(proxy, text_size(req), param, "message and tool text")


def check_chars_fit(proxy: Proxy, size: int, param: str, what: str) -> int:
    """``check_text_fits`` for ``size`` characters of ``what``; returns ``size``."""
    budget = proxy.cfg.max_context_tokens
    if size <= budget:  # fewer characters than the budget's tokens: it may fit
        return size
    at_least = size // _most_bytes_a_token_holds(proxy.tokenizer)
    if at_least > budget:
        raise HTTPError(400, f"the prompt is at least {at_least} tokens ({size} characters of {what}), over "
                        f"the context budget of {budget}", param=param, code="context_length_exceeded")
    return size


def render_plan(proxy: Proxy, session: Session | None, spec: PromptSpec, param: str) -> Plan:
    """Where a chat call hangs and its prompt; a template that refuses the messages is a 400."""
    from jinja2.exceptions import TemplateError

    try:
        if session is not None:
            return session.plan_chat(spec, proxy.tokenizer)
        return Plan("chat", _render_whole(proxy, spec), None, [])
    except TemplateError as e:
        raise HTTPError(400, f"{param}: the chat template cannot render them: {e}", param=param) from e


def _spec_and_plan(proxy: Proxy, session: Session | None, req: ChatRequest, param: str) -> tuple[PromptSpec, Plan]:
    """The prompt's spec and plan; a long one is made on a thread (``off_loop_if_long``). That is
    safe beside the loop: a plan only reads its session, and a call is recorded nodes first, then
    its keys, so a plan sees a recorded call whole or not at all."""
    spec = _spec(proxy, req)
    return spec, render_plan(proxy, session, spec, param)


def _whole(message: dict[str, Any] | None, prefill: str | None) -> dict[str, Any]:
    """The reply as the harness's history will hold it: a prefill's continuation follows the prefill."""
    assert message is not None
    return {**message, "content": prefill + (message.get("content") or "")} if prefill else message


def _reported_finish(res: GenerateResult, called: bool, asked: int | None) -> str:
    """The finish reason a chat-shaped reply reports (see the module docstring): ``length`` where
    the harness's own ``max_tokens`` (``asked``) cut it, tool calls or not, as OpenAI's
    ``length`` and Anthropic's ``max_tokens`` say of any reply that reached the limit; a cut by a
    limit the proxy set below it is reported as the reply ended (``tool_calls`` or ``stop``)."""
    if res.finish_reason == "length" and asked is not None and len(res.token_ids) >= asked:
        return "length"
    return "tool_calls" if called else "stop"


def _check_named_tool(req: ChatRequest) -> None:
    """A tool choice that names a tool must name one the request offers."""
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return
    name = choice.function.get("name")
    if name not in {t.function.name for t in req.tools or []}:
        raise HTTPError(400, f"tool_choice: names the tool {name!r}, which is not among the request's tools",
                        param="tool_choice")


def _check_open(session: Session | None, sampled: bool = False) -> None:
    """A closed session records nothing more. ``sampled``: checked again once the call is
    sampled, since a close may have come while it generated; its tree was written then, and a
    call recorded after it would reach no reader, though its harness was told it succeeded."""
    if session is not None and session.closed:
        raise HTTPError(409, f"session {session.session_id!r} is closed" + (
            " (it closed while this call was generating: the call is not recorded)" if sampled else ""))


def chat_endpoint(proxy: Proxy, wire: Wire) -> Handler:
    """The handler of one chat-shaped protocol (see the module docstring)."""

    async def handle(request: Request) -> Response:
        t0 = time.perf_counter()
        session = proxy.resolve(request)
        body = await read_json(request, wire.schema, proxy.cfg.max_request_bytes)
        _check_open(session)
        conv = wire.conversation(body, proxy, session)
        req = conv.chat
        _check_named_tool(req)
        size = check_text_fits(proxy, req, wire.prompt_param)
        if session is not None and conv.ignored:
            session.note_ignored(conv.ignored)
        spec, plan = await off_loop_if_long(size, _spec_and_plan, proxy, session, req, wire.prompt_param)
        max_new = proxy.max_new_tokens(len(plan.prompt_ids), req.max_tokens, wire.prompt_param,
                                       wire.max_tokens_param)
        top = (req.top_logprobs or 0) if req.logprobs else 0
        call_id = f"{wire.call_prefix}{secrets.token_hex(12)}"
        release = _release(session, call_id)
        try:
            reqs = proxy.requests(plan.prompt_ids, req, max_new, top, session, call_id)
        except BaseException:  # a bad request holds no streams
            release()
            raise
        t1 = time.perf_counter()
        stops = req.stops()
        reused = len(plan.prompt_ids) - len(plan.context_ids) if session else 0
        model = proxy.cfg.served_model_name if wire.api == "chat" else (req.model or proxy.cfg.served_model_name)
        out = Out(call_id, model, int(time.time()), [], plan.prompt_ids, reused, conv, body,
                  proxy.tokenizer, session)

        asked = req.max_tokens  # the harness's own limit; None: it set none

        def finish(results: list[GenerateResult], sent: list[str | None] | None) -> tuple[Any, int]:
            for i, res in enumerate(results):
                text = cut_at_stop(action_text(proxy.tokenizer, res.token_ids, stops), stops,
                                   req.include_stop_str_in_output)
                msg, called = response_message(text, spec.parse_tools, wire.tool_prefix, spec.single_call,
                                               prefilled=bool(spec.prefill))
                out.choices.append(replies.Choice(i, res, plan.prompt_ids, text, msg,
                                                  _reported_finish(res, called, asked)))
            _check_open(session, sampled=True)
            if session is not None:
                timing = {"render_s": t1 - t0, "generate_s": time.perf_counter() - t1, "time": time.time()}
                try:
                    session.record(plan, call_id, results, [c.text for c in out.choices],
                                   [_whole(c.message, spec.prefill) for c in out.choices], timing,
                                   model=req.model, api=wire.api)
                finally:  # once recording began, freeing the stream could sample a recorded one again
                    session.keep_streams(call_id)
            wire.recorded(out, proxy)
            written = wire.events(out, sent) if req.stream else wire.body(out)
            return written, min(r.version for r in results)

        live = None
        if req.stream and not spec.parse_tools:  # a reply that may hold tool calls is parsed whole first
            live = live_for(reqs, proxy.tokenizer, stops, req.include_stop_str_in_output, wire.live_chunk(out))
        return Reply(proxy, reqs, finish, req.stream, _cancelled(session, call_id), release, live,
                     wire.errors_for(out))

    return handle


def count_tokens_endpoint(proxy: Proxy, wire: Wire, schema: type[BaseModel], kind: str | None = None) -> Handler:
    """``.../count_tokens`` (Messages) and ``/v1/responses/input_tokens``: the prompt's length,
    rendered whole, as ``{"input_tokens": N}`` (with ``"object": kind`` where given); records nothing.
    A prompt that cannot fit the context budget is refused before it is rendered, as a sampling
    call's is (``check_text_fits``): an 8 MB body held a thread for seconds per count."""

    async def count(request: Request) -> Response:
        session = proxy.resolve(request)
        body = await read_json(request, schema, proxy.cfg.max_request_bytes)
        req = wire.conversation(body, proxy, session).chat
        size = check_text_fits(proxy, req, wire.prompt_param)
        from jinja2.exceptions import TemplateError

        try:
            ids = await off_loop_if_long(size, lambda: _render_whole(proxy, _spec(proxy, req)))
        except TemplateError as e:
            raise HTTPError(400, f"{wire.prompt_param}: the chat template cannot render them: {e}",
                            param=wire.prompt_param) from e
        return JSONResponse({**({"object": kind} if kind else {}), "input_tokens": len(ids)})

    return count


def completions_endpoint(proxy: Proxy) -> Handler:
    """``/v1/completions``: text or token-id prompts, each hung at its deepest recorded prefix."""

    async def completions(request: Request) -> Response:
        t0 = time.perf_counter()
        session = proxy.resolve(request)
        req: CompletionRequest = await read_json(request, CompletionRequest, proxy.cfg.max_request_bytes)
        _check_open(session)
        vocab = len(proxy.tokenizer)
        # A text prompt too long for the budget is refused before it is tokenized, and a long one
        # is tokenized off the event loop, as a chat call's messages are (``check_text_fits``).
        texts = [check_chars_fit(proxy, len(p), "prompt", "prompt text") for p in req.prompts() if isinstance(p, str)]
        prompts = await off_loop_if_long(sum(texts), _token_prompts, proxy.tokenizer, req)
        for ids in prompts:
            if any(not 0 <= t < vocab for t in ids):
                raise HTTPError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
        plans = [session.plan_tokens(p) if session else Plan("completion", p, None, p) for p in prompts]
        call_id = f"cmpl-{secrets.token_hex(12)}"
        release = _release(session, call_id)
        reqs = []
        try:
            for plan in plans:
                max_new = proxy.max_new_tokens(len(plan.prompt_ids), req.max_tokens, "prompt")
                reqs += proxy.requests(plan.prompt_ids, req, max_new, req.logprobs or 0, session, call_id)
        except BaseException:  # a bad request holds no streams
            release()
            raise
        t1 = time.perf_counter()
        stops, created = req.stops(), int(time.time())

        def finish(results: list[GenerateResult], sent: list[str | None] | None) -> tuple[Any, int]:
            choices = []
            for i, res in enumerate(results):
                plan = plans[i // req.n]
                text = cut_at_stop(action_text(proxy.tokenizer, res.token_ids, stops), stops,
                                   req.include_stop_str_in_output)
                choices.append(replies.Choice(i, res, plan.prompt_ids, text, None, replies.finish_reason(res)))
            _check_open(session, sampled=True)
            if session is not None:
                timing = {"render_s": t1 - t0, "generate_s": time.perf_counter() - t1, "time": time.time()}
                try:
                    for k, plan in enumerate(plans):
                        part = choices[k * req.n:(k + 1) * req.n]
                        cid = call_id if len(plans) == 1 else f"{call_id}-{k}"
                        session.record(plan, cid, [c.result for c in part], [c.text for c in part], [], timing,
                                       model=req.model, api="completions")
                finally:  # once recording began, freeing the streams could sample a recorded one again
                    session.keep_streams(call_id)
            reused = sum(len(p.prompt_ids) - len(p.context_ids) for p in plans) if session else 0
            opts = req.model_dump(include={"logprobs", "return_tokens_as_token_ids", "return_token_ids",
                                           "stream_options"})
            args = (call_id, proxy.cfg.served_model_name, choices, prompts, reused, opts, proxy.tokenizer)
            body = replies.completion_chunks(*args, sent, created) if req.stream else replies.completion_body(*args)
            return body, min(r.version for r in results)

        live = None
        if req.stream:
            def chunk(i: int, text: str, first: bool) -> list[bytes]:
                return [replies.completion_chunk(call_id, proxy.cfg.served_model_name, created, i, text)]

            live = live_for(reqs, proxy.tokenizer, stops, req.include_stop_str_in_output, chunk)
        return Reply(proxy, reqs, finish, req.stream, _cancelled(session, call_id), release, live)

    return completions


def _token_prompts(tokenizer: Any, req: CompletionRequest) -> list[list[int]]:
    """Each prompt of a completions request as token ids (text ones tokenized)."""
    return [tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts()]


def models_endpoint(proxy: Proxy) -> Handler:
    async def models(request: Request) -> Response:
        proxy.resolve(request)
        return JSONResponse({"object": "list", "data": [{
            "id": proxy.cfg.served_model_name, "object": "model", "created": 0, "owned_by": "agentrl",
            "max_model_len": proxy.cfg.max_context_tokens}]})
    return models


def _release(session: Session | None, call_id: str) -> Callable[[], None]:
    """Frees a seeded session's streams held for a call that ends unrecorded (see ``Session.call_seed``)."""
    def release() -> None:
        if session is not None:
            session.release_streams(call_id)
    return release


def _cancelled(session: Session | None, call_id: str) -> Callable[[], None]:
    def note() -> None:
        if session is not None:
            session.record_cancelled(call_id, "client disconnected before the generation finished")
    return note
