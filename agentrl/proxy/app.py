"""The OpenAI-compatible proxy server: any policy behind ``/v1``, sessions recorded as trees.

``create_app(policy, ProxyConfig)`` returns an ASGI app (Starlette; ``serve``
runs it on uvicorn, bound to 127.0.0.1 by default)::

    POST /v1/chat/completions        tools, n, temperature, top_p, max_tokens, stop, seed, stream
    POST /v1/completions             text or token-id prompts, logprobs, return_token_ids, ...
    GET  /v1/models
    POST /sessions                   {session_id?, meta?, seed?} -> {session_id, api_key, base_url}
    GET  /sessions                   every session (admin)
    GET  /sessions/{id}              its calls, branches, timing
    GET  /sessions/{id}/tree         the assembled RolloutTree (JSON)
    POST /sessions/{id}/reward       {reward, call_id?, choice?}
    POST /sessions/{id}/close        -> the tree; appended to ProxyConfig.out if set
    DELETE /sessions/{id}
    ... /sessions/{id}/v1/...        the /v1 routes, recorded in that session
    GET  /health

A call belongs to a session named by its URL prefix, by an ``X-Session-Id``
header, or by the per-session API key it sends as its bearer token.

Access: with ``ProxyConfig.token`` set, every route needs it or a session's
key (both compared in constant time); a session key opens only its own
session and never the admin routes. Without a token anyone on the bound
interface may call, but a session key still cannot name another session.

Errors use OpenAI's ``{"error": {message, type, param, code}}`` body: 400 for
invalid JSON or schema (``param`` names the field; see ``agentrl.httputil``
for JSON nested too deeply and lone surrogates) and for a prompt over the
context budget, 401/403 for credentials, 404 for an unknown session, 409 for
a closed one, 413 for a body over ``max_request_bytes``, 500 for a close
whose tree could not be written to ``out`` (the session stays open; close it
again), 503 with ``Retry-After`` when the backend fails or too many requests
are in flight, 504 for a generation over ``generate_timeout_s``. Every
response carries ``X-Policy-Version``.

Generation goes through ``await policy.agenerate(request)`` (one call a
choice, batched by the backend); a policy without it is called with
``generate([...])`` on a thread, one call at a time. Each request carries a
``RequestControl``. A client that leaves before its choices are sampled
cancels them: the backend drops them, even from a running batch (``hf``: at
the next decode step). Otherwise what was sampled is recorded before the bytes
that report it are sent, so a disconnect loses nothing.

Streaming (``stream: true``) is live where the backend reports tokens as it
samples them (``hf``, ``vllm``): chunks leave as tokens are decoded, never
more text than the finished reply holds (``replies.TextStream``), and the
rest (finish reason, logprobs, usage) follows once the call is recorded. A
client that leaves mid-stream cancels the generation; the call is then
logged as cancelled and records no node, as one that left before the first
token. A chat call with ``tools`` is parsed whole before it is streamed,
since its text may turn out to be a tool call.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentrl.chat import render_ids
from agentrl.errors import ContextOverflowError, PolicyError
from agentrl.httputil import (
    HTTPError,
    call_with_body_limit,
    declared_too_large,
    listen_socket,
    read_json,
)
from agentrl.policy.base import (
    GenerateRequest,
    GenerateResult,
    RequestControl,
    SamplingParams,
    action_text,
    request_seed,
)
from agentrl.types import write_trees

from . import replies
from .messages import canonical_key, cut_at_stop, prompt_spec, response_message
from .schemas import ChatRequest, CompletionRequest, ProxyConfig, RewardRequest, SessionRequest
from .sessions import Plan, Session

__all__ = ["HTTPError", "Proxy", "RunningServer", "create_app", "listen_socket", "serve",
           "serve_banner", "serve_in_thread"]

log = logging.getLogger("agentrl.proxy")


def _bearer(request: Request) -> str | None:
    value = request.headers.get("authorization", "")
    return value[7:].strip() if value[:7].lower() == "bearer " else None


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Proxy:
    """The state behind the app: the policy, the config, the sessions."""

    def __init__(self, policy: Any, config: ProxyConfig | None = None):
        self.policy = policy
        self.cfg = config or ProxyConfig()
        self.tokenizer = policy.tokenizer
        self.sessions: dict[str, Session] = {}
        self._keys: dict[str, str] = {}  # sha256(api key) -> session id
        self._lock: asyncio.Lock | None = None  # serializes policies without agenerate
        self.in_flight = 0

    # -- sessions, for in-process callers too ------------------------------------------
    def create_session(self, session_id: str | None = None, meta: dict[str, Any] | None = None,
                       seed: int | None = None) -> Session:
        sid = session_id or secrets.token_urlsafe(12)
        if sid in self.sessions:
            raise HTTPError(409, f"session {sid!r} exists", param="session_id")
        if len(self.sessions) >= self.cfg.max_sessions:
            closed = [s for s in self.sessions.values() if s.closed]
            if not closed:
                raise HTTPError(429, f"at most {self.cfg.max_sessions} open sessions; close some first")
            self.drop_session(min(closed, key=lambda s: s.created).session_id)
        session = Session(sid, meta=meta, check_prefix=self.cfg.check_prefix, seed=seed)
        self.sessions[sid] = session
        self._keys[_digest(session.api_key)] = sid
        return session

    def drop_session(self, sid: str) -> None:
        session = self.sessions.pop(sid, None)
        if session is not None:
            self._keys.pop(_digest(session.api_key), None)

    def close_session(self, sid: str) -> Any:
        """The session's tree; the first close appends it to ``cfg.out`` and then marks the session closed.

        Written before anything is marked: a write that fails (a full disk, a
        folder that is gone) leaves the session open and recording, and the
        next close writes it again. So nothing recorded is lost.
        """
        session = self.sessions[sid]
        if session.closed:
            return session.assemble()
        tree = session.assemble()
        if self.cfg.out:
            try:
                write_trees(self.cfg.out, [tree], append=True)
            except (OSError, ValueError) as e:  # ValueError: text UTF-8 cannot encode
                raise HTTPError(500, f"could not write session {sid!r} to {self.cfg.out}: {e}; it stays "
                                "open: fix the cause and close it again") from e
        return session.close()

    # -- access --------------------------------------------------------------------------
    def resolve(self, request: Request, admin: bool = False) -> Session | None:
        """Check the credentials and return the session the request names, if any."""
        bearer = _bearer(request)
        key_sid = None
        if bearer:
            sid = self._keys.get(_digest(bearer))
            if sid is not None and hmac.compare_digest(bearer.encode(), self.sessions[sid].api_key.encode()):
                key_sid = sid
        token = self.cfg.token
        is_admin = token is not None and bearer is not None and hmac.compare_digest(
            bearer.encode(), token.encode())
        if token is not None and not is_admin and key_sid is None:
            raise HTTPError(401, "missing or wrong bearer token")
        if admin and key_sid is not None and not is_admin:
            raise HTTPError(403, "a session key opens only its own session")
        sid = request.path_params.get("sid") or request.headers.get("x-session-id") or key_sid
        if sid is None or admin and "sid" not in request.path_params:
            return None
        if key_sid is not None and not is_admin and sid != key_sid:
            raise HTTPError(403, "this API key belongs to another session")
        session = self.sessions.get(sid)
        if session is None:
            if self.cfg.auto_create_sessions and (is_admin or token is None):
                return self.create_session(sid)
            raise HTTPError(404, f"no session {sid!r}")
        return session

    # -- generation ----------------------------------------------------------------------
    async def generate(self, reqs: list[GenerateRequest]) -> list[GenerateResult]:
        """Sample every request; backend failures become HTTP errors."""
        try:
            return await asyncio.wait_for(self._generate(reqs), self.cfg.generate_timeout_s)
        except ContextOverflowError as e:
            raise HTTPError(400, str(e), code="context_length_exceeded") from e
        except TimeoutError as e:
            raise HTTPError(504, f"generation took over {self.cfg.generate_timeout_s:.0f}s") from e
        except (PolicyError, OSError) as e:
            raise HTTPError(503, f"the policy backend failed: {e}",
                            headers={"Retry-After": str(self.cfg.retry_after_s)}) from e

    async def _generate(self, reqs: list[GenerateRequest]) -> list[GenerateResult]:
        agenerate = getattr(self.policy, "agenerate", None)
        if agenerate is None:
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:
                try:
                    return list(await asyncio.to_thread(self.policy.generate, reqs))
                except asyncio.CancelledError:  # the thread runs on: tell the backend to stop
                    for r in reqs:
                        if r.control is not None:
                            r.control.cancel()
                    raise
        tasks = [asyncio.ensure_future(agenerate(r)) for r in reqs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:  # one failed or we were cancelled: the rest are not wanted
                t.cancel()

    def max_new_tokens(self, prompt_len: int, asked: int | None, param: str) -> int:
        budget = self.cfg.max_context_tokens
        room = budget - prompt_len
        if room <= 0:
            raise HTTPError(400, f"the prompt is {prompt_len} tokens, over the context budget of {budget}",
                            param=param, code="context_length_exceeded")
        if asked is None:
            return min(self.cfg.default_max_tokens, room)
        if asked > room:
            raise HTTPError(400, f"the prompt ({prompt_len} tokens) plus max_tokens ({asked}) is over "
                            f"the context budget of {budget} tokens", param="max_tokens",
                            code="context_length_exceeded")
        return asked

    def requests(self, prompt: list[int], req: ChatRequest | CompletionRequest, max_new: int,
                 logprobs: int, session: Session | None = None, call_id: str = "") -> list[GenerateRequest]:
        if req.n > self.cfg.max_n:
            raise HTTPError(400, f"n: at most {self.cfg.max_n}", param="n")
        base = req.seed if session is None else session.call_seed(prompt, req.seed, call_id)
        out = []
        for i in range(req.n):
            seed = None if base is None else (base if i == 0 else request_seed(base, i))
            try:
                params = SamplingParams(
                    temperature=1.0 if req.temperature is None else req.temperature,
                    top_p=1.0 if req.top_p is None else req.top_p, top_k=max(0, req.top_k or 0),
                    max_new_tokens=max_new, stop=req.stops(),
                    stop_token_ids=tuple(req.stop_token_ids or ()), logprobs=logprobs, seed=seed)
            except PolicyError as e:
                raise HTTPError(400, str(e)) from None
            out.append(GenerateRequest(list(prompt), params, RequestControl()))
        return out


# -- the reply: generate (cancellable), stream, record, then send the rest -----------------
async def _disconnected(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# (results, the text each choice streamed live or None) -> (the body or the remaining events, version)
Finish = Callable[[list[GenerateResult], "list[str | None] | None"], tuple[Any, int]]


class _Live:
    """The tokens a backend samples for a streamed call, from its thread to the reply's events.

    ``hook(i)`` is choice i's ``RequestControl.on_token``: it appends on the
    backend's thread and wakes the loop once per batch of tokens. ``events()``,
    on the loop, turns what arrived into chunks through each choice's
    ``TextStream``; ``chunk(i, text, first)`` writes them in the endpoint's shape.
    """

    def __init__(self, n: int, tokenizer: Any, stops: tuple[str, ...], keep_stop: bool,
                 chunk: Callable[[int, str, bool], list[bytes]]):
        self.loop = asyncio.get_running_loop()
        self.ready = asyncio.Event()
        self.texts = [replies.TextStream(tokenizer, stops, keep_stop) for _ in range(n)]
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.read = [0] * n
        self.chunk = chunk
        self.begun = [False] * n  # choice i's first chunk went out
        self._wake_pending = False

    def hook(self, i: int) -> Callable[[int], None]:
        ids = self.ids[i]

        def on_token(token_id: int) -> None:
            ids.append(token_id)
            if not self._wake_pending:
                self._wake_pending = True
                with contextlib.suppress(RuntimeError):  # the loop is closed: the server stopped
                    self.loop.call_soon_threadsafe(self._wake)
        return on_token

    def _wake(self) -> None:
        self._wake_pending = False
        self.ready.set()

    def events(self) -> list[bytes]:
        out = []
        for i, text in enumerate(self.texts):
            end = len(self.ids[i])
            new = text.push(self.ids[i][self.read[i]:end])
            self.read[i] = end
            if new:
                out += self.chunk(i, new, not self.begun[i])
                self.begun[i] = True
        return out

    def sent(self) -> list[str | None]:
        """Per choice, the text already streamed; None where not even its first chunk went out."""
        return [t.sent if b else None for t, b in zip(self.texts, self.begun, strict=True)]


_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class _Reply(Response):
    """Samples when called and answers; cancels the sampling if the client leaves first.

    Streamed with ``live``: chunks go out as tokens are sampled, and a client
    that leaves mid-stream cancels the generation (nothing is recorded for the
    call, as when it leaves before the first token). Otherwise, and for what
    remains after a live stream, the choices are recorded before the bytes that
    report them are sent, so a disconnect then loses nothing. Each batch of
    events is one write, and no write follows a disconnect the loop has seen.
    """

    def __init__(self, proxy: Proxy, reqs: list[GenerateRequest], finish: Finish, stream: bool,
                 on_cancel: Callable[[], None], on_end: Callable[[], None] = lambda: None,
                 live: _Live | None = None):
        self.proxy, self.reqs, self.finish, self.stream, self.on_cancel = proxy, reqs, finish, stream, on_cancel
        self.on_end = on_end  # always, last: frees what a call that was not recorded held
        self.live = live
        self.background = None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await self._reply(scope, receive, send)
        finally:
            self.on_end()

    async def _reply(self, scope: dict, receive: Callable, send: Callable) -> None:
        gen = asyncio.ensure_future(self.proxy.generate(self.reqs))
        watch = asyncio.ensure_future(_disconnected(receive))
        started, left = False, False
        try:
            if self.live is not None:
                started = await self._stream_live(gen, watch, send)
            else:
                await asyncio.wait({gen, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not gen.done():
                gen.cancel()  # cancelled() turns true only once the loop runs it: test our own flag
                left = True
                self.on_cancel()
        if left:
            return
        try:
            sent = self.live.sent() if self.live is not None and started else None
            body, version = self.finish(gen.result(), sent)
        except Exception as e:  # an HTTPError, or a backend or reply bug: answered, never a dead server
            err = e if isinstance(e, HTTPError) else HTTPError(500, f"internal error: {type(e).__name__}: {e}")
            if not isinstance(e, HTTPError):
                log.exception("proxy generation failed")
            if not started:
                return await err.response()(scope, receive, send)
            event = replies.sse({"error": {"message": err.message, "code": err.code}}) + replies.sse("[DONE]")
            return await send({"type": "http.response.body", "body": event, "more_body": False})
        headers = {"x-policy-version": str(version)}
        if not self.stream:
            return await JSONResponse(body, headers=headers)(scope, receive, send)
        with contextlib.suppress(OSError):  # the client left: everything is recorded already
            if not started:
                await send({"type": "http.response.start", "status": 200, "headers": [
                    *_SSE_HEADERS, (b"x-policy-version", str(version).encode())]})
            await send({"type": "http.response.body", "body": b"".join(body), "more_body": False})

    async def _stream_live(self, gen: asyncio.Future, watch: asyncio.Future, send: Callable) -> bool:
        """Send chunks as tokens arrive, until the generation ends or the client leaves;
        whether the response started."""
        live, started = self.live, False
        assert live is not None
        while True:
            ready = asyncio.ensure_future(live.ready.wait())
            try:
                await asyncio.wait({gen, watch, ready}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                ready.cancel()
            if gen.done() or watch.done():
                return started
            live.ready.clear()
            events = live.events()
            if not events:
                continue
            try:
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": [
                        *_SSE_HEADERS, (b"x-policy-version", str(self.proxy.policy.version).encode())]})
                    started = True
                await send({"type": "http.response.body", "body": b"".join(events), "more_body": True})
            except OSError:  # the client left: the caller cancels the generation
                return started


# -- handlers -----------------------------------------------------------------------------
def _chat(proxy: Proxy) -> Callable[[Request], Awaitable[Response]]:
    async def chat(request: Request) -> Response:
        t0 = time.perf_counter()
        session = proxy.resolve(request)
        req: ChatRequest = await read_json(request, ChatRequest, proxy.cfg.max_request_bytes)
        if session is not None and session.closed:
            raise HTTPError(409, f"session {session.session_id!r} is closed")
        spec = prompt_spec(req, proxy.tokenizer, proxy.cfg.tool_call_style)
        plan = _render(lambda: session.plan_chat(spec, proxy.tokenizer) if session else Plan(
            "chat", render_ids(proxy.tokenizer, spec.template, True, **spec.template_kwargs), None, []))
        max_new = proxy.max_new_tokens(len(plan.prompt_ids), req.max_tokens, "messages")
        top = (req.top_logprobs or 0) if req.logprobs else 0
        call_id = f"chatcmpl-{secrets.token_hex(12)}"
        release = _release(session, call_id)
        try:
            reqs = proxy.requests(plan.prompt_ids, req, max_new, top, session, call_id)
        except BaseException:  # a bad request holds no streams
            release()
            raise
        t1 = time.perf_counter()
        stops, created = req.stops(), int(time.time())

        def finish(results: list[GenerateResult], sent: list[str | None] | None) -> tuple[Any, int]:
            choices = []
            for i, res in enumerate(results):
                text = cut_at_stop(action_text(proxy.tokenizer, res.token_ids, stops), stops,
                                   req.include_stop_str_in_output)
                msg, called = response_message(text, spec.parse_tools)
                choices.append(replies.Choice(i, res, plan.prompt_ids, text, msg,
                                              replies.finish_reason(res, called)))
            reused = len(plan.prompt_ids) - len(plan.context_ids) if session else 0
            if session is not None:
                timing = {"render_s": t1 - t0, "generate_s": time.perf_counter() - t1, "time": time.time()}
                try:
                    session.record(plan, call_id, results, [c.text for c in choices],
                                   [canonical_key(c.message) for c in choices], timing)  # type: ignore[arg-type]
                finally:  # once recording began, freeing the stream could sample a recorded one again
                    session.keep_streams(call_id)
            opts = req.model_dump(include={"logprobs", "top_logprobs", "return_token_ids", "stream_options"})
            args = (call_id, proxy.cfg.served_model_name, choices, plan.prompt_ids, reused, opts, proxy.tokenizer)
            body = replies.chat_chunks(*args, sent, created) if req.stream else replies.chat_body(*args)
            return body, min(r.version for r in results)

        live = None
        if req.stream and not spec.parse_tools:  # a reply that may hold tool calls is parsed whole first
            def chunk(i: int, text: str, first: bool) -> list[bytes]:
                delta = replies.chat_chunk(call_id, proxy.cfg.served_model_name, created, i, {"content": text})
                head = replies.chat_chunk(call_id, proxy.cfg.served_model_name, created, i,
                                          {"role": "assistant", "content": ""})
                return [head, delta] if first else [delta]

            live = _live(reqs, proxy.tokenizer, stops, req.include_stop_str_in_output, chunk)
        return _Reply(proxy, reqs, finish, req.stream, _cancelled(session, call_id), release, live)

    return chat


def _completions(proxy: Proxy) -> Callable[[Request], Awaitable[Response]]:
    async def completions(request: Request) -> Response:
        t0 = time.perf_counter()
        session = proxy.resolve(request)
        req: CompletionRequest = await read_json(request, CompletionRequest, proxy.cfg.max_request_bytes)
        if session is not None and session.closed:
            raise HTTPError(409, f"session {session.session_id!r} is closed")
        vocab = len(proxy.tokenizer)
        prompts = []
        for p in req.prompts():
            ids = proxy.tokenizer.encode(p) if isinstance(p, str) else p
            if any(not 0 <= t < vocab for t in ids):
                raise HTTPError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
            prompts.append(ids)
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
            if session is not None:
                timing = {"render_s": t1 - t0, "generate_s": time.perf_counter() - t1, "time": time.time()}
                try:
                    for k, plan in enumerate(plans):
                        part = choices[k * req.n:(k + 1) * req.n]
                        cid = call_id if len(plans) == 1 else f"{call_id}-{k}"
                        session.record(plan, cid, [c.result for c in part], [c.text for c in part], [], timing)
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

            live = _live(reqs, proxy.tokenizer, stops, req.include_stop_str_in_output, chunk)
        return _Reply(proxy, reqs, finish, req.stream, _cancelled(session, call_id), release, live)

    return completions


def _live(reqs: list[GenerateRequest], tokenizer: Any, stops: tuple[str, ...], keep_stop: bool,
          chunk: Callable[[int, str, bool], list[bytes]]) -> _Live:
    """A ``_Live`` whose hooks are the requests' ``on_token`` (choice i is request i)."""
    live = _Live(len(reqs), tokenizer, stops, keep_stop, chunk)
    for i, r in enumerate(reqs):
        assert r.control is not None  # ``Proxy.requests`` gives each one
        r.control.on_token = live.hook(i)
    return live


def _render(plan: Callable[[], Plan]) -> Plan:
    """Render a chat prompt; a template that refuses the messages is the client's 400."""
    from jinja2.exceptions import TemplateError

    try:
        return plan()
    except TemplateError as e:
        raise HTTPError(400, f"messages: the chat template cannot render them: {e}", param="messages") from e


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


def _models(proxy: Proxy) -> Callable[[Request], Awaitable[Response]]:
    async def models(request: Request) -> Response:
        proxy.resolve(request)
        return JSONResponse({"object": "list", "data": [{
            "id": proxy.cfg.served_model_name, "object": "model", "created": 0, "owned_by": "agentrl",
            "max_model_len": proxy.cfg.max_context_tokens}]})
    return models


def _session_routes(proxy: Proxy) -> list[Route]:
    limit = proxy.cfg.max_request_bytes

    async def create(request: Request) -> Response:
        proxy.resolve(request, admin=True)
        body: SessionRequest = await read_json(request, SessionRequest, limit, optional=True)
        s = proxy.create_session(body.session_id, body.meta, body.seed)
        base = str(request.base_url).rstrip("/")
        return JSONResponse({"session_id": s.session_id, "api_key": s.api_key,
                             "base_url": f"{base}/sessions/{s.session_id}/v1"})

    async def listing(request: Request) -> Response:
        proxy.resolve(request, admin=True)
        return JSONResponse({"sessions": [{"session_id": s.session_id, "closed": s.closed,
                                           "calls": len(s.calls)} for s in proxy.sessions.values()]})

    async def show(request: Request) -> Response:
        return JSONResponse(_own(proxy, request).summary())

    async def tree(request: Request) -> Response:
        return JSONResponse(_own(proxy, request).assemble().to_dict())

    async def reward(request: Request) -> Response:
        session = _own(proxy, request)
        body: RewardRequest = await read_json(request, RewardRequest, limit)
        try:
            nodes = session.set_reward(body.reward, body.call_id, body.choice, body.terminated)
        except (KeyError, IndexError) as e:
            msg = e.args[0]
            raise HTTPError(404 if "no call" in msg else 400, msg, param=msg.split(":")[0]) from None
        return JSONResponse({"ok": True, "nodes": nodes})

    async def close(request: Request) -> Response:
        session = _own(proxy, request)
        return JSONResponse(proxy.close_session(session.session_id).to_dict())

    async def delete(request: Request) -> Response:
        proxy.drop_session(_own(proxy, request).session_id)
        return JSONResponse({"ok": True})

    return [
        Route("/sessions", create, methods=["POST"]),
        Route("/sessions", listing, methods=["GET"]),
        Route("/sessions/{sid}", show, methods=["GET"]),
        Route("/sessions/{sid}", delete, methods=["DELETE"]),
        Route("/sessions/{sid}/tree", tree, methods=["GET"]),
        Route("/sessions/{sid}/reward", reward, methods=["POST"]),
        Route("/sessions/{sid}/close", close, methods=["POST"]),
    ]


def _own(proxy: Proxy, request: Request) -> Session:
    session = proxy.resolve(request)
    assert session is not None  # the route has {sid}
    return session


def _guarded(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except HTTPError as e:
            return e.response()
        except Exception as e:  # a bug here must not take the server down
            log.exception("proxy handler failed")
            return HTTPError(500, f"internal error: {type(e).__name__}: {e}").response()
    return run


class _Gate:
    """ASGI middleware: body size (413), requests in flight (503), X-Policy-Version."""

    def __init__(self, app: Any, proxy: Proxy):
        self.app, self.proxy = app, proxy

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cfg, proxy = self.proxy.cfg, self.proxy

        async def send_versioned(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                if not any(k.lower() == b"x-policy-version" for k, _ in headers):
                    headers.append((b"x-policy-version", str(proxy.policy.version).encode()))
                message = {**message, "headers": headers}
            await send(message)

        if declared_too_large(scope, cfg.max_request_bytes):
            return await HTTPError(413, f"request body over {cfg.max_request_bytes} bytes").response()(
                scope, receive, send_versioned)
        if proxy.in_flight >= cfg.max_concurrent:
            return await HTTPError(503, f"{cfg.max_concurrent} requests in flight; retry later",
                                   headers={"Retry-After": str(cfg.retry_after_s)}).response()(
                scope, receive, send_versioned)
        proxy.in_flight += 1
        try:
            if await call_with_body_limit(self.app, scope, receive, send_versioned, cfg.max_request_bytes):
                await HTTPError(413, f"request body over {cfg.max_request_bytes} bytes").response()(
                    scope, receive, send_versioned)
        finally:
            proxy.in_flight -= 1


def create_app(policy: Any, config: ProxyConfig | None = None) -> Any:
    """The proxy's ASGI app; ``app.proxy`` is its ``Proxy`` (sessions, config)."""
    proxy = Proxy(policy, config)
    api = [("/v1/chat/completions", _chat(proxy), "POST"), ("/v1/completions", _completions(proxy), "POST"),
           ("/v1/models", _models(proxy), "GET")]
    routes = [Route(p, _guarded(h), methods=[m]) for p, h, m in api]
    routes += [Route("/sessions/{sid}" + p, _guarded(h), methods=[m]) for p, h, m in api]
    routes += [Route(r.path, _guarded(r.endpoint), methods=list(r.methods or ())) for r in _session_routes(proxy)]

    async def health(_: Request) -> Response:
        return JSONResponse({"ok": True, "sessions": len(proxy.sessions), "version": policy.version})

    routes.append(Route("/health", health, methods=["GET"]))
    return _Gate(Starlette(routes=routes), proxy)


# -- running it -------------------------------------------------------------------------------
def serve(policy: Any, config: ProxyConfig | None = None, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the proxy in the foreground (``agentrl proxy serve``)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(create_app(policy, config), log_level="info", access_log=False))
    # The model, tokenizer and modules loaded so far live as long as the server: keep them out of
    # the collector's full passes, which otherwise stall every request in flight (~100 ms here).
    gc.collect()
    gc.freeze()
    print(serve_banner(host, port, config or ProxyConfig()), flush=True)
    server.run(sockets=[listen_socket(host, port)])


def serve_banner(host: str, port: int, config: ProxyConfig) -> str:
    """What ``agentrl proxy serve`` prints: the URL a harness's ``OPENAI_BASE_URL`` takes is a
    session's, ``/sessions/<id>/v1``; plain ``/v1`` samples without recording a tree."""
    base = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    opened = ("any new <id> opens a session (--auto-create-sessions)" if config.auto_create_sessions
              else f"open one first: POST {base}/sessions -> session_id, api_key, base_url")
    return (f"agentrl proxy on {base}\n"
            f"  a harness's OPENAI_BASE_URL: {base}/sessions/<id>/v1  ({opened})\n"
            f"  {base}/v1 also answers, but records no session tree")


class RunningServer:
    """A uvicorn server on a background thread (tests, benches, an in-process trainer)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.app = app
        self.sock = listen_socket(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True, name="agentrl-proxy")
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the proxy server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    return RunningServer(app, host, port)
