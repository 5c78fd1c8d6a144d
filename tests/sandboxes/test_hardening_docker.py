"""Docker backend hardening: bounded reads, files that are not regular, partial
snapshots, timeouts that kill one run only, and resets that leave nothing behind.

Each test skips with the reason printed where no docker engine and image are here.
"""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from agentrl.errors import SandboxError
from agentrl.sandboxes import PythonInterpreter, SandboxLimits

from .conftest import TEST_LIMITS

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["host-kill", "in-container-kill"])
async def box(request, builder):
    """A docker sandbox; ``in-container-kill`` acts as if dockerd's pids were out of reach
    (rootless or remote docker, gVisor), so timeouts are handled from inside."""
    async with builder("docker", TEST_LIMITS) as b:
        b.sandbox._host_pids = request.param == "host-kill"
        yield b.sandbox


async def test_timeout_kills_only_that_run(box):
    async with PythonInterpreter(box) as it:
        await it.execute("kept = 41")
        slow = asyncio.create_task(box.run("sleep 4; echo survived", timeout=60))
        await asyncio.sleep(0.5)
        r = await box.run("sleep 1000 & sleep 1000; echo never", timeout=1.5)
        assert r.timed_out
        done = await slow
        assert done.ok and done.stdout == "survived\n", done
        assert (await it.execute("kept + 1")).stdout == "42\n"
    left = await box.run("cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
    assert "sleep infinity" in left.stdout  # the listing works: it shows the idle init
    assert "sleep 1000" not in left.stdout


async def test_timeout_kills_children_that_left_the_session(box):
    escape = "python3 -c 'import os,time; os.setsid(); time.sleep(1000)' & sleep 1000"
    assert (await box.run(escape, timeout=1.5)).timed_out
    await asyncio.sleep(0.3)
    left = await box.run("cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
    assert "sleep infinity" in left.stdout
    assert "time.sleep(1000)" not in left.stdout and "sleep 1000" not in left.stdout


async def test_interpreter_kill_leaves_other_runs_alive(box):
    slow = asyncio.create_task(box.run("sleep 3; echo survived", timeout=60))
    await asyncio.sleep(0.5)
    it = PythonInterpreter(box)
    await it.execute("x = 1")
    await it.close()
    assert (await slow).stdout == "survived\n"


async def test_overlong_interpreter_line_is_refused(builder):
    limits = SandboxLimits(memory_mb=256, pids=64, output_bytes=4096)
    async with builder("docker", limits) as b:
        code = (
            "import sys,time; sys.stdout.write('x' * (4 << 20)); sys.stdout.flush(); time.sleep(60)"
        )
        proc = await b.sandbox.open_process(["python3", "-c", code])
        try:
            with pytest.raises(SandboxError, match="over-long line"):
                await asyncio.wait_for(proc.readline(), 30)
        finally:
            await proc.kill()


async def test_exec_sockets_close_when_their_run_ends(builder):
    # docker-py's file object over each exec's socket kept the descriptor open after close()
    # until the collector freed it; dockerd kept streaming into it, and removal waited 20 s.
    async with builder("docker", TEST_LIMITS) as b:
        box, sockets = b.sandbox, []
        exec_socket = box._exec_socket

        def spy(*args, **kwargs):
            exec_id, raw = exec_socket(*args, **kwargs)
            sockets.append(raw)
            return exec_id, raw

        box._exec_socket = spy
        gc.disable()  # else a collection may close what the code left open
        try:
            r = await box.run("yes | head -c 10000000; sleep 30", timeout=1)
            assert r.timed_out and r.stdout.startswith("y\n")
            proc = await box.open_process(["sh", "-c", "yes; sleep 30"])
            assert await proc.readline() == b"y\n"
            await proc.kill()
            await asyncio.sleep(0.1)  # the transport closes its socket on a later loop pass
            assert len(sockets) == 2 and [s.fileno() for s in sockets] == [-1, -1]
        finally:
            gc.enable()


@pytest.mark.parametrize("plant", ["mkfifo f", "ln -s /etc/passwd f", "mkdir f"])
async def test_file_ops_refuse_what_is_not_a_regular_file(box, plant):
    assert (await box.run(plant)).ok
    started = time.monotonic()
    with pytest.raises(SandboxError, match="not a regular file"):
        await box.read_file("f")
    with pytest.raises(SandboxError, match="not a regular file"):
        await box.write_file("f", "data")
    assert time.monotonic() - started < 10
    if plant.startswith("ln"):
        assert (await box.run("head -c 4 /etc/passwd")).stdout == "root"


async def test_slow_read_is_an_error_not_a_short_file(box, monkeypatch):
    import agentrl.sandboxes.docker as docker_mod

    monkeypatch.setattr(docker_mod, "_FILE_OP_S", 1.0)
    monkeypatch.setattr(docker_mod, "_READ", "sleep 5; echo late")
    with pytest.raises(SandboxError, match="timed out"):
        await box.read_file("any.txt")


async def test_a_read_over_max_bytes_stops_at_the_limit_not_at_the_end_of_the_file(box, monkeypatch):
    """A 4 MiB file read with ``max_bytes=1000`` is refused after about 1000 bytes came over the
    socket: streaming the whole file first costs time and daemon bandwidth for nothing."""
    import agentrl.sandboxes.docker as docker_mod

    assert (await box.run("head -c 4194304 /dev/zero > big.bin")).ok
    recv = []
    real_recv = docker_mod.socket.socket.recv  # what docker sent, not what we kept of it

    def counting_recv(self, n, *a):
        chunk = real_recv(self, n, *a)
        recv.append(len(chunk))
        return chunk

    monkeypatch.setattr(docker_mod.socket.socket, "recv", counting_recv)
    with pytest.raises(SandboxError, match="larger than 1000 bytes"):
        await box.read_file("big.bin", max_bytes=1000)
    assert sum(recv) < 64 << 10, sum(recv)
    monkeypatch.undo()
    assert await box.read_file("big.bin", max_bytes=4194304) == bytes(4194304)


async def test_snapshot_refuses_a_truncated_archive(builder):
    async with builder("docker", SandboxLimits(memory_mb=256, pids=64, workdir_mb=1)) as b:
        # A sparse file takes no room in /work, but tar writes all of it: 40 MiB of
        # archive is over the snapshot cap of workdir_mb + 16 MiB.
        assert (await b.sandbox.run("truncate -s 40M sparse.bin")).ok
        with pytest.raises(SandboxError, match="more than"):
            await b.sandbox.snapshot()


async def test_restore_of_a_partial_archive_keeps_the_workdir(box):
    await box.write_file("keep.txt", "old")
    await box.write_file("big.bin", b"z" * 200_000)
    snap = await box.snapshot()
    with pytest.raises(SandboxError, match="not a complete tar"):
        await box.restore(snap[:100_000])
    cut_in_a_member = snap[:10_240] + b"\0" * 1024  # ends in zero blocks, but tar sees EOF
    with pytest.raises(SandboxError, match="restore"):
        await box.restore(cut_in_a_member)
    assert await box.read_file("keep.txt") == b"old"
    assert len(await box.read_file("big.bin")) == 200_000


async def test_restore_replaces_the_workdir_with_every_name(box):
    await box.run("mkdir -p d && echo 1 > d/a && echo 2 > ..x && echo 3 > .h && chmod 500 d")
    snap = await box.snapshot()
    await box.run("chmod 700 d && rm -rf d ..x && echo later > new.txt")
    await box.restore(snap)
    assert (await box.run("ls -A | sort")).stdout == "..x\n.h\nd\n"
    assert await box.read_file("d/a") == b"1\n"
    assert (await box.run("ls -A /tmp")).stdout == ""


async def test_reset_leaves_no_state_behind(box):
    plant = (
        "echo a > ..x && echo b > .h && mkdir -p d/e && echo c > d/e/f && chmod 500 d/e d && "
        "echo s > /dev/shm/state && echo t > /tmp/..y && ipcmk -M 4096 >/dev/null && "
        "python3 -c \"open('/dev/mqueue/q', 'w')\""
    )
    assert (await box.run(plant)).ok
    listing = "ls -A /work /tmp /dev/shm /dev/mqueue | grep -v '^/\\|^$'; ipcs -m | grep -c 0x"
    before = await box.run(listing)
    assert sorted(before.stdout.split()) == ["..x", "..y", ".h", "1", "d", "q", "state"], before
    await box.reset()
    after = await box.run(listing)
    assert after.stdout == "0\n", after


async def test_stdin_to_a_process_that_never_reads_it_still_times_out(box):
    started = time.monotonic()
    r = await box.run("sleep 1000", stdin=b"x" * (8 << 20), timeout=2)
    assert r.timed_out
    assert time.monotonic() - started < 15
