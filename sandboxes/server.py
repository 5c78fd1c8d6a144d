"""The sandbox server behind ``agentrl sandbox serve``: any backend over HTTP.

Server (``create_app`` / ``serve``; FastAPI on uvicorn). An ASGI gate in front
of the app checks, in this order, before any body is read:
- ``Authorization: Bearer <token>`` (compared in constant time), else 401;
- at most ``max_concurrent`` requests in flight, else 503 at once;
- request bodies over ``max_request_bytes``, refused with 413 while streaming.
There are no ``/docs`` or ``/openapi.json`` pages. A field that is not base64 is a
400 naming it. A process has one reader: a new exchange takes it over from one
still in flight (whose client gave up), which is answered 409.

Sessions: each is its own sandbox from the backend factory; the session id is a
random 128-bit token. A session with no call in flight, whose last call ended over
``session_idle_s`` ago, is closed (a call that outlasts it is never cut short). At most
``max_sessions`` live at once: a slot is claimed before the sandbox starts, so
concurrent creations cannot overshoot. Every call into a backend is bounded
(``op_timeout_s``, or a run's own timeout plus a grace), else 504.

Long-lived processes (the persistent interpreter) are exposed as ``exchange``
calls: write bytes, read one stdout line, in one round trip. Snapshots travel as
raw tar bytes (``application/x-tar``); a backend that cannot snapshot answers 501.

The client is ``RemoteSandbox`` (remote.py).

    POST   /v1/sessions                         -> {session_id, isolation}
    POST   /v1/sessions/{sid}/run               {command, stdin_b64, timeout, env}
    POST   /v1/sessions/{sid}/write_file        {path, data_b64}
    POST   /v1/sessions/{sid}/read_file         {path} -> {data_b64}
    POST   /v1/sessions/{sid}/reset
    POST   /v1/sessions/{sid}/snapshot          -> tar bytes
    POST   /v1/sessions/{sid}/restore           tar bytes
    DELETE /v1/sessions/{sid}
    POST   /v1/sessions/{sid}/procs             {argv, env} -> {proc_id}
    POST   /v1/sessions/{sid}/procs/{pid}/exchange  {data_b64, timeout} -> {line_b64}
    DELETE /v1/sessions/{sid}/procs/{pid}
    GET    /v1/health
"""

import asyncio
import base64
import contextlib
import hmac
import json
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from pydantic import BaseModel, Field

from agentrl.errors import ConfigError, SandboxDeadError, SandboxError
from agentrl.httputil import call_with_body_limit, declared_too_large, listen_socket

from .base import Sandbox, SandboxProcess

__all__ = ["bind_socket", "create_app", "serve"]

_RUN_GRACE_S = 60.0  # on top of a run's own timeout, for the backend's kill and reply
_CLOSE_S = 60.0  # closing a session waits at most this long per step


# -- wire schemas ------------------------------------------------------------------------
class RunRequest(BaseModel):
    command: str | list[str] = Field(description="Shell string or argv list.")
    stdin_b64: str | None = Field(None, description="Standard input, base64.")
    timeout: float = Field(30.0, gt=0, le=3600, description="Seconds before the run is killed.")
    env: dict[str, str] | None = Field(None, description="Extra environment variables.")


class WriteRequest(BaseModel):
    path: str = Field(description="Path under the sandbox workdir.")
    data_b64: str = Field(description="File content, base64.")


class ReadRequest(BaseModel):
    path: str = Field(description="Path under the sandbox workdir.")
    max_bytes: int | None = Field(
        None, ge=0, description="Refuse a file over this many bytes (default: the backend's cap)."
    )


class ProcRequest(BaseModel):
    argv: list[str] = Field(min_length=1, description="Program and arguments.")
    env: dict[str, str] | None = Field(None, description="Extra environment variables.")


class ExchangeRequest(BaseModel):
    data_b64: str = Field("", description="Bytes to write to stdin first, base64.")
    timeout: float = Field(60.0, gt=0, le=3600, description="Seconds to wait for a line.")


# -- server ------------------------------------------------------------------------------
@dataclass(slots=True)
class _Session:
    sandbox: Sandbox
    last_used: float = field(default_factory=time.monotonic)  # when its last call ended
    in_flight: int = 0  # calls into it still running: it is in use, never idle
    procs: dict[str, SandboxProcess] = field(default_factory=dict)
    readers: dict[str, asyncio.Future] = field(default_factory=dict)  # proc -> its exchange


class _Gate:
    """ASGI middleware run before the app parses anything: token, concurrency, body size."""

    def __init__(self, app: Any, token: str, max_bytes: int, max_concurrent: int) -> None:
        self.app, self.max_bytes, self.max_concurrent = app, max_bytes, max_concurrent
        self._expected = f"Bearer {token}".encode()
        self.in_flight = 0

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if not hmac.compare_digest(headers.get(b"authorization", b""), self._expected):
            return await _reply(send, 401, "missing or wrong bearer token")
        if self.in_flight >= self.max_concurrent:
            return await _reply(
                send, 503, f"server busy: {self.max_concurrent} requests in flight; retry later"
            )
        if declared_too_large(scope, self.max_bytes):
            return await _reply(send, 413, f"request body over {self.max_bytes} bytes")
        self.in_flight += 1
        try:
            if await call_with_body_limit(self.app, scope, receive, send, self.max_bytes):
                await _reply(send, 413, f"request body over {self.max_bytes} bytes")
        finally:
            self.in_flight -= 1


async def _reply(send: Callable, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _Store:
    """The live sessions of one server."""

    def __init__(self, factory: Callable[[], Sandbox], max_sessions: int, idle_s: float) -> None:
        self.factory, self.max_sessions, self.idle_s = factory, max_sessions, idle_s
        self.sessions: dict[str, _Session] = {}
        self.starting = 0  # slots claimed by sessions whose sandbox is still starting

    def claim_slot(self) -> None:
        """Count a new session against ``max_sessions``; no await between check and claim."""
        if len(self.sessions) + self.starting >= self.max_sessions:
            raise HTTPException(429, f"at most {self.max_sessions} sessions; close some first")
        self.starting += 1

    @contextlib.contextmanager
    def use(self, sid: str) -> Iterator[_Session]:
        """The session ``sid`` (else 404), in use until the block ends: the reaper spares
        it meanwhile, and its idle time counts from the end of the call, not the start."""
        session = self.sessions.get(sid)
        if session is None:
            raise HTTPException(404, f"no session {sid!r} (closed, expired or never created)")
        session.in_flight += 1
        try:
            yield session
        finally:
            session.in_flight -= 1
            session.last_used = time.monotonic()

    def idle(self, sid: str, now: float) -> bool:
        """Whether ``sid`` is live, with no call in flight, unused for over ``idle_s``."""
        session = self.sessions.get(sid)
        if session is None or session.in_flight:
            return False
        return now - session.last_used > self.idle_s

    async def close(self, sid: str) -> None:
        session = self.sessions.pop(sid, None)
        if session is not None:
            await _kill_procs(session, _CLOSE_S)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(session.sandbox.close(), _CLOSE_S)

    async def reap_idle_forever(self) -> None:
        while True:
            await asyncio.sleep(min(60.0, self.idle_s / 2))
            for sid in [s for s in self.sessions if self.idle(s, time.monotonic())]:
                if self.idle(sid, time.monotonic()):  # again: a call may have come meanwhile
                    await self.close(sid)  # takes it out of ``sessions`` before any await


def _b64(name: str, text: str) -> bytes:
    """The bytes of a base64 field; 400 naming the field when it is not base64."""
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as e:  # binascii.Error
        raise HTTPException(400, f"{name} is not valid base64: {e}") from e


def _http_error(e: SandboxError) -> HTTPException:
    return HTTPException(410 if isinstance(e, SandboxDeadError) else 500, str(e))


async def _bounded(what: str, call: Awaitable[Any], seconds: float) -> Any:
    """Await a backend call; its errors and a wait over ``seconds`` become HTTP errors."""
    try:
        return await asyncio.wait_for(call, seconds)
    except TimeoutError as e:
        raise HTTPException(504, f"{what} took over {seconds:.0f}s and was abandoned") from e
    except SandboxError as e:
        raise _http_error(e) from e
    except NotImplementedError as e:
        raise HTTPException(501, f"{what}: {e}") from e


def create_app(
    factory: Callable[[], Sandbox],
    token: str,
    max_request_bytes: int = 32 << 20,
    max_sessions: int = 64,
    session_idle_s: float = 3600.0,
    max_concurrent: int = 256,
    op_timeout_s: float = 300.0,
) -> Any:
    """The ASGI app serving sandboxes from ``factory`` to holders of ``token``."""
    if not token:
        raise ConfigError(
            "sandbox serve: a non-empty token is required (--token-file or $AGENTRL_SANDBOX_TOKEN)"
        )
    store = _Store(factory, max_sessions, session_idle_s)

    @contextlib.asynccontextmanager
    async def lifespan(_: Any):  # type: ignore[no-untyped-def]
        task = asyncio.create_task(store.reap_idle_forever())
        yield
        task.cancel()
        for sid in list(store.sessions):
            await store.close(sid)

    app = FastAPI(
        title="agentrl sandbox server",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.sessions = store.sessions
    isolation = getattr(factory, "ISOLATION", None) or "unknown"
    _session_routes(app, store, isolation, op_timeout_s)
    _file_routes(app, store, op_timeout_s)
    _process_routes(app, store, op_timeout_s)
    return _Gate(app, token, max_request_bytes, max_concurrent)


def _session_routes(app: FastAPI, store: _Store, isolation: str, op_s: float) -> None:
    @app.get("/v1/health")
    async def health() -> dict:
        return {"ok": True, "isolation": isolation, "sessions": len(store.sessions)}

    @app.post("/v1/sessions")
    async def new_session() -> dict:
        store.claim_slot()
        try:
            try:
                sandbox = store.factory()
            except SandboxError as e:  # a backend missing here (bwrap not installed)
                raise _http_error(e) from e
            try:
                await _bounded("starting the sandbox", sandbox.start(), op_s)
            except BaseException:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(sandbox.close(), op_s)
                raise
            sid = secrets.token_urlsafe(16)
            store.sessions[sid] = _Session(sandbox)
        finally:
            store.starting -= 1
        return {"session_id": sid, "isolation": sandbox.ISOLATION}

    @app.post("/v1/sessions/{sid}/run")
    async def run(sid: str, req: RunRequest) -> dict:
        stdin = _b64("stdin_b64", req.stdin_b64) if req.stdin_b64 is not None else None
        with store.use(sid) as session:
            call = session.sandbox.run(req.command, stdin, req.timeout, req.env)
            return asdict(await _bounded("the run", call, req.timeout + _RUN_GRACE_S))

    @app.post("/v1/sessions/{sid}/reset")
    async def reset(sid: str) -> dict:
        with store.use(sid) as session:
            await _kill_procs(session, op_s)
            await _bounded("reset", session.sandbox.reset(), op_s)
        return {"ok": True}

    @app.delete("/v1/sessions/{sid}")
    async def delete(sid: str) -> dict:
        await store.close(sid)
        return {"ok": True}


def _file_routes(app: FastAPI, store: _Store, op_s: float) -> None:
    @app.post("/v1/sessions/{sid}/write_file")
    async def write_file(sid: str, req: WriteRequest) -> dict:
        data = _b64("data_b64", req.data_b64)
        with store.use(sid) as session:
            call = session.sandbox.write_file(req.path, data)
            await _bounded(f"writing {req.path!r}", call, op_s)
        return {"ok": True}

    @app.post("/v1/sessions/{sid}/read_file")
    async def read_file(sid: str, req: ReadRequest) -> dict:
        with store.use(sid) as session:
            if req.max_bytes is None:  # backends written before the field take only a path
                call = session.sandbox.read_file(req.path)
            else:
                call = session.sandbox.read_file(req.path, max_bytes=req.max_bytes)
            data = await _bounded(f"reading {req.path!r}", call, op_s)
        return {"data_b64": base64.b64encode(data).decode()}

    @app.post("/v1/sessions/{sid}/snapshot")
    async def snapshot(sid: str) -> Response:
        with store.use(sid) as session:
            data = await _bounded("snapshot", session.sandbox.snapshot(), op_s)
        if not isinstance(data, bytes):
            raise HTTPException(501, f"snapshot: the backend gave {type(data).__name__}, not bytes")
        return Response(content=data, media_type="application/x-tar")

    @app.post("/v1/sessions/{sid}/restore")
    async def restore(sid: str, request: Request) -> dict:
        with store.use(sid) as session:
            data = await request.body()
            await _kill_procs(session, op_s)  # restore resets: the processes die anyway
            await _bounded("restore", session.sandbox.restore(data), op_s)
        return {"ok": True}


async def _kill_procs(session: _Session, op_s: float) -> None:
    procs, session.procs = list(session.procs.values()), {}
    for proc in procs:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(proc.kill(), op_s)


async def _exchange(session: _Session, sid: str, pid: str, req: ExchangeRequest) -> dict:
    """Write ``req``'s bytes to process ``pid`` and read one line back, as one reader."""
    proc = session.procs.get(pid)
    if proc is None:
        raise HTTPException(404, f"no process {pid!r} in session {sid!r}")
    data = _b64("data_b64", req.data_b64)
    # One reader a pipe. An older exchange still reading lost its client (a cancelled
    # call; the server is not told): this one takes over, as the interpreter's cancel needs.
    if (older := session.readers.pop(pid, None)) is not None:
        older.cancel()
        await asyncio.wait([older])
    reader = asyncio.ensure_future(proc.exchange(data) if data else proc.readline())
    session.readers[pid] = reader
    try:
        line = await asyncio.wait_for(reader, req.timeout)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():  # this request was cancelled
            raise
        raise HTTPException(409, f"a newer exchange with process {pid!r} took over") from None
    except (SandboxError, TimeoutError) as e:
        raise HTTPException(410, f"process stopped answering: {e}") from e
    finally:
        if session.readers.get(pid) is reader:
            del session.readers[pid]
    return {"line_b64": base64.b64encode(line).decode()}


def _process_routes(app: FastAPI, store: _Store, op_s: float) -> None:
    @app.post("/v1/sessions/{sid}/procs")
    async def open_proc(sid: str, req: ProcRequest) -> dict:
        with store.use(sid) as session:
            call = session.sandbox.open_process(req.argv, req.env)
            proc = await _bounded("starting the process", call, op_s)
            pid = secrets.token_urlsafe(8)
            session.procs[pid] = proc
        return {"proc_id": pid}

    @app.post("/v1/sessions/{sid}/procs/{pid}/exchange")
    async def exchange(sid: str, pid: str, req: ExchangeRequest) -> dict:
        with store.use(sid) as session:  # a snippet running longer than idle_s is in use
            return await _exchange(session, sid, pid, req)

    @app.delete("/v1/sessions/{sid}/procs/{pid}")
    async def kill_proc(sid: str, pid: str) -> dict:
        with store.use(sid) as session:
            proc = session.procs.pop(pid, None)
            if proc is not None:
                await _bounded("killing the process", proc.kill(), op_s)
        return {"ok": True}


bind_socket = listen_socket  # the name this module exported before ``agentrl.httputil``


def serve(
    factory: Callable[[], Sandbox], host: str, port: int, token: str, **app_kwargs: Any
) -> None:
    """Run the sandbox server in the foreground (``agentrl sandbox serve``)."""
    import uvicorn

    app = create_app(factory, token, **app_kwargs)
    server = uvicorn.Server(uvicorn.Config(app, log_level="info"))
    print(f"agentrl sandbox server on http://{host}:{port} (isolation per session: "
          f"{getattr(factory, 'ISOLATION', '?')})", flush=True)  # fmt: skip
    server.run(sockets=[bind_socket(host, port)])
