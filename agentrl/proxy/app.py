"""The proxy server: any policy behind OpenAI's and Anthropic's ``/v1``, sessions recorded as trees.

``create_app(policy, ProxyConfig)`` returns an ASGI app (Starlette; ``serve``
runs it on uvicorn, bound to 127.0.0.1 by default)::

    POST /v1/chat/completions        tools, n, temperature, top_p, max_tokens, stop, seed, stream
    POST /v1/responses               OpenAI Responses (responses_api.py), and .../input_tokens
    POST /v1/messages                Anthropic Messages (anthropic_api.py), and .../count_tokens
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
header, or by the per-session API key it sends as its bearer token (or as
``x-api-key``, as Anthropic clients do). The chat-shaped endpoints share one
handler (``handlers.chat_endpoint``); each protocol is a thin ``Wire``.

Access: with ``ProxyConfig.token`` set, every route needs it or a session's
key (both compared in constant time). A session key opens only its own
session: it samples there and reads it (``GET /sessions/{id}``, ``.../tree``);
rewarding, closing and deleting the session, and the routes of no one session
(``/sessions``), need the token, since the harness holding the key must not
score its own episode. Without a token anyone on the bound interface may call
any route, but a session key still cannot name another session.

Errors use OpenAI's ``{"error": {message, type, param, code}}`` body (on the
Anthropic routes, Anthropic's ``{"type": "error", "error": {type, message}}``): 400 for
invalid JSON or schema (``param`` names the field; see ``agentrl.httputil``
for JSON nested too deeply and lone surrogates) and for a prompt over the
context budget, 401/403 for credentials, 404 for an unknown session (or a
route the proxy lacks; 405 for a method), 409 for a closed one (a call, or a reward, to it; also for a
call that was generating when its session closed: it is not recorded), 413
for a body over ``max_request_bytes``, 500 for a close whose tree could not
be written to ``out`` (the session stays open; close it again), 503 with ``Retry-After`` when the backend fails or too many requests
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
import os
import re
import secrets
import socket
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentrl.errors import ContextOverflowError, PolicyError
from agentrl.httputil import (
    HTTPError,
    call_with_body_limit,
    declared_too_large,
    listen_socket,
    read_json,
    run_until_stopped,
)
from agentrl.policy.base import (
    MIN_TEMPERATURE,
    GenerateRequest,
    GenerateResult,
    RequestControl,
    SamplingParams,
    request_seed,
)
from agentrl.rollout.pool import DaemonPool

from .anthropic_api import ANTHROPIC_ERRORS, CountTokensRequest, MessagesWire
from .handlers import (
    ChatWire,
    chat_endpoint,
    completions_endpoint,
    count_tokens_endpoint,
    models_endpoint,
)
from .responses_api import ResponsesCountRequest, ResponsesWire, StoredResponse
from .schemas import (
    SESSION_ID_PATTERN,
    ChatRequest,
    CompletionRequest,
    ProxyConfig,
    RewardRequest,
    SessionRequest,
)
from .sessions import Session
from .streaming import OPENAI_ERRORS, ErrorShape

__all__ = ["HTTPError", "Proxy", "RunningServer", "create_app", "listen_socket", "serve",
           "serve_banner", "serve_in_thread"]

log = logging.getLogger("agentrl.proxy")


def _credentials(request: Request) -> list[str]:
    """The credentials sent: ``Authorization: Bearer KEY`` (OpenAI) and ``x-api-key: KEY``
    (Anthropic). Both count: the anthropic SDK sends both where ANTHROPIC_API_KEY (the session
    key a harness is given) and ANTHROPIC_AUTH_TOKEN (one of the user's own) are both set."""
    out = []
    value = request.headers.get("authorization", "")
    if value[:7].lower() == "bearer " and value[7:].strip():
        out.append(value[7:].strip())
    if request.headers.get("x-api-key"):
        out.append(request.headers["x-api-key"])
    return out


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
        # Their generate runs on daemon threads: one stuck in the backend must not hold the exit.
        self._threads = DaemonPool(name="agentrl-proxy-generate")
        self.in_flight = 0
        # Responses ``store``: response id -> what it added to the conversation, oldest first
        self.responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._touched: dict[str, float] = {}  # session id -> when a request last named it (monotonic)

    # -- sessions, for in-process callers too ------------------------------------------
    def create_session(self, session_id: str | None = None, meta: dict[str, Any] | None = None,
                       seed: int | None = None) -> Session:
        sid = session_id or secrets.token_urlsafe(12)
        if sid in self.sessions:
            raise HTTPError(409, f"session {sid!r} exists", param="session_id")
        if len(self.sessions) >= self.cfg.max_sessions:
            self.drop_session(self._room_for_a_session())
        session = Session(sid, meta=meta, check_prefix=self.cfg.check_prefix, seed=seed)
        self.sessions[sid] = session
        self._keys[_digest(session.api_key)] = sid
        self._touched[sid] = time.monotonic()
        return session

    def _room_for_a_session(self) -> str:
        """The session to drop for a new one: the oldest closed one, else the open one idle longest
        past ``session_idle_s``, closed first (its tree written to ``out``, closed_by: idle)."""
        closed = [s for s in self.sessions.values() if s.closed]
        if closed:
            return min(closed, key=lambda s: s.created).session_id
        now = time.monotonic()
        idle = min(self.sessions, key=lambda sid: self._touched.get(sid, 0.0))
        if now - self._touched.get(idle, 0.0) < self.cfg.session_idle_s:
            raise HTTPError(429, f"at most {self.cfg.max_sessions} open sessions, none idle for "
                            f"session_idle_s={self.cfg.session_idle_s:g}; close some first")
        if self.sessions[idle].calls:  # as at shutdown: a session that recorded nothing is not written
            self.close_session(idle, closed_by="idle")
            if not self.cfg.out:  # written nowhere: say so, as nobody closed it to take its tree
                log.warning("session %r, idle for session_idle_s=%g, was dropped for a new one with its %d "
                            "call(s) unread (no out to write it to)", idle, self.cfg.session_idle_s,
                            len(self.sessions[idle].calls))
        return idle

    def store_response(self, response_id: str, stored: StoredResponse) -> None:
        """Keep a Responses call's conversation (its input and reply) for ``previous_response_id``."""
        self.responses[response_id] = stored
        while len(self.responses) > self.cfg.max_stored_responses:
            self.responses.popitem(last=False)

    def stored_response(self, response_id: str, session: Session | None) -> StoredResponse:
        """A stored response (``.messages()``: the conversation it ends); only its own session (or
        none) may name it."""
        found = self.responses.get(response_id)
        if found is None or found.owner != (session.session_id if session else None):
            raise HTTPError(400, f"previous_response_id: no stored response {response_id!r} in this session "
                            f"(the proxy keeps the last {self.cfg.max_stored_responses} with store: true)",
                            param="previous_response_id")
        return found

    def forget_responses(self, sid: str) -> None:
        """Drop what ``sid`` stored for ``previous_response_id``: a closed session calls no more."""
        for rid in [rid for rid, r in self.responses.items() if r.owner == sid]:
            del self.responses[rid]

    def drop_session(self, sid: str) -> None:
        session = self.sessions.pop(sid, None)
        self._touched.pop(sid, None)
        self.forget_responses(sid)
        if session is not None:
            self._keys.pop(_digest(session.api_key), None)
            for rid in [r for r, stored in self.responses.items() if stored.owner == sid]:
                del self.responses[rid]  # only this session could name them

    def close_session(self, sid: str, closed_by: str | None = None) -> Any:
        """The session's tree; the first close appends it to ``cfg.out`` and then marks the session closed.
        ``closed_by``: what closed it, where no harness did (``meta["closed_by"]``).

        Written before anything is marked: a write that fails (a full disk, a
        folder that is gone) leaves the session open and recording, and the
        next close writes it again. So nothing recorded is lost.
        """
        session = self.sessions[sid]
        if session.closed:
            return session.assemble()
        tree = session.assemble()
        if closed_by is not None:
            tree.meta["closed_by"] = closed_by
        if self.cfg.out:
            try:
                append_trees(self.cfg.out, [tree])
            except (OSError, ValueError) as e:  # ValueError: text UTF-8 cannot encode
                raise HTTPError(500, f"could not write session {sid!r} to {self.cfg.out}: {e}; it stays "
                                "open: fix the cause and close it again") from e
        self.forget_responses(sid)
        return session.close()

    def write_open_sessions(self) -> int:
        """At shutdown: append each open session that recorded a call to ``cfg.out``, with
        ``meta["closed_by"] = "shutdown"`` (no harness closed it), so a stopped proxy loses
        nothing it recorded. Returns how many were written."""
        if not self.cfg.out:
            return 0
        todo = [s for s in self.sessions.values() if not s.closed and s.calls]
        trees = [s.assemble() for s in todo]
        for tree in trees:
            tree.meta["closed_by"] = "shutdown"
        written = append_trees(self.cfg.out, trees) if trees else 0
        for session in todo:  # after the write, as close_session does: a failed write closes none
            session.close()
        return written

    # -- access --------------------------------------------------------------------------
    def resolve(self, request: Request, admin: bool = False, manage: bool = False) -> Session | None:
        """Check the credentials and return the session the request names, if any. ``admin``: a
        route of no one session (session keys refused); ``manage``: one that scores, closes or
        deletes its session (with a token, that token only: a session key samples and reads)."""
        key_sid = None
        token = self.cfg.token
        is_admin = False
        for given in _credentials(request):
            sid = self._keys.get(_digest(given))
            if sid is not None and hmac.compare_digest(given.encode(), self.sessions[sid].api_key.encode()):
                key_sid = key_sid or sid
            is_admin = is_admin or (token is not None and hmac.compare_digest(given.encode(), token.encode()))
        if token is not None and not is_admin and key_sid is None:
            raise HTTPError(401, "missing or wrong bearer token")
        if admin and key_sid is not None and not is_admin:
            raise HTTPError(403, "a session key opens only its own session")
        if manage and token is not None and not is_admin:  # the harness holds its key: no scoring itself
            raise HTTPError(403, "rewarding, closing or deleting a session needs the admin token; a session "
                            "key samples in its session and reads it")
        sid = request.path_params.get("sid") or request.headers.get("x-session-id") or key_sid
        if sid is None or admin and "sid" not in request.path_params:
            return None
        if key_sid is not None and not is_admin and sid != key_sid:
            raise HTTPError(403, "this API key belongs to another session")
        session = self.sessions.get(sid)
        if session is None:
            if self.cfg.auto_create_sessions and (is_admin or token is None):
                if not re.fullmatch(SESSION_ID_PATTERN, sid):  # as POST /sessions: match's $ passed "a\n"
                    raise HTTPError(400, f"session id {sid[:64]!r}: not a valid id ({SESSION_ID_PATTERN})")
                return self.create_session(sid)
            raise HTTPError(404, f"no session {sid!r}")
        self._touched[sid] = time.monotonic()
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
            return await self._generate_serially(reqs)
        tasks = [asyncio.ensure_future(agenerate(r)) for r in reqs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:  # one failed or we were cancelled: the rest are not wanted
                t.cancel()

    async def _generate_serially(self, reqs: list[GenerateRequest]) -> list[GenerateResult]:
        """A policy without ``agenerate``: ``generate`` on a thread, one call at a time.

        A cancelled call tells the backend to stop, but its thread runs on until the
        backend notices: the lock is held until that thread returns, not only until
        the cancel, so the next call never runs beside it.
        """
        if self._lock is None:
            self._lock = asyncio.Lock()
        lock = self._lock
        await lock.acquire()
        try:
            thread = asyncio.get_running_loop().run_in_executor(self._threads, self.policy.generate, reqs)
        except BaseException:
            lock.release()
            raise

        def done(f: asyncio.Future) -> None:
            lock.release()
            if not f.cancelled():
                f.exception()  # retrieved: a call nobody awaits any more may fail quietly
        thread.add_done_callback(done)
        try:
            return list(await asyncio.shield(thread))
        except asyncio.CancelledError:  # the thread runs on: tell the backend to stop
            for r in reqs:
                if r.control is not None:
                    r.control.cancel()
            raise

    def max_new_tokens(self, prompt_len: int, asked: int | None, param: str,
                       max_param: str = "max_tokens") -> int:
        budget = self.cfg.max_context_tokens
        room = budget - prompt_len
        if room <= 0:
            raise HTTPError(400, f"the prompt is {prompt_len} tokens, over the context budget of {budget}",
                            param=param, code="context_length_exceeded")
        if asked is None:
            return min(self.cfg.default_max_tokens, room)
        if asked > room and self.cfg.clamp_max_tokens:
            return room
        if asked > room:
            raise HTTPError(400, f"the prompt ({prompt_len} tokens) plus {max_param} ({asked}) is over "
                            f"the context budget of {budget} tokens", param=max_param,
                            code="context_length_exceeded")
        return asked

    def requests(self, prompt: list[int], req: ChatRequest | CompletionRequest, max_new: int,
                 logprobs: int, session: Session | None = None, call_id: str = "") -> list[GenerateRequest]:
        if req.n > self.cfg.max_n:
            raise HTTPError(400, f"n: at most {self.cfg.max_n}", param="n")
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in req.stop_token_ids or ()):
            raise HTTPError(400, f"stop_token_ids: token ids must be in [0, {vocab})", param="stop_token_ids")
        # A top_k past the vocabulary keeps every token: sent as 0 (off), never a number a
        # backend's int32 tensors overflow on.
        top_k = req.top_k if req.top_k is not None and 0 < req.top_k < vocab else 0
        base = req.seed if session is None else session.call_seed(prompt, req.seed, call_id)
        out = []
        for i in range(req.n):
            seed = None if base is None else (base if i == 0 else request_seed(base, i))
            try:
                params = SamplingParams(
                    temperature=_temperature(req.temperature),
                    top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k,
                    max_new_tokens=max_new, stop=req.stops(),
                    stop_token_ids=tuple(req.stop_token_ids or ()), logprobs=logprobs, seed=seed)
            except PolicyError as e:
                raise HTTPError(400, str(e)) from None
            out.append(GenerateRequest(list(prompt), params, RequestControl()))
        return out


def append_trees(path: str, trees: list[Any]) -> int:
    """Append trees to the JSONL file ``path`` whole or not at all; how many were appended.

    One ``write`` call of every line together: a proxy beside this one appending to the same
    file (two runs, one ``--out``) cannot interleave its lines into ours, as the buffered
    writer's 8 KB pieces could. A write that fails part way (a full disk) is cut back off the
    file: a broken line there made every later read of the file fail, the trees written
    again after it included.
    """
    data = "".join(tree.to_json() + "\n" for tree in trees).encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        done = 0
        try:
            while done < len(data):  # a regular file takes it in one write; a short one goes on
                done += os.write(fd, data[done:])
        except OSError:
            if done:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)
    return len(trees)


def _temperature(asked: float | None) -> float:
    """The temperature sampled at: 1 when unset; 0 (greedy) for one too small to sample at,
    as vLLM's server decodes it (the OpenAI and Anthropic APIs take any value from 0)."""
    t = 1.0 if asked is None else asked
    return 0.0 if t < MIN_TEMPERATURE else t


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
        session = _own(proxy, request, manage=True)
        body: RewardRequest = await read_json(request, RewardRequest, limit)
        if session.closed:  # its tree is written (to out): a reward now would reach no reader
            raise HTTPError(409, f"session {session.session_id!r} is closed: post its rewards before closing it")
        try:
            nodes = session.set_reward(body.reward, body.call_id, body.choice, body.terminated)
        except (KeyError, IndexError, ValueError) as e:  # ValueError: a reward that is not finite
            msg = str(e.args[0]) if e.args else str(e)
            raise HTTPError(404 if "no call" in msg else 400, msg, param=msg.split(":")[0]) from None
        return JSONResponse({"ok": True, "nodes": nodes})

    async def close(request: Request) -> Response:
        session = _own(proxy, request, manage=True)
        return JSONResponse(proxy.close_session(session.session_id).to_dict())

    async def delete(request: Request) -> Response:
        proxy.drop_session(_own(proxy, request, manage=True).session_id)
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


def _own(proxy: Proxy, request: Request, manage: bool = False) -> Session:
    session = proxy.resolve(request, manage=manage)
    assert session is not None  # the route has {sid}
    return session


def _guarded(handler: Callable[[Request], Awaitable[Response]],
             errors: ErrorShape = OPENAI_ERRORS) -> Callable[[Request], Awaitable[Response]]:
    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except HTTPError as e:
            return errors.response(e)
        except Exception as e:  # a bug here must not take the server down
            log.exception("proxy handler failed")
            return errors.response(HTTPError(500, f"internal error: {type(e).__name__}: {e}"))
    return run


def _errors_for(path: str) -> ErrorShape:
    """The error shape of the protocol a path belongs to (for the gate's 413 and 503, and routes
    the proxy does not have)."""
    return ANTHROPIC_ERRORS if "/v1/messages" in path else OPENAI_ERRORS


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

        errors = _errors_for(scope.get("path", ""))
        if declared_too_large(scope, cfg.max_request_bytes):
            return await errors.response(HTTPError(413, f"request body over {cfg.max_request_bytes} bytes"))(
                scope, receive, send_versioned)
        if proxy.in_flight >= cfg.max_concurrent:
            return await errors.response(HTTPError(503, f"{cfg.max_concurrent} requests in flight; retry later",
                                                   headers={"Retry-After": str(cfg.retry_after_s)}))(
                scope, receive, send_versioned)
        proxy.in_flight += 1
        try:
            if await call_with_body_limit(self.app, scope, receive, send_versioned, cfg.max_request_bytes):
                await errors.response(HTTPError(413, f"request body over {cfg.max_request_bytes} bytes"))(
                    scope, receive, send_versioned)
        finally:
            proxy.in_flight -= 1


def create_app(policy: Any, config: ProxyConfig | None = None) -> Any:
    """The proxy's ASGI app; ``app.proxy`` is its ``Proxy`` (sessions, config)."""
    proxy = Proxy(policy, config)
    messages = MessagesWire()
    api = [("/v1/chat/completions", chat_endpoint(proxy, ChatWire()), "POST", OPENAI_ERRORS),
           ("/v1/responses", chat_endpoint(proxy, ResponsesWire()), "POST", ResponsesWire.errors),
           ("/v1/responses/input_tokens", count_tokens_endpoint(proxy, ResponsesWire(), ResponsesCountRequest,
                                                                "response.input_tokens"), "POST", OPENAI_ERRORS),
           ("/v1/messages", chat_endpoint(proxy, messages), "POST", ANTHROPIC_ERRORS),
           ("/v1/messages/count_tokens", count_tokens_endpoint(proxy, messages, CountTokensRequest), "POST", ANTHROPIC_ERRORS),
           ("/v1/completions", completions_endpoint(proxy), "POST", OPENAI_ERRORS),
           ("/v1/models", models_endpoint(proxy), "GET", OPENAI_ERRORS)]
    routes = [Route(p, _guarded(h, e), methods=[m]) for p, h, m, e in api]
    routes += [Route("/sessions/{sid}" + p, _guarded(h, e), methods=[m]) for p, h, m, e in api]
    routes += [Route(r.path, _guarded(r.endpoint), methods=list(r.methods or ())) for r in _session_routes(proxy)]

    async def health(_: Request) -> Response:
        return JSONResponse({"ok": True, "sessions": len(proxy.sessions), "version": policy.version})

    routes.append(Route("/health", health, methods=["GET"]))

    async def no_route(request: Request, exc: Exception) -> Response:
        # A route or method the proxy lacks (embeddings, batches, GET /v1/responses/{id}): answered
        # in its protocol's error shape, as every other refusal, not as starlette's plain text.
        status = getattr(exc, "status_code", 404)
        what = "no such route" if status == 404 else "method not allowed"
        message = f"{what}: {request.method} {request.url.path}"
        if _errors_for(request.url.path) is ANTHROPIC_ERRORS:
            return ANTHROPIC_ERRORS.response(HTTPError(status, message))
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": None}}, status)  # as OpenAI's own 404 and 405

    return _Gate(Starlette(routes=routes, exception_handlers={404: no_route, 405: no_route}), proxy)


# -- running it -------------------------------------------------------------------------------
_GRACEFUL_S = 5.0


def serve(policy: Any, config: ProxyConfig | None = None, host: str = "127.0.0.1", port: int = 8000,
          sock: socket.socket | None = None) -> None:
    """Run the proxy in the foreground (``agentrl proxy serve``), on ``sock`` where given (the
    command listens before it loads the model, so a port in use fails at once)."""
    import uvicorn

    sock = sock or listen_socket(host, port)  # a port in use fails here, before the banner says it serves
    app = create_app(policy, config)
    # A call still generating at a stop has this long to end (and be recorded); a generation can
    # run for minutes, and uvicorn's default waited for it however long it took.
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", access_log=False,
                                           timeout_graceful_shutdown=_GRACEFUL_S))
    # The model, tokenizer and modules loaded so far live as long as the server: keep them out of
    # the collector's full passes, which otherwise stall every request in flight (~100 ms here).
    gc.collect()
    gc.freeze()
    print(serve_banner(host, sock.getsockname()[1], config or ProxyConfig()), flush=True)  # --port 0: the one it got
    try:
        run_until_stopped(server, sock)  # until Ctrl-C or SIGTERM, after the requests in flight
    finally:
        _write_open_sessions(app.proxy)


def _write_open_sessions(proxy: Proxy) -> None:
    """At the stop: the open sessions to ``--out``, saying how many, or why they are lost (its
    folder went, the disk is full) instead of a traceback out of the shutdown."""
    lost = sum(not s.closed and bool(s.calls) for s in proxy.sessions.values())
    try:
        written = proxy.write_open_sessions()
    except OSError as e:
        print(f"error: could not write {lost} open session(s) to {proxy.cfg.out}: {e.strerror or e}; "
              "what they recorded is lost", file=sys.stderr, flush=True)
        return
    if written:
        print(f"wrote {written} open session(s) to {proxy.cfg.out} (meta closed_by: shutdown)", flush=True)


def serve_banner(host: str, port: int, config: ProxyConfig) -> str:
    """What ``agentrl proxy serve`` prints: the URLs a harness takes are a session's
    (``/sessions/<id>/v1`` for OpenAI clients, ``/sessions/<id>`` for Anthropic ones, which add
    ``/v1/messages``); plain ``/v1`` samples without recording a tree."""
    base = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    opened = ("any new <id> opens a session (--auto-create-sessions)" if config.auto_create_sessions
              else f"open one first: POST {base}/sessions -> session_id, api_key, base_url")
    return (f"agentrl proxy on {base}: Chat Completions, Responses, Anthropic Messages\n"
            f"  a harness's OPENAI_BASE_URL: {base}/sessions/<id>/v1  ({opened})\n"
            f"  its ANTHROPIC_BASE_URL (Claude Code, anthropic SDKs): {base}/sessions/<id>\n"
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
