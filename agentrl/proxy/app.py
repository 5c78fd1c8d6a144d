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
invalid JSON or schema (``param`` names the field) and for a prompt over the
context budget, 401/403 for credentials, 404 for an unknown session, 409 for
a closed one, 413 for a body over ``max_request_bytes``, 503 with
``Retry-After`` when the backend fails or too many requests are in flight,
504 for a generation over ``generate_timeout_s``. Every response carries
``X-Policy-Version``.

Generation goes through ``await policy.agenerate(request)`` (one call a
choice, batched by the backend); a policy without it is called with
``generate([...])`` on a thread, one call at a time. A client that leaves
before its choices are sampled cancels them; what was sampled is recorded
before the first byte of the reply is sent, so a disconnect loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentrl.chat import render_ids
from agentrl.errors import ContextOverflowError, PolicyError
from agentrl.policy.base import (
    GenerateRequest,
    GenerateResult,
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
           "serve_in_thread"]

log = logging.getLogger("agentrl.proxy")


class HTTPError(Exception):
    """An error answered to the client in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
                503: "service_unavailable", 504: "timeout"}.get(self.status, "server_error")
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, self.status, headers=self.headers)


class _TooLarge(Exception):
    pass


async def _parse(request: Request, model: type[BaseModel], limit: int, optional: bool = False) -> Any:
    """The body validated as ``model``; errors become a 400 that names the field."""
    try:
        raw = await request.body()
    except _TooLarge:
        raise HTTPError(413, f"request body over {limit} bytes") from None
    if optional and not raw.strip():
        raw = b"{}"
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise HTTPError(400, f"invalid JSON body: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        reason = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        raise HTTPError(400, f"{field or 'body'}: {reason}", param=field or None) from None


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
        session = self.sessions[sid]
        first = not session.closed
        tree = session.close()
        if first and self.cfg.out:
            write_trees(self.cfg.out, [tree], append=True)
        return tree

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
                return list(await asyncio.to_thread(self.policy.generate, reqs))
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
            out.append(GenerateRequest(list(prompt), params))
        return out


# -- the reply: generate (cancellable), record, then send ---------------------------------
async def _disconnected(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _Reply(Response):
    """Samples when called; cancels the sampling if the client leaves first."""

    def __init__(self, proxy: Proxy, reqs: list[GenerateRequest],
                 finish: Callable[[list[GenerateResult]], tuple[Any, int]], stream: bool,
                 on_cancel: Callable[[], None], on_end: Callable[[], None] = lambda: None):
        self.proxy, self.reqs, self.finish, self.stream, self.on_cancel = proxy, reqs, finish, stream, on_cancel
        self.on_end = on_end  # always, last: frees what a call that was not recorded held
        self.background = None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await self._reply(scope, receive, send)
        finally:
            self.on_end()

    async def _reply(self, scope: dict, receive: Callable, send: Callable) -> None:
        gen = asyncio.ensure_future(self.proxy.generate(self.reqs))
        watch = asyncio.ensure_future(_disconnected(receive))
        left = False
        try:
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
            body, version = self.finish(gen.result())
        except HTTPError as e:
            return await e.response()(scope, receive, send)
        except Exception as e:  # a backend or reply bug: answered, never a dead server
            log.exception("proxy generation failed")
            err = HTTPError(500, f"internal error: {type(e).__name__}: {e}")
            return await err.response()(scope, receive, send)
        headers = {"x-policy-version": str(version)}
        if not self.stream:
            return await JSONResponse(body, headers=headers)(scope, receive, send)
        with contextlib.suppress(OSError):  # the client left: everything is recorded already
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                (b"x-policy-version", str(version).encode())]})
            for event in body:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})


# -- handlers -----------------------------------------------------------------------------
def _chat(proxy: Proxy) -> Callable[[Request], Awaitable[Response]]:
    async def chat(request: Request) -> Response:
        t0 = time.perf_counter()
        session = proxy.resolve(request)
        req: ChatRequest = await _parse(request, ChatRequest, proxy.cfg.max_request_bytes)
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
        stops = req.stops()

        def finish(results: list[GenerateResult]) -> tuple[Any, int]:
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
            build = replies.chat_chunks if req.stream else replies.chat_body
            body = build(call_id, proxy.cfg.served_model_name, choices, plan.prompt_ids, reused, opts,
                         proxy.tokenizer)
            return body, min(r.version for r in results)

        return _Reply(proxy, reqs, finish, req.stream, _cancelled(session, call_id), release)

    return chat


def _completions(proxy: Proxy) -> Callable[[Request], Awaitable[Response]]:
    async def completions(request: Request) -> Response:
        t0 = time.perf_counter()
        session = proxy.resolve(request)
        req: CompletionRequest = await _parse(request, CompletionRequest, proxy.cfg.max_request_bytes)
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
        stops = req.stops()

        def finish(results: list[GenerateResult]) -> tuple[Any, int]:
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
            build = replies.completion_chunks if req.stream else replies.completion_body
            body = build(call_id, proxy.cfg.served_model_name, choices, prompts, reused, opts, proxy.tokenizer)
            return body, min(r.version for r in results)

        return _Reply(proxy, reqs, finish, req.stream, _cancelled(session, call_id), release)

    return completions


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
        body: SessionRequest = await _parse(request, SessionRequest, limit, optional=True)
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
        body: RewardRequest = await _parse(request, RewardRequest, limit)
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

        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > cfg.max_request_bytes):
            return await HTTPError(413, f"request body over {cfg.max_request_bytes} bytes").response()(
                scope, receive, send_versioned)
        if proxy.in_flight >= cfg.max_concurrent:
            return await HTTPError(503, f"{cfg.max_concurrent} requests in flight; retry later",
                                   headers={"Retry-After": str(cfg.retry_after_s)}).response()(
                scope, receive, send_versioned)
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > cfg.max_request_bytes:
                raise _TooLarge
            return message

        proxy.in_flight += 1
        try:
            await self.app(scope, limited, send_versioned)
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
def listen_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket with TCP_NODELAY, so small replies are not held ~40 ms."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock


def serve(policy: Any, config: ProxyConfig | None = None, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the proxy in the foreground (``agentrl proxy serve``)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(create_app(policy, config), log_level="info", access_log=False))
    print(f"agentrl proxy on http://{host}:{port}/v1", flush=True)
    server.run(sockets=[listen_socket(host, port)])


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
