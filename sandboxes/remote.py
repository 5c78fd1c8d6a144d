"""``remote``: the ``RemoteSandbox`` client of ``agentrl sandbox serve`` (see ``server.py``).

It implements the ``Sandbox`` protocol over HTTP with httpx: transport errors
become ``SandboxError``, a vanished session ``SandboxDeadError``, a refused
token ``SandboxUnavailableError``, a busy server (503) or any other error
``SandboxError`` with the server's reason. Its isolation is ``remote``;
``server_isolation`` says what the far side runs. Long-lived processes (the
persistent interpreter) work through ``exchange`` round trips. ``snapshot`` and
``restore`` move the far sandbox's tar archive as raw bytes; a far backend that
cannot snapshot raises ``NotImplementedError`` here, as it would locally.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib

import httpx

from agentrl.errors import SandboxDeadError, SandboxError, SandboxUnavailableError

from ._files import checked_max_bytes, too_large
from .base import ExecResult, Isolation, Sandbox, SandboxProcess, isolation_at_least

__all__ = ["RemoteSandbox"]

_EXCHANGE_S = 3600.0  # how long the server waits for a process's reply line (the caller bounds it)
_SERVER_GRACE_S = 60.0  # the server answers a timed-out run or exchange within this of its timeout


# -- client ------------------------------------------------------------------------------
class RemoteSandbox(Sandbox):
    """A sandbox living on an ``agentrl sandbox serve`` server."""

    ISOLATION: Isolation = "remote"
    NAME = "remote"
    python = "python3"

    def __init__(
        self,
        url: str,
        token: str,
        timeout: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
        require_isolation: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.require_isolation = require_isolation
        self._client = httpx.AsyncClient(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(timeout, connect=30.0),
            transport=transport,
        )
        self.session_id: str | None = None
        self.server_isolation: str | None = None
        self._closed = False
        self._lock = asyncio.Lock()

    async def _call(self, method: str, path: str, body: dict | None = None, wait_s: float | None = None) -> dict:
        """A JSON call; ``wait_s``: a call that may take this long on the server (a run's or
        an exchange's own timeout) waits for it past the client's default read timeout."""
        extra: dict[str, object] = {}
        if wait_s is not None and wait_s + _SERVER_GRACE_S > (self._client.timeout.read or 0):
            extra["timeout"] = httpx.Timeout(wait_s + _SERVER_GRACE_S, connect=30.0)
        return (await self._request(method, path, json=body, **extra)).json()

    async def _request(self, method: str, path: str, **kwargs: object) -> httpx.Response:
        try:
            resp = await self._client.request(method, path, **kwargs)  # type: ignore[arg-type]
        except httpx.HTTPError as e:
            raise SandboxError(f"sandbox server {self.url} unreachable: {e!r}") from e
        if resp.status_code == 401:
            raise SandboxUnavailableError(f"sandbox server {self.url} refused the token")
        if resp.status_code in (404, 410):
            raise SandboxDeadError(f"remote sandbox is gone: {_detail(resp)}")
        if resp.status_code == 501:
            raise NotImplementedError(f"sandbox server {self.url}: {_detail(resp)}")
        if resp.status_code >= 400:
            raise SandboxError(f"sandbox server error {resp.status_code}: {_detail(resp)}")
        return resp

    async def start(self) -> None:
        async with self._lock:
            if self._closed:
                raise SandboxDeadError("this sandbox was closed; create a new one")
            if self.session_id is None:
                reply = await self._call("POST", "/v1/sessions")
                self.session_id, self.server_isolation = reply["session_id"], reply["isolation"]
                want = self.require_isolation
                if want and not isolation_at_least(self.server_isolation or "none", want):
                    await self._call("DELETE", f"/v1/sessions/{self.session_id}")
                    raise SandboxUnavailableError(
                        f"sandbox server {self.url} runs isolation {self.server_isolation!r}, "
                        f"less than the asked {want!r}; serve a stronger backend there"
                    )

    async def _session(self) -> str:
        await self.start()
        assert self.session_id is not None
        return f"/v1/sessions/{self.session_id}"

    async def run(
        self,
        command: str | list[str],
        stdin: str | bytes | None = None,
        timeout: float = 30.0,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        data = stdin.encode() if isinstance(stdin, str) else stdin
        body = {
            "command": command,
            "stdin_b64": base64.b64encode(data).decode() if data is not None else None,
            "timeout": timeout,
            "env": env,
        }
        return ExecResult(**await self._call("POST", f"{await self._session()}/run", body, wait_s=timeout))

    async def write_file(self, path: str, data: str | bytes) -> None:
        payload = data.encode() if isinstance(data, str) else data
        body = {"path": path, "data_b64": base64.b64encode(payload).decode()}
        await self._call("POST", f"{await self._session()}/write_file", body)

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """The far file's bytes; the server refuses one over ``max_bytes`` before sending it."""
        body: dict[str, object] = {"path": path}
        if checked_max_bytes(max_bytes) is not None:
            body["max_bytes"] = max_bytes
        reply = await self._call("POST", f"{await self._session()}/read_file", body)
        data = base64.b64decode(reply["data_b64"])
        if max_bytes is not None and len(data) > max_bytes:  # a server that ignores the field
            raise too_large(path, max_bytes)
        return data

    async def reset(self) -> None:
        await self._call("POST", f"{await self._session()}/reset")

    async def snapshot(self) -> bytes:
        """The far sandbox's workdir as the tar archive its backend makes."""
        return (await self._request("POST", f"{await self._session()}/snapshot")).content

    async def restore(self, snapshot: bytes) -> None:
        """Reset the far sandbox, then put back the workdir saved by ``snapshot``."""
        headers = {"content-type": "application/x-tar"}
        path = f"{await self._session()}/restore"
        await self._request("POST", path, content=snapshot, headers=headers)

    async def open_process(
        self, argv: list[str], env: dict[str, str] | None = None
    ) -> SandboxProcess:
        base = await self._session()
        reply = await self._call("POST", f"{base}/procs", {"argv": argv, "env": env})
        return _RemoteProcess(self, f"{base}/procs/{reply['proc_id']}")

    async def close(self) -> None:
        async with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self.session_id is not None:
                    with contextlib.suppress(SandboxError):
                        await self._call("DELETE", f"/v1/sessions/{self.session_id}")
            finally:
                await self._client.aclose()


class _RemoteProcess(SandboxProcess):
    def __init__(self, box: RemoteSandbox, path: str) -> None:
        self._box, self._path = box, path

    async def write(self, data: bytes) -> None:
        raise NotImplementedError("remote processes speak in exchange() round trips")

    async def readline(self) -> bytes:
        return await self.exchange(b"")

    async def exchange(self, data: bytes) -> bytes:
        body = {"data_b64": base64.b64encode(data).decode(), "timeout": _EXCHANGE_S}
        try:
            reply = await self._box._call("POST", f"{self._path}/exchange", body, wait_s=_EXCHANGE_S)
        except SandboxDeadError:
            return b""  # the process is gone: end of stream
        return base64.b64decode(reply["line_b64"])

    async def kill(self) -> None:
        if not self._box._closed:
            with contextlib.suppress(SandboxError):
                await self._box._call("DELETE", self._path)


def _detail(resp: httpx.Response) -> str:
    with contextlib.suppress(ValueError):
        return str(resp.json().get("detail", resp.text))
    return resp.text[:500]
