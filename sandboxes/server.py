"""The sandbox server behind ``agentrl sandbox serve``: any backend over HTTP.

Server (``create_app`` / ``serve``; FastAPI on uvicorn):
- Every request needs ``Authorization: Bearer <token>`` (compared in constant time).
- Request bodies over ``max_request_bytes`` are refused with 413 before they are read whole.
- Each session is its own sandbox from the backend factory; the session id is a
  random 128-bit token. Idle sessions are closed after ``session_idle_s``, and at
  most ``max_sessions`` live at once.
- Long-lived processes (the persistent interpreter) are exposed as
  ``exchange`` calls: write bytes, read one stdout line, in one round trip.

The client is ``RemoteSandbox`` (remote.py).

    POST   /v1/sessions                         -> {session_id, isolation}
    POST   /v1/sessions/{sid}/run               {command, stdin_b64, timeout, env}
    POST   /v1/sessions/{sid}/write_file        {path, data_b64}
    POST   /v1/sessions/{sid}/read_file         {path} -> {data_b64}
    POST   /v1/sessions/{sid}/reset
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
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel, Field

from agentrl.errors import ConfigError, SandboxDeadError, SandboxError

from .base import Sandbox, SandboxProcess

__all__ = ["bind_socket", "create_app", "serve"]


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
    last_used: float = field(default_factory=time.monotonic)
    procs: dict[str, SandboxProcess] = field(default_factory=dict)


class _BodyLimit:
    """ASGI middleware: 413 for bodies over ``limit`` bytes, checked while streaming."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and int(declared) > self.limit:
            return await _plain(send, 413, b"request body too large")
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await _plain(send, 413, b"request body too large")


class _TooLarge(Exception):
    pass


async def _plain(send: Callable, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": body})


class _Store:
    """The live sessions of one server."""

    def __init__(self, factory: Callable[[], Sandbox], max_sessions: int, idle_s: float) -> None:
        self.factory, self.max_sessions, self.idle_s = factory, max_sessions, idle_s
        self.sessions: dict[str, _Session] = {}

    def get(self, sid: str) -> _Session:
        session = self.sessions.get(sid)
        if session is None:
            raise HTTPException(404, f"no session {sid!r} (closed, expired or never created)")
        session.last_used = time.monotonic()
        return session

    async def close(self, sid: str) -> None:
        session = self.sessions.pop(sid, None)
        if session is not None:
            for proc in session.procs.values():
                with contextlib.suppress(Exception):
                    await proc.kill()
            with contextlib.suppress(Exception):
                await session.sandbox.close()

    async def reap_idle_forever(self) -> None:
        while True:
            await asyncio.sleep(min(60.0, self.idle_s / 2))
            now = time.monotonic()
            for sid in [s for s, v in self.sessions.items() if now - v.last_used > self.idle_s]:
                await self.close(sid)


def _http_error(e: SandboxError) -> HTTPException:
    return HTTPException(410 if isinstance(e, SandboxDeadError) else 500, str(e))


def create_app(
    factory: Callable[[], Sandbox],
    token: str,
    max_request_bytes: int = 32 << 20,
    max_sessions: int = 64,
    session_idle_s: float = 3600.0,
) -> Any:
    """The ASGI app serving sandboxes from ``factory`` to holders of ``token``."""
    if not token:
        raise ConfigError("sandbox serve: a non-empty --token is required")
    store = _Store(factory, max_sessions, session_idle_s)

    @contextlib.asynccontextmanager
    async def lifespan(_: Any):  # type: ignore[no-untyped-def]
        task = asyncio.create_task(store.reap_idle_forever())
        yield
        task.cancel()
        for sid in list(store.sessions):
            await store.close(sid)

    def auth(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, "missing or wrong bearer token")

    app = FastAPI(title="agentrl sandbox server", lifespan=lifespan)
    app.state.sessions = store.sessions
    deps = [Depends(auth)]
    _session_routes(app, store, deps, getattr(factory, "ISOLATION", None) or "unknown")
    _process_routes(app, store, deps)
    return _BodyLimit(app, max_request_bytes)


def _session_routes(app: FastAPI, store: _Store, deps: list, isolation: str) -> None:
    @app.get("/v1/health", dependencies=deps)
    async def health() -> dict:
        return {"ok": True, "isolation": isolation, "sessions": len(store.sessions)}

    @app.post("/v1/sessions", dependencies=deps)
    async def new_session() -> dict:
        if len(store.sessions) >= store.max_sessions:
            raise HTTPException(429, f"at most {store.max_sessions} sessions; close some first")
        sandbox = store.factory()
        try:
            await sandbox.start()
        except SandboxError as e:
            raise _http_error(e) from e
        sid = secrets.token_urlsafe(16)
        store.sessions[sid] = _Session(sandbox)
        return {"session_id": sid, "isolation": sandbox.ISOLATION}

    @app.post("/v1/sessions/{sid}/run", dependencies=deps)
    async def run(sid: str, req: RunRequest) -> dict:
        session = store.get(sid)
        stdin = base64.b64decode(req.stdin_b64) if req.stdin_b64 is not None else None
        try:
            result = await session.sandbox.run(req.command, stdin, req.timeout, req.env)
        except SandboxError as e:
            raise _http_error(e) from e
        return asdict(result)

    @app.post("/v1/sessions/{sid}/write_file", dependencies=deps)
    async def write_file(sid: str, req: WriteRequest) -> dict:
        try:
            await store.get(sid).sandbox.write_file(req.path, base64.b64decode(req.data_b64))
        except SandboxError as e:
            raise _http_error(e) from e
        return {"ok": True}

    @app.post("/v1/sessions/{sid}/read_file", dependencies=deps)
    async def read_file(sid: str, req: ReadRequest) -> dict:
        try:
            data = await store.get(sid).sandbox.read_file(req.path)
        except SandboxError as e:
            raise _http_error(e) from e
        return {"data_b64": base64.b64encode(data).decode()}

    @app.post("/v1/sessions/{sid}/reset", dependencies=deps)
    async def reset(sid: str) -> dict:
        session = store.get(sid)
        for proc in session.procs.values():
            await proc.kill()
        session.procs.clear()
        try:
            await session.sandbox.reset()
        except SandboxError as e:
            raise _http_error(e) from e
        return {"ok": True}

    @app.delete("/v1/sessions/{sid}", dependencies=deps)
    async def delete(sid: str) -> dict:
        await store.close(sid)
        return {"ok": True}


def _process_routes(app: FastAPI, store: _Store, deps: list) -> None:
    @app.post("/v1/sessions/{sid}/procs", dependencies=deps)
    async def open_proc(sid: str, req: ProcRequest) -> dict:
        session = store.get(sid)
        try:
            proc = await session.sandbox.open_process(req.argv, req.env)
        except SandboxError as e:
            raise _http_error(e) from e
        pid = secrets.token_urlsafe(8)
        session.procs[pid] = proc
        return {"proc_id": pid}

    @app.post("/v1/sessions/{sid}/procs/{pid}/exchange", dependencies=deps)
    async def exchange(sid: str, pid: str, req: ExchangeRequest) -> dict:
        proc = store.get(sid).procs.get(pid)
        if proc is None:
            raise HTTPException(404, f"no process {pid!r} in session {sid!r}")
        try:
            data = base64.b64decode(req.data_b64)
            line = await asyncio.wait_for(
                proc.exchange(data) if data else proc.readline(), req.timeout
            )
        except (SandboxError, TimeoutError) as e:
            raise HTTPException(410, f"process stopped answering: {e}") from e
        return {"line_b64": base64.b64encode(line).decode()}

    @app.delete("/v1/sessions/{sid}/procs/{pid}", dependencies=deps)
    async def kill_proc(sid: str, pid: str) -> dict:
        proc = store.get(sid).procs.pop(pid, None)
        if proc is not None:
            await proc.kill()
        return {"ok": True}


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket with TCP_NODELAY (inherited by accepted connections).

    Without it, uvicorn's split header/body writes meet the client's delayed ACK and
    every request costs about 40 ms on Linux.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock


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
