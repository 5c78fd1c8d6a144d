"""A hostile review of the sandboxes: what model-written code and a malicious tool caller
tried that the security and hardening suites did not, each kept as the attack that broke it.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import types

import httpx
import pytest

from agentrl.errors import SandboxError, SandboxUnavailableError
from agentrl.sandboxes import (
    DockerSandbox,
    LocalSandbox,
    PythonInterpreter,
    RemoteSandbox,
    Sandbox,
    SandboxPool,
    SandboxProcess,
    check_backend,
)
from agentrl.sandboxes import docker as docker_backend
from agentrl.sandboxes.base import ExecResult
from agentrl.sandboxes.docker import docker_client

from .conftest import TEST_LIMITS

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    "spawn",
    [
        "import os, time\nif os.fork() == 0:\n    time.sleep(60)\n    os._exit(0)\n",
        "import multiprocessing as mp, time\n"
        "worker = mp.get_context('fork').Process(target=time.sleep, args=(60,), daemon=True)\n"
        "worker.start()\n",
    ],
    ids=["os.fork", "multiprocessing"],
)
async def test_snippet_that_leaves_a_background_child_finishes_and_keeps_its_state(interp, spawn):
    # The child inherits the snippet's status pipe; the kernel waited for its EOF, so a
    # finished snippet was reported as timed out and its state rolled back.
    r = await interp.execute(spawn + "kept = 42\nprint('done')", timeout=5)
    assert (r.stdout, r.timed_out, r.exit_code) == ("done\n", False, 0), r
    assert interp.history[0][0].startswith(spawn)
    assert (await interp.execute("kept", timeout=5)).stdout == "42\n"


async def test_snapshot_of_sparse_files_is_refused_not_inflated(builder, backend):
    # 256 MiB of holes take no room in an 8 MiB workdir, and the snapshot stored them at
    # full size: on the host's heap, a few thousand such files ran a trainer out of memory.
    limits = TEST_LIMITS.model_copy(update={"workdir_mb": 8})
    async with builder(backend, limits) as b:
        r = await b.sandbox.run("for i in 1 2 3 4; do truncate -s 64M hole$i || exit 1; done")
        assert r.ok, r
        with pytest.raises(SandboxError, match="snapshot"):
            await b.sandbox.snapshot()
        await b.sandbox.run("rm hole*")
        await b.sandbox.write_file("small.txt", "kept")
        snap = await b.sandbox.snapshot()
        await b.sandbox.restore(snap)
        assert await b.sandbox.read_file("small.txt") == b"kept"


@pytest.mark.parametrize("command", [["echo", "a\0b"], "echo a\0b"], ids=["argv", "shell"])
async def test_a_command_holding_a_nul_byte_is_a_failed_run_on_every_backend(built, command):
    # A model's "\u0000" in a bash call raised ValueError out of local and bwrap (the tool
    # failed its episode) where docker answers with a failed run the model can read.
    r = await built.sandbox.run(command, timeout=30)
    assert not r.ok and not r.timed_out, r
    assert (await built.sandbox.run("echo alive", timeout=30)).stdout == "alive\n"


async def test_an_empty_argv_is_refused_on_every_backend(built):
    # local and bwrap ran `env -i` with nothing after it, which printed the sandbox's env.
    with pytest.raises(SandboxError):
        await built.sandbox.run([], timeout=30)


@pytest.mark.parametrize("op", ["write", "read"])
async def test_a_path_holding_a_nul_byte_is_a_sandbox_error(built, op):
    call = (
        built.sandbox.write_file("a\0b", b"x") if op == "write" else built.sandbox.read_file("a\0b")
    )
    with pytest.raises(SandboxError):
        await call


class _Tracked(Sandbox):
    """A fake backend that records closes; its start fails, or its run (the health check)
    or reset waits on ``hang``, when asked."""

    def __init__(self, fail_start=False, hang: asyncio.Event | None = None, hang_in="run"):
        self.fail_start, self.hang, self.hang_in, self.closed = fail_start, hang, hang_in, False

    async def _maybe_hang(self, where: str) -> None:
        if self.hang is not None and self.hang_in == where:
            await self.hang.wait()

    async def start(self) -> None:
        if self.fail_start:
            raise SandboxError("start failed (test)")

    async def run(self, command, stdin=None, timeout=30.0, env=None) -> ExecResult:
        await self._maybe_hang("run")
        return ExecResult()

    async def write_file(self, path, data) -> None:
        pass

    async def read_file(self, path) -> bytes:
        return b""

    async def reset(self) -> None:
        await self._maybe_hang("reset")

    async def close(self) -> None:
        self.closed = True


async def test_pool_start_that_fails_once_keeps_or_closes_every_other_sandbox():
    # gather raised the first failure and dropped the sandboxes that had started: never
    # pooled, never closed (a docker container each, running until the trainer exits).
    made = [_Tracked(), _Tracked(fail_start=True), _Tracked()]
    pool = SandboxPool(iter(made).__next__, size=3)
    with pytest.raises(SandboxError, match="start failed"):
        await pool.start()
    assert pool.idle == 2
    await pool.close()
    assert all(s.closed for s in made)


async def test_pool_acquire_cancelled_mid_health_check_loses_no_sandbox():
    hang = asyncio.Event()
    made: list[_Tracked] = []

    def factory() -> _Tracked:
        made.append(_Tracked(hang=hang if not made else None))
        return made[-1]

    pool = SandboxPool(factory, size=1)
    await pool.release(await pool.acquire())
    pool._idle[0].born -= 5  # no longer fresh: acquire health-checks it, and that hangs
    task = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert made[0].closed or pool.idle == 1  # either back in the pool or closed, not lost
    got = await asyncio.wait_for(pool.acquire(), 5)
    assert got is not None
    await pool.close()
    assert all(s.closed for s in made)


async def test_pool_release_cancelled_mid_reset_loses_no_sandbox():
    hang = asyncio.Event()
    pool = SandboxPool(lambda: _Tracked(hang=hang, hang_in="reset"), size=1)
    box = await pool.acquire()
    task = asyncio.create_task(pool.release(box))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await pool.close()
    assert box.closed


async def test_pool_waiter_gets_the_place_of_a_sandbox_that_failed_to_start():
    # The failed creation freed its place silently: the waiter slept until acquire_timeout
    # and was told that no sandbox was free.
    class SlowFail(_Tracked):
        async def start(self) -> None:
            await asyncio.sleep(0.2)
            await super().start()

    made: list[_Tracked] = []

    def factory() -> _Tracked:
        made.append(SlowFail(fail_start=not made))
        return made[-1]

    pool = SandboxPool(factory, size=1, acquire_timeout=3)
    first = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0.05)
    second = asyncio.create_task(pool.acquire())
    with pytest.raises(SandboxError, match="start failed"):
        await first
    assert await second is made[1]
    await pool.close()
    assert all(s.closed for s in made)


class _Pipe(SandboxProcess):
    """A long-lived process whose lines arrive when the test puts them in ``lines``."""

    def __init__(self) -> None:
        self.lines: asyncio.Queue[bytes] = asyncio.Queue()

    async def write(self, data: bytes) -> None:
        pass

    async def readline(self) -> bytes:
        return await self.lines.get()

    async def kill(self) -> None:
        pass


class _Served(_Tracked):
    ISOLATION = "none"
    procs: list[_Pipe] = []

    async def open_process(self, argv, env=None) -> SandboxProcess:
        self.procs.append(_Pipe())
        return self.procs[-1]


@pytest.fixture
def served():
    pytest.importorskip("fastapi", reason="the sandbox server needs fastapi")
    from agentrl.sandboxes.server import create_app

    _Served.procs = []
    app = create_app(_Served, "tok")
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    headers = {"Authorization": "Bearer tok"}
    return httpx.AsyncClient(transport=transport, base_url="http://t", headers=headers)


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("run", {"command": "cat", "stdin_b64": "a"}),
        ("write_file", {"path": "x", "data_b64": "not base64!"}),
        ("procs/{pid}/exchange", {"data_b64": "a"}),
    ],
)
async def test_server_answers_malformed_base64_with_400_naming_the_field(served, route, body):
    # binascii.Error escaped the routes: a bare 500 "Internal Server Error", a traceback in
    # the server's log, and no reason for the client.
    async with served as client:
        sid = (await client.post("/v1/sessions")).json()["session_id"]
        pid = (await client.post(f"/v1/sessions/{sid}/procs", json={"argv": ["x"]})).json()
        r = await client.post(f"/v1/sessions/{sid}/{route.format(pid=pid['proc_id'])}", json=body)
        field = next(k for k in body if k.endswith("_b64"))
        assert r.status_code == 400 and field in r.json()["detail"], r.text


async def test_server_hands_a_process_to_the_newest_exchange(served):
    # Two readers on one pipe raised RuntimeError inside asyncio: a bare 500. The older
    # exchange's client has given up (an interpreter call that was cancelled): the newer one
    # reads on, and the older is answered 409.
    async with served as client:
        sid = (await client.post("/v1/sessions")).json()["session_id"]
        pid = (await client.post(f"/v1/sessions/{sid}/procs", json={"argv": ["x"]})).json()
        url = f"/v1/sessions/{sid}/procs/{pid['proc_id']}/exchange"
        first = asyncio.create_task(client.post(url, json={"timeout": 10}))
        await asyncio.sleep(0.1)
        second = asyncio.create_task(client.post(url, json={"timeout": 10}))
        older = await first
        assert older.status_code == 409 and "newer exchange" in older.text, older.text
        _Served.procs[0].lines.put_nowait(b"one line\n")
        newer = await second
        assert newer.status_code == 200 and newer.json()["line_b64"] == "b25lIGxpbmUK"


async def test_interpreter_over_a_real_server_keeps_its_state_when_a_call_is_cancelled():
    # Over TCP the server went on reading for the cancelled call (a client that goes away
    # does not stop the handler), so the interpreter's cancel could not get through and the
    # kernel was dropped: every earlier snippet's state was lost, not just the cancelled one.
    pytest.importorskip("fastapi", reason="the sandbox server needs fastapi")
    import uvicorn

    from agentrl.sandboxes.server import bind_socket, create_app

    sock = bind_socket("127.0.0.1", 0)
    app = create_app(lambda: LocalSandbox(limits=TEST_LIMITS), "tok")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        for _ in range(200):
            if server.started:
                break
            await asyncio.sleep(0.05)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        async with RemoteSandbox(url, "tok") as box, PythonInterpreter(box) as it:
            await it.execute("acc = 20")
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(it.execute("import time; time.sleep(5)", timeout=10), 0.5)
            r = await it.execute("acc + 22")
            assert (r.stdout, it.restarts) == ("42\n", 0), r
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        sock.close()


async def test_server_says_why_a_session_cannot_be_made():
    pytest.importorskip("fastapi", reason="the sandbox server needs fastapi")
    from agentrl.sandboxes.server import create_app

    def factory() -> Sandbox:
        raise SandboxUnavailableError("no bwrap here (test)")

    transport = httpx.ASGITransport(app=create_app(factory, "tok"), raise_app_exceptions=False)
    box = RemoteSandbox("http://t", "tok", transport=transport)
    with pytest.raises(SandboxError, match="no bwrap here"):  # was: 500 Internal Server Error
        await box.start()
    await box.close()


def _docker_or_skip():
    try:
        check_backend("docker")
    except SandboxUnavailableError as e:
        print(f"SKIPPED: docker unavailable here: {e}")
        pytest.skip(f"docker unavailable here: {e}")
    return docker_client()


def _container_exists(client, cid: str) -> bool:
    import docker

    try:
        client.containers.get(cid)
        return True
    except docker.errors.NotFound:
        return False


async def test_a_docker_sandbox_never_closed_removes_its_container_when_the_process_exits():
    # Local and bwrap free what they hold when collected or at exit; a docker sandbox left its
    # container running `sleep infinity` (with its memory) after the trainer had exited.
    # (A subprocess that exits: gc.collect() in this process is no proof, since a test runner's
    # frames may still hold the sandbox.)
    client = _docker_or_skip()
    forgotten = (
        "import asyncio\n"
        "from agentrl.sandboxes import DockerSandbox\n"
        "box = DockerSandbox()\n"
        "asyncio.run(box.start())\n"
        "print(box.container.id, flush=True)\n"
        "# exits normally, never closing it\n"
    )
    done = subprocess.run([sys.executable, "-c", forgotten], capture_output=True, text=True, timeout=120)
    cid = done.stdout.strip()
    try:
        assert done.returncode == 0 and cid, done.stderr
        assert not _container_exists(client, cid)
    finally:
        with contextlib.suppress(Exception):
            client.containers.get(cid).remove(force=True)
        client.close()


async def test_containers_of_a_killed_trainer_are_swept_at_the_next_start(monkeypatch):
    client = _docker_or_skip()
    killed = (
        "import asyncio, os, sys\n"
        "from agentrl.sandboxes import DockerSandbox\n"
        "box = DockerSandbox()\n"
        "asyncio.run(box.start())\n"
        "print(box.container.id, flush=True)\n"
        "os._exit(0)  # as SIGKILL would: no close, no finalizer\n"
    )
    done = subprocess.run([sys.executable, "-c", killed], capture_output=True, text=True)
    cid = done.stdout.strip()
    assert done.returncode == 0 and cid, done.stderr
    try:
        monkeypatch.setattr(docker_backend, "_swept", set())  # this process sweeps again
        assert _container_exists(client, cid)
        async with DockerSandbox(limits=TEST_LIMITS) as box:
            assert (await box.run("echo alive")).stdout == "alive\n"
        assert not _container_exists(client, cid)
    finally:
        with contextlib.suppress(Exception):
            client.containers.get(cid).remove(force=True)
        client.close()


async def test_docker_process_reads_on_in_step_after_a_cancel_between_header_and_payload():
    # A cancel (an interpreter call cancelled, a server exchange superseded) that came while
    # readline waited for a frame's payload lost the header it had read: the next readline
    # took payload bytes for a header, and the kernel's replies came back garbled.
    from agentrl.sandboxes.docker import _DockerProcess

    def frame(data: bytes) -> bytes:
        return bytes([1, 0, 0, 0]) + len(data).to_bytes(4, "big") + data

    reader = asyncio.StreamReader()
    proc = _DockerProcess(types.SimpleNamespace(limits=TEST_LIMITS), reader, None, "m=1")
    first = frame(b'{"id": 1}\n')
    reader.feed_data(first[:8])
    task = asyncio.create_task(proc.readline())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    reader.feed_data(first[8:] + frame(b'{"id": 2}\n'))
    assert await proc.readline() == b'{"id": 1}\n'
    assert await proc.readline() == b'{"id": 2}\n'


async def test_snippet_that_crashes_with_a_background_child_alive_is_a_crash_not_a_timeout(interp):
    # The kernel learnt of a crash from its status pipe's EOF, which the child kept away: the
    # call waited out its whole timeout and was reported as timed out, its exit code lost.
    await interp.execute("kept = 1")
    crash = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\n    os._exit(0)\nos._exit(3)"
    r = await interp.execute(crash, timeout=10)
    assert (r.timed_out, r.exit_code) == (False, 3), r
    assert "crashed" in r.stderr
    assert (await interp.execute("kept", timeout=5)).stdout == "1\n"


async def test_snippet_that_leaves_its_process_group_is_still_killed_at_its_timeout(interp):
    # The timeout killed the snippet's process group only: a snippet that joined the
    # kernel's group outlived it, the kernel waited on it forever and the host dropped the
    # kernel after the grace, with every earlier snippet's state.
    await interp.execute("kept = 1")
    escape = "import os, time\nos.setpgid(0, os.getpgid(os.getppid()))\ntime.sleep(60)"
    r = await interp.execute(escape, timeout=2)
    assert r.timed_out, r
    assert (await interp.execute("kept", timeout=5)).stdout == "1\n"
