"""Fixtures for the sandbox tests: every backend this machine can run, built the same way.

A backend that cannot run here is skipped with the reason printed (``-rs`` shows it);
``remote`` is the HTTP server (in-process, over httpx's ASGI transport) in front of
``bwrap`` when available, else ``local``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
import pytest

from agentrl.errors import SandboxUnavailableError
from agentrl.sandboxes import (
    BwrapSandbox,
    DockerSandbox,
    GvisorSandbox,
    LocalSandbox,
    PythonInterpreter,
    RemoteSandbox,
    Sandbox,
    SandboxLimits,
    check_backend,
)

ALL_BACKENDS = ["local", "bwrap", "docker", "gvisor", "remote"]
# Small limits so the attack tests finish fast; generous output for functional tests.
TEST_LIMITS = SandboxLimits(memory_mb=256, pids=64, cpu_s=60, output_bytes=1 << 20)
TOKEN = "test-token"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _skip_unless(backend: str) -> None:
    try:
        check_backend(backend)
    except SandboxUnavailableError as e:
        pytest.skip(f"backend {backend!r} unavailable here: {e}")


@dataclass
class Built:
    """A sandbox plus what the tests need to inspect it from outside."""

    name: str
    sandbox: Sandbox
    inner: Sandbox  # the sandbox that really runs commands (differs for remote)
    app: object | None = None  # the server app, for remote

    @property
    def isolation(self) -> str:
        return self.inner.ISOLATION


def _factory(backend: str, limits: SandboxLimits) -> Callable[[], Sandbox]:
    if backend == "local":
        return lambda: LocalSandbox(limits=limits)
    if backend == "bwrap":
        return lambda: BwrapSandbox(limits=limits)
    if backend == "docker":
        return lambda: DockerSandbox(limits=limits)
    if backend == "gvisor":
        return lambda: GvisorSandbox(limits=limits)
    raise ValueError(backend)


@contextlib.asynccontextmanager
async def build(backend: str, limits: SandboxLimits = TEST_LIMITS) -> AsyncIterator[Built]:
    """Start a sandbox of ``backend`` (skipping when unavailable) and close it afterwards."""
    if backend == "remote":
        from agentrl.sandboxes.server import create_app

        inner_name = "bwrap"
        try:
            check_backend("bwrap")
        except SandboxUnavailableError:
            inner_name = "local"
        made: list[Sandbox] = []
        inner_factory = _factory(inner_name, limits)

        def factory() -> Sandbox:
            made.append(inner_factory())
            return made[-1]

        app = create_app(factory, TOKEN, max_request_bytes=4 << 20)
        transport = httpx.ASGITransport(app=app)
        sandbox = RemoteSandbox("http://sandbox.test", TOKEN, transport=transport)
        try:
            await sandbox.start()
            yield Built(backend, sandbox, made[0], app)
        finally:
            await sandbox.close()
            for s in made:
                await s.close()
        return
    _skip_unless(backend)
    sandbox = _factory(backend, limits)()
    try:
        await sandbox.start()
        yield Built(backend, sandbox, sandbox)
    finally:
        await sandbox.close()


@pytest.fixture(params=ALL_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name = request.param
    if name == "remote":
        pytest.importorskip("fastapi", reason="remote backend tests need fastapi (server side)")
    else:
        _skip_unless(name)
    return name


def leftover_pids(built: Built) -> list[int]:
    """Host pids still belonging to ``built``'s sandbox, found by cgroup, uid or container.

    Skips (with the reason printed) where nothing tells the sandbox's processes
    apart from the test's own: same uid and no cgroup.
    """
    from agentrl.sandboxes._procs import pids_of_uid

    inner = built.inner
    if isinstance(inner, LocalSandbox):  # bwrap too: the private uid owns every process
        found = set(inner.cgroup.pids()) if inner.cgroup else set()
        if inner.uid != os.getuid():
            found.update(pids_of_uid(inner.uid))
        elif inner.cgroup is None:
            reason = f"{built.name} runs as the test's uid without a cgroup: leftovers unknowable"
            print(f"SKIPPED: {reason}")
            pytest.skip(reason)
        return sorted(found)
    if isinstance(inner, DockerSandbox):
        import docker

        client = docker.DockerClient(base_url=inner._base_url or _docker_url())
        try:
            c = client.containers.get(inner.container.id)
            return [c.attrs["State"]["Pid"] or -1]
        except docker.errors.NotFound:
            return []
        finally:
            client.close()
    raise TypeError(type(inner))


def _docker_url() -> str:
    from agentrl.sandboxes.docker import docker_host

    return docker_host() or "unix:///var/run/docker.sock"


@pytest.fixture
async def built(backend: str) -> AsyncIterator[Built]:
    """A started sandbox of each available backend."""
    async with build(backend) as b:
        yield b


@pytest.fixture
async def interp(built: Built) -> AsyncIterator[PythonInterpreter]:
    """A started ``PythonInterpreter`` in each available backend's sandbox."""
    it = PythonInterpreter(built.sandbox)
    await it.start()
    yield it
    await it.close()


@pytest.fixture
def builder() -> Callable:
    """``async with builder(name, limits) as built:`` for tests that need their own."""
    return build


@pytest.fixture
def leftovers() -> Callable[[Built], list[int]]:
    return leftover_pids


def live_pids_with(needle: str) -> list[int]:
    """Live (not zombie) host pids whose NUL-separated cmdline contains ``needle``.

    Docker and bwrap processes are host processes too, so root sees them all here.
    """
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if needle.encode() in cmdline and state not in (b"Z", b"X"):
            found.append(int(name))
    return found


@pytest.fixture
def live_pids() -> Callable[[str], list[int]]:
    return live_pids_with
