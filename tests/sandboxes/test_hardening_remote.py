"""Sandbox server hardening: the token is checked before any body is read, requests
and sessions are capped atomically, no unauthenticated docs, every backend call is
bounded, snapshots travel over HTTP, and non-regular files fail cleanly end to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import httpx
import pytest

pytest.importorskip("fastapi", reason="the sandbox server needs fastapi")

from agentrl.errors import SandboxError  # noqa: E402
from agentrl.sandboxes import LocalSandbox, RemoteSandbox, Sandbox  # noqa: E402
from agentrl.sandboxes.base import ExecResult  # noqa: E402
from agentrl.sandboxes.server import create_app  # noqa: E402

from .conftest import TEST_LIMITS  # noqa: E402

pytestmark = pytest.mark.anyio
TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class SlowSandbox(Sandbox):
    """A fake backend whose calls wait on ``gate``; it counts its starts."""

    ISOLATION = "none"
    gate: asyncio.Event
    started = 0

    async def start(self) -> None:
        type(self).started += 1
        await asyncio.sleep(0.2)

    async def run(self, command, stdin=None, timeout=30.0, env=None) -> ExecResult:
        await self.gate.wait()
        return ExecResult(stdout="done")

    async def write_file(self, path, data) -> None:
        await self.gate.wait()

    async def read_file(self, path) -> bytes:
        await self.gate.wait()
        return b""

    async def reset(self) -> None:
        pass

    async def close(self) -> None:
        pass


@pytest.fixture
def slow():
    SlowSandbox.gate = asyncio.Event()
    SlowSandbox.started = 0
    yield SlowSandbox
    SlowSandbox.gate.set()


def _client(app, headers=None) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t", headers=headers
    )


async def test_token_is_checked_before_the_body_is_read():
    pulled = []

    async def body():
        for i in range(4):
            pulled.append(i)
            yield b"{not json" * 100

    async with _client(create_app(LocalSandbox, TOKEN)) as raw:
        r = await raw.post("/v1/sessions/x/run", content=body())
        assert r.status_code == 401
        assert pulled == []  # the body was never asked for
        r = await raw.post("/v1/sessions/x/run", content=b"{not json")
        assert r.status_code == 401, r.text  # not a 422 from parsing it


async def test_docs_and_schema_are_not_served():
    async with _client(create_app(LocalSandbox, TOKEN), AUTH) as raw:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert (await raw.get(path)).status_code == 404, path
        assert (await raw.get("/v1/health")).status_code == 200
    async with _client(create_app(LocalSandbox, TOKEN)) as raw:
        assert (await raw.get("/openapi.json")).status_code == 401


async def test_requests_over_the_concurrency_cap_get_503(slow):
    app = create_app(slow, TOKEN, max_concurrent=2)
    async with RemoteSandbox("http://t", TOKEN, transport=httpx.ASGITransport(app=app)) as box:
        first = [asyncio.create_task(box.run("x")) for _ in range(2)]
        await asyncio.sleep(0.2)
        with pytest.raises(SandboxError, match="503.*server busy"):
            await box.run("x")
        slow.gate.set()
        assert [r.stdout for r in await asyncio.gather(*first)] == ["done", "done"]
        assert (await box.run("x")).stdout == "done"  # the slots came back


async def test_concurrent_creations_respect_max_sessions(slow):
    app = create_app(slow, TOKEN, max_sessions=2)
    async with _client(app, AUTH) as raw:
        replies = await asyncio.gather(*[raw.post("/v1/sessions") for _ in range(6)])
        codes = sorted(r.status_code for r in replies)
        assert codes == [200, 200, 429, 429, 429, 429], [r.text for r in replies]
        assert slow.started == 2
        assert (await raw.get("/v1/health")).json()["sessions"] == 2


async def test_a_stuck_backend_call_is_abandoned_with_504(slow):
    app = create_app(slow, TOKEN, op_timeout_s=0.5)
    async with RemoteSandbox("http://t", TOKEN, transport=httpx.ASGITransport(app=app)) as box:
        started = time.monotonic()
        with pytest.raises(SandboxError, match="504"):
            await box.read_file("f")
        assert time.monotonic() - started < 5


async def test_snapshot_and_restore_over_http():
    app = create_app(lambda: LocalSandbox(limits=TEST_LIMITS), TOKEN)
    async with RemoteSandbox("http://t", TOKEN, transport=httpx.ASGITransport(app=app)) as box:
        await box.write_file("a/b.txt", "v1")
        snap = await box.snapshot()
        assert isinstance(snap, bytes) and len(snap) >= 1024
        await box.write_file("a/b.txt", "v2")
        await box.write_file("new.txt", "later")
        await box.restore(snap)
        assert await box.read_file("a/b.txt") == b"v1"
        assert (await box.run("ls -A")).stdout == "a\n"


async def test_backend_without_snapshots_raises_not_implemented(slow):
    app = create_app(slow, TOKEN)
    async with RemoteSandbox("http://t", TOKEN, transport=httpx.ASGITransport(app=app)) as box:
        with pytest.raises(NotImplementedError, match="cannot snapshot"):
            await box.snapshot()


async def test_restore_larger_than_the_request_cap_is_refused():
    app = create_app(lambda: LocalSandbox(limits=TEST_LIMITS), TOKEN, max_request_bytes=1 << 16)
    async with RemoteSandbox("http://t", TOKEN, transport=httpx.ASGITransport(app=app)) as box:
        await box.write_file("keep.txt", "kept")
        with pytest.raises(SandboxError, match="413"):
            await box.restore(b"\0" * (1 << 17))
        assert await box.read_file("keep.txt") == b"kept"


def _factories():
    from agentrl.errors import SandboxUnavailableError
    from agentrl.sandboxes import DockerSandbox, check_backend

    yield pytest.param(lambda: LocalSandbox(limits=TEST_LIMITS), id="local")
    try:
        check_backend("docker")
        yield pytest.param(lambda: DockerSandbox(limits=TEST_LIMITS), id="docker")
    except SandboxUnavailableError as e:
        reason = f"docker unavailable here: {e}"
        yield pytest.param(None, id="docker", marks=pytest.mark.skip(reason=reason))


@pytest.mark.parametrize("factory", list(_factories()))
@pytest.mark.parametrize("plant", ["mkfifo f", "ln -s /etc/hostname f"])
async def test_non_regular_files_fail_cleanly_end_to_end(factory, plant):
    made: list[Sandbox] = []

    def tracked() -> Sandbox:
        made.append(factory())
        return made[-1]

    app = create_app(tracked, TOKEN)
    async with RemoteSandbox("http://t", TOKEN, transport=httpx.ASGITransport(app=app)) as box:
        assert (await box.run(plant)).ok
        for call in (box.read_file("f"), box.write_file("f", "data")):
            try:
                with pytest.raises(SandboxError):
                    await asyncio.wait_for(call, 20)
            except TimeoutError:
                _unblock_fifo(made[0])
                pytest.fail(f"{plant}: a file operation hung on the server")
        assert (await box.run("echo alive")).stdout == "alive\n"


def _unblock_fifo(inner: Sandbox) -> None:
    """Open the planted FIFO for reading so a host thread blocked writing it can finish."""
    workdir = getattr(inner, "workdir", None)
    if workdir:
        fd = os.open(os.path.join(workdir, "f"), os.O_RDONLY | os.O_NONBLOCK)
        time.sleep(0.5)
        os.close(fd)


class _Timed(Sandbox):
    """A fake backend whose run takes ``seconds``; it records whether it was closed."""

    ISOLATION = "none"

    def __init__(self) -> None:
        self.closed = False

    async def run(self, command, stdin=None, timeout=30.0, env=None) -> ExecResult:
        await asyncio.sleep(float(command))
        return ExecResult(stdout="closed under the run" if self.closed else "done")

    async def write_file(self, path, data) -> None:
        pass

    async def read_file(self, path) -> bytes:
        return b""

    async def reset(self) -> None:
        pass

    async def close(self) -> None:
        self.closed = True


@contextlib.asynccontextmanager
async def _lifespan(app):
    """Run ``app``'s ASGI lifespan (its idle reaper), as uvicorn would; ASGITransport does not."""
    inbox: asyncio.Queue = asyncio.Queue()
    outbox: asyncio.Queue = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}}
    task = asyncio.create_task(app(scope, inbox.get, outbox.put))
    assert (await outbox.get())["type"] == "lifespan.startup.complete"
    try:
        yield
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        await outbox.get()
        await task


async def test_a_call_longer_than_the_idle_timeout_never_has_its_sandbox_reaped():
    # The reaper counted a call's start as the session's last use: a run of 1.2 s with an
    # idle timeout of 0.4 s had its sandbox closed under it, and the next call got a 404.
    made: list[_Timed] = []

    def factory() -> _Timed:
        made.append(_Timed())
        return made[-1]

    app = create_app(factory, TOKEN, session_idle_s=0.4)
    async with _lifespan(app):
        async with RemoteSandbox("http://t", TOKEN, transport=httpx.ASGITransport(app=app)) as box:
            assert (await box.run("1.2")).stdout == "done"
            assert (await box.run("0")).stdout == "done"  # idle time counts from the call's end
            assert not made[0].closed
            await asyncio.sleep(1.0)  # idle now: reaped
            assert made[0].closed
            with pytest.raises(SandboxError, match="404|closed|expired"):
                await box.run("0")
