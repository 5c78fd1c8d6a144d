"""Hardening of the host-process backends (local, bwrap): whole-sandbox limits, the
caller's env kept from host helpers, host file access that never blocks, the
uid-lock dir, and saying at runtime what this machine cannot enforce.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import time
import warnings

import pytest

import agentrl.sandboxes.base as base
import agentrl.sandboxes.local as local
from agentrl.errors import SandboxError, SandboxUnavailableError
from agentrl.sandboxes import BwrapSandbox, LocalSandbox, SandboxLimits, _procs, check_backend
from agentrl.sandboxes._files import untar_into
from agentrl.sandboxes.base import IsolationWarning

pytestmark = pytest.mark.anyio

HOST_BACKENDS = ["local", "bwrap"]
LIMITS = SandboxLimits(memory_mb=256, pids=64, workdir_mb=16)


@pytest.fixture(params=HOST_BACKENDS)
def host_backend(request: pytest.FixtureRequest) -> str:
    """A host backend, skipped with the reason where it cannot run (no bubblewrap here)."""
    try:
        check_backend(request.param)
    except SandboxUnavailableError as e:
        pytest.skip(f"backend {request.param!r} unavailable here: {e}")
    return request.param


def _needs_cgroup(sandbox: LocalSandbox) -> None:
    if sandbox.cgroup is None:
        reason = f"{sandbox.NAME}: no cgroup here ({_procs.cgroup_unavailable()})"
        print(f"SKIPPED: {reason}")
        pytest.skip(reason)


def _needs_root(name: str) -> None:
    if os.geteuid() != 0:
        print(f"SKIPPED: {name}: the tmpfs workdir needs root")
        pytest.skip(f"{name}: the tmpfs workdir needs root")


# -- 1. whole-sandbox limits ------------------------------------------------------

# 20 children each hold 40 MiB (well under the 256 MiB per-process RLIMIT_AS), 800 MiB
# together. The parent exits 1 when any child was killed.
MANY_PROCESS_BOMB = """
import os, sys, time
kids = []
for _ in range(20):
    pid = os.fork()
    if pid == 0:
        try:
            held = bytearray(b"x") * (40 << 20)
        except MemoryError:
            os._exit(3)
        time.sleep(4)
        os._exit(0)
    kids.append(pid)
codes = [os.waitpid(pid, 0)[1] for pid in kids]
killed = sum(os.WIFSIGNALED(c) for c in codes)
held = sum(os.WIFEXITED(c) and os.WEXITSTATUS(c) == 0 for c in codes)
print("HELD", held, "KILLED", killed)
sys.exit(1 if killed else 0)
"""


def _peak_bytes(sandbox: LocalSandbox) -> int:
    cg = sandbox.cgroup
    assert cg is not None
    name = "memory.max_usage_in_bytes" if cg.version == 1 else "memory.peak"
    with open(os.path.join(cg.dirs[0], name)) as f:
        return int(f.read())


async def test_many_processes_together_cannot_exceed_the_sandbox_memory(builder, host_backend):
    async with builder(host_backend, LIMITS) as b:
        _needs_cgroup(b.inner)
        r = await b.sandbox.run_python(MANY_PROCESS_BOMB, timeout=120)
        peak = _peak_bytes(b.inner)
        print(f"MEASURED {host_backend}: {r.stdout.strip()}, cgroup peak {peak >> 20} MiB")
        assert "KILLED 0" not in r.stdout, r
        assert r.oom_killed, r
        assert peak <= LIMITS.memory_mb << 20
        await b.sandbox.reset()
        assert (await b.sandbox.run("echo alive")).stdout == "alive\n"


async def test_sandbox_process_count_is_capped_by_its_cgroup(builder, host_backend):
    async with builder(host_backend, LIMITS) as b:
        _needs_cgroup(b.inner)
        with open(os.path.join(b.inner.cgroup.dirs[-1], "pids.max")) as f:
            assert int(f.read()) == LIMITS.pids


async def test_disk_fill_stops_at_workdir_mb(builder, host_backend):
    _needs_root(host_backend)
    fill = "for i in $(seq 40); do head -c 1048576 /dev/zero > f$i || exit 7; done"
    async with builder(host_backend, LIMITS) as b:
        r = await b.sandbox.run(fill, timeout=60)
        used = sum(e.stat().st_size for e in os.scandir(b.inner.workdir))
        print(f"MEASURED {host_backend}: disk fill stopped at {used >> 20} MiB")
        assert r.exit_code == 7, r
        assert "No space left" in r.stderr
        assert used <= LIMITS.workdir_mb << 20
        await b.sandbox.reset()
        assert (await b.sandbox.run("echo 1 > f && cat f")).stdout == "1\n"


async def test_bwrap_tmp_and_dev_are_capped(builder):
    _needs_root("bwrap")
    async with builder("bwrap", LIMITS) as b:
        r = await b.sandbox.run("head -c 40000000 /dev/zero > /tmp/big", timeout=60)
        assert r.exit_code != 0 and "No space left" in r.stderr, r
        r = await b.sandbox.run("head -c 40000000 /dev/zero > /dev/shm/big", timeout=60)
        assert r.exit_code != 0 and "No space left" in r.stderr, r
        r = await b.sandbox.run("touch /dev/planted", timeout=60)
        assert r.exit_code != 0 and "Read-only" in r.stderr, r


async def test_missing_cgroup_is_said_at_start_and_in_describe(monkeypatch):
    monkeypatch.setattr(base, "_warned", set())
    monkeypatch.setattr(local, "cgroup_unavailable", lambda: "no cgroup (test)")
    assert "memory is capped per process only" in LocalSandbox.describe()
    assert "NOT here" in BwrapSandbox.describe()
    with pytest.warns(IsolationWarning, match="per process only"):
        async with LocalSandbox(limits=LIMITS) as sb:
            assert sb.cgroup is None
            assert (await sb.run("echo ok")).stdout == "ok\n"


def test_seccomp_state_is_reported(monkeypatch):
    import agentrl.sandboxes.bwrap as bw

    monkeypatch.setattr(bw, "seccomp_available", lambda: False)
    assert "no seccomp filter" in bw.BwrapSandbox.describe()
    monkeypatch.setattr(bw, "seccomp_available", lambda: True)
    assert "seccomp" not in " ".join(bw.BwrapSandbox.shortfalls())


# -- 2. the caller's env reaches only the sandboxed program -----------------------

PRELOAD_ERROR = "cannot be preloaded"


async def test_caller_env_never_reaches_host_helpers(builder, host_backend):
    # ld.so complains once per program that starts with this LD_PRELOAD: before the fix
    # prlimit, setpriv (and bwrap) complained as well as the sandboxed printenv.
    async with builder(host_backend, LIMITS) as b:
        r = await b.sandbox.run(
            ["/usr/bin/printenv", "LD_PRELOAD"], env={"LD_PRELOAD": "/nonexistent-agentrl.so"}
        )
        assert r.stdout == "/nonexistent-agentrl.so\n", r
        assert r.stderr.count(PRELOAD_ERROR) == 1, r.stderr


async def test_open_process_gets_the_caller_env(builder, host_backend):
    async with builder(host_backend, LIMITS) as b:
        proc = await b.sandbox.open_process(
            ["/bin/sh", "-c", 'echo "$GREETING"; read x'], env={"GREETING": "hello"}
        )
        try:
            assert await asyncio.wait_for(proc.readline(), 30) == b"hello\n"
        finally:
            await proc.kill()


@pytest.mark.parametrize("env", [{"BAD-NAME": "x"}, {"": "x"}, {"A": "nul\0byte"}, {"1A": "x"}])
async def test_invalid_env_is_refused(builder, host_backend, env):
    async with builder(host_backend, LIMITS) as b:
        with pytest.raises(SandboxError, match="env"):
            await b.sandbox.run(["true"], env=env)
        with pytest.raises(SandboxError, match="env"):
            await b.sandbox.open_process(["true"], env=env)


# -- 3. host-side file access never blocks ----------------------------------------


async def _bounded(coro, unblock_path: str):
    """Await ``coro`` for 10 s; on a hang, open the FIFO's other end so the thread ends."""
    try:
        return await asyncio.wait_for(coro, 10)
    except TimeoutError:
        fd = os.open(unblock_path, os.O_RDWR | os.O_NONBLOCK)
        os.close(fd)
        pytest.fail("a host-side file operation blocked on a FIFO planted by the sandbox")


@pytest.mark.timeout(60)
async def test_planted_fifo_and_links_are_refused_without_blocking(builder, host_backend):
    async with builder(host_backend, LIMITS) as b:
        r = await b.sandbox.run("mkfifo pipe && ln -s pipe pipe-link && ln -s /dev/zero zero")
        assert r.exit_code == 0, r
        fifo = os.path.join(b.inner.workdir, "pipe")
        for name in ("pipe", "pipe-link", "zero"):
            with pytest.raises(SandboxError):
                await _bounded(b.sandbox.write_file(name, "x"), fifo)
            with pytest.raises(SandboxError):
                await _bounded(b.sandbox.read_file(name), fifo)
        assert os.path.exists(fifo)


@pytest.mark.timeout(60)
async def test_fifo_with_a_reader_is_refused_as_not_regular(builder, host_backend):
    async with builder(host_backend, LIMITS) as b:
        reader = await b.sandbox.open_process(
            ["/bin/sh", "-c", "mkfifo rpipe && exec 3<>rpipe && echo ready && cat <&3 >/dev/null"]
        )
        try:
            assert await asyncio.wait_for(reader.readline(), 30) == b"ready\n"
            fifo = os.path.join(b.inner.workdir, "rpipe")
            with pytest.raises(SandboxError, match="not a regular file"):
                await _bounded(b.sandbox.write_file("rpipe", "x"), fifo)
        finally:
            await reader.kill()


# -- 4. local without root says it gives no isolation -----------------------------

NON_ROOT_SCRIPT = """
import asyncio, warnings
from agentrl.sandboxes import LocalSandbox, make_sandbox
from agentrl.sandboxes.base import IsolationWarning

async def main():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with LocalSandbox() as sb:
            r = await sb.run("id -u")
        auto = make_sandbox("auto")
    print("UID", r.stdout.strip(), sb.uid)
    print("AUTO", auto.NAME)
    for w in caught:
        if issubclass(w.category, IsolationWarning):
            print("WARNING", w.message)

asyncio.run(main())
"""
UNPRIVILEGED_UID = 61999


def _as_unprivileged(code: str) -> subprocess.CompletedProcess:
    drop = [_procs.SETPRIV, f"--reuid={UNPRIVILEGED_UID}", f"--regid={UNPRIVILEGED_UID}"]
    return subprocess.run(
        [*drop, "--clear-groups", "--", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")
def test_local_as_non_root_warns_that_it_gives_no_isolation():
    if _as_unprivileged("import agentrl.sandboxes").returncode != 0:
        reason = f"uid {UNPRIVILEGED_UID} cannot import agentrl from {sys.executable}"
        print(f"SKIPPED: {reason}")
        pytest.skip(reason)
    done = _as_unprivileged(NON_ROOT_SCRIPT)
    out = done.stdout
    assert done.returncode == 0, done.stderr
    assert f"UID {UNPRIVILEGED_UID} {UNPRIVILEGED_UID}" in out
    assert "not root: model code runs as your own uid" in out
    assert "memory is capped per process only" in out
    assert "uncapped" in out
    assert "AUTO bwrap" in out or "picked 'local'" in out


def test_warn_once_warns_once(monkeypatch):
    monkeypatch.setattr(base, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        base.warn_once("x")
        base.warn_once("x")
    assert [w.category for w in caught] == [IsolationWarning]


# -- 5. the uid-lock dir ----------------------------------------------------------


def test_uid_lock_dir_refuses_a_planted_symlink(monkeypatch, tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    (tmp_path / "uids").symlink_to(real)
    monkeypatch.setattr(_procs, "_LOCK_DIR", str(tmp_path / "uids"))
    with pytest.raises(SandboxError, match="not a plain directory"):
        _procs.UidLease()
    assert list(real.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_uid_lock_dir_refuses_a_foreign_owner(monkeypatch, tmp_path):
    planted = tmp_path / "uids"
    planted.mkdir(mode=0o700)
    os.chown(planted, 12345, 12345)
    monkeypatch.setattr(_procs, "_LOCK_DIR", str(planted))
    with pytest.raises(SandboxError, match="belongs to uid 12345"):
        _procs.UidLease()


def test_uid_lock_dir_refuses_a_loose_mode_and_makes_a_private_one(monkeypatch, tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    monkeypatch.setattr(_procs, "_LOCK_DIR", str(loose))
    with pytest.raises(SandboxError, match="mode 777"):
        _procs.UidLease()
    fresh = tmp_path / "fresh"
    monkeypatch.setattr(_procs, "_LOCK_DIR", str(fresh))
    lease = _procs.UidLease()
    try:
        st = fresh.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (os.geteuid(), 0o700)
    finally:
        lease.release()


async def test_snapshot_leaves_out_fifos_and_keeps_symlinks_as_links(builder, host_backend):
    async with builder(host_backend, LIMITS) as b:
        script = "mkfifo pipe && mkdir d && echo v1 > d/f && ln -s /etc/hostname host-link"
        assert (await b.sandbox.run(script)).exit_code == 0
        snap = await asyncio.wait_for(b.sandbox.snapshot(), 30)
        await b.sandbox.write_file("d/f", "v2")
        await b.sandbox.restore(snap)  # before: the FIFO made the "data" filter refuse it
        assert await b.sandbox.read_file("d/f") == b"v1\n"
        r = await b.sandbox.run("ls -A; readlink host-link")
        assert r.stdout == "d\nhost-link\n/etc/hostname\n", r


def test_cgroup_v2_branch_writes_its_limits(monkeypatch, tmp_path):
    parent = tmp_path / "parent"
    parent.mkdir()
    monkeypatch.setattr(_procs, "_own_cgroup_dirs", lambda: ([str(parent)], 2))
    cg = _procs.Cgroup.create("agentrl-x", LIMITS)
    assert (parent / "cgroup.subtree_control").read_text() == "+memory +pids"
    assert (parent / "agentrl-x" / "memory.max").read_text() == str(256 << 20)
    assert (parent / "agentrl-x" / "pids.max").read_text() == "64"
    assert cg.enter_argv()[-2:] == [str(parent / "agentrl-x"), "--"]


def _tar(*members: tuple[str, bytes, str]) -> bytes:
    """An archive of (name, tar type, data or link target) members."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind == tarfile.REGTYPE:
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload.encode()))
            else:
                info.linkname = payload
                tar.addfile(info)
    return buf.getvalue()


@pytest.mark.parametrize(
    "members",
    [
        [("../escape", tarfile.REGTYPE, "x")],
        [("link", tarfile.SYMTYPE, "{outside}"), ("link/pwned", tarfile.REGTYPE, "x")],
    ],
    ids=["dotdot", "through-symlink"],
)
def test_restore_refuses_to_write_outside(tmp_path, members):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    data = _tar(*((name, kind, p.format(outside=outside)) for name, kind, p in members))
    with pytest.raises(SandboxError):
        untar_into(str(root), data, None)
    assert list(outside.iterdir()) == []
    assert not (tmp_path / "escape").exists()


def test_restore_writes_nothing_at_or_beneath_a_symlink_the_archive_made(tmp_path):
    """tar_dir never stores such members; tarfile's own check resolves with realpath, which
    symlink chains past PATH_MAX get through on Python < 3.11.13 (CVE-2025-4517). A check
    of each component with lstat does not depend on it: links inside root show it."""
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    untar_into(str(root), _tar(("link", tarfile.SYMTYPE, "sub"), ("link/f", tarfile.REGTYPE, "through"),
                               ("same", tarfile.SYMTYPE, "sub/g"), ("same", tarfile.REGTYPE, "at"),
                               ("plain", tarfile.REGTYPE, "kept"), ("py", tarfile.SYMTYPE, "/usr/bin/python3")),
               None)
    assert sorted(p.name for p in (root / "sub").iterdir()) == []  # nothing went through either link
    assert (root / "plain").read_text() == "kept" and os.readlink(root / "py") == "/usr/bin/python3"
    assert os.readlink(root / "link") == "sub" and os.readlink(root / "same") == "sub/g"


def test_a_host_side_write_refuses_a_file_with_another_hard_link(tmp_path):
    """Sandboxed code can hard-link a host file into its workdir where that is on the host's
    filesystem; the write (as root) then filled that file and gave it to the sandbox's user."""
    from agentrl.sandboxes._files import write_beneath

    root, host_file = tmp_path / "root", tmp_path / "host-owned"
    root.mkdir()
    host_file.write_text("host data")
    os.link(host_file, root / "linked")
    with pytest.raises(SandboxError, match="another hard link"):
        write_beneath(str(root), "linked", b"model data", owner=(65534, 65534))
    st = host_file.stat()
    assert host_file.read_text() == "host data" and st.st_uid == os.geteuid()
    write_beneath(str(root), "fresh", b"ok", owner=None)  # a file of its own is written as before
    write_beneath(str(root), "fresh", b"again", owner=None)
    assert (root / "fresh").read_bytes() == b"again"


def test_restore_leaves_out_hard_links(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s")
    (tmp_path / "root").mkdir()
    untar_into(str(tmp_path / "root"), _tar(("h", tarfile.LNKTYPE, str(secret))), None)
    assert list((tmp_path / "root").iterdir()) == []


async def test_a_sandbox_never_closed_frees_its_host_resources_when_collected(host_backend):
    import gc

    box = (LocalSandbox if host_backend == "local" else BwrapSandbox)(limits=LIMITS)
    await box.start()
    base = os.path.dirname(box.workdir)
    cgroup_dirs = box.cgroup.dirs if box.cgroup else []
    del box

    def left() -> list[str]:
        return [p for p in (base, *cgroup_dirs) if os.path.exists(p)]

    # An executor thread may hold the last reference a moment longer, and the finalizer removes
    # the workdir before the cgroup (a loaded CPU stretches both): wait for everything it frees.
    deadline = time.monotonic() + 30
    while left() and time.monotonic() < deadline:
        gc.collect()
        await asyncio.sleep(0.02)
    assert not os.path.exists(base)
    assert not any(os.path.exists(d) for d in cgroup_dirs)
    with open("/proc/self/mountinfo") as f:
        assert f" {base} " not in f.read()


KILLED_TRAINER_SCRIPT = """
import asyncio, os, signal
from agentrl.sandboxes import {cls}

async def main():
    box = {cls}()
    await box.start()
    await box.run("sleep 300 > /dev/null 2>&1 &")
    print(os.path.dirname(box.workdir), *(box.cgroup.dirs if box.cgroup else []), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close, no finalizer: a trainer killed outright

asyncio.run(main())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="tmpfs mounts and cgroups need root here")
async def test_leftovers_of_a_killed_trainer_are_swept(host_backend):
    cls = "LocalSandbox" if host_backend == "local" else "BwrapSandbox"
    done = subprocess.run(
        [sys.executable, "-c", KILLED_TRAINER_SCRIPT.format(cls=cls)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    base, *cgroup_dirs = done.stdout.split()
    assert os.path.exists(base)  # left behind by the killed process
    _procs.sweep_stale.__wrapped__()
    assert not os.path.exists(base)
    assert not any(os.path.exists(d) for d in cgroup_dirs)
    with open("/proc/self/mountinfo") as f:
        assert f" {base} " not in f.read()


async def test_files_the_sandbox_uid_leaves_in_shared_tmp_dirs_go_at_reset_and_close(builder):
    """local shares the host's /tmp, /var/tmp and /dev/shm, and a pooled sandbox keeps its uid
    across episodes (a released uid is leased again): what one episode left there, the next
    could read (an answer, a cached result). They go at reset and at close now."""
    if os.geteuid() != 0:
        print("SKIPPED: needs root (the sandbox runs as a leased uid only as root)")
        pytest.skip("needs root: the sandbox runs as a leased uid only as root")
    tag = f"agentrl-leftover-{os.getpid()}"
    leave = (f"echo answer > /tmp/{tag} && mkdir /dev/shm/{tag} && echo a > /dev/shm/{tag}/f "
             f"&& ln -s /etc/hostname /var/tmp/{tag}")
    paths = [f"/tmp/{tag}", f"/dev/shm/{tag}", f"/var/tmp/{tag}"]
    host_own = f"/tmp/{tag}-host"
    with open(host_own, "w") as f:  # not the sandbox's: kept
        f.write("host")
    try:
        async with builder("local", LIMITS) as b:
            assert (await b.sandbox.run(leave)).exit_code == 0
            assert all(os.path.lexists(p) for p in paths)
            await b.sandbox.reset()
            assert not any(os.path.lexists(p) for p in paths)
            assert (await b.sandbox.run(f"cat /tmp/{tag}")).exit_code != 0
            assert (await b.sandbox.run(leave)).exit_code == 0
        assert not any(os.path.lexists(p) for p in paths)  # closed
        assert open(host_own).read() == "host"
    finally:
        os.unlink(host_own)
        for p in paths:
            with contextlib.suppress(OSError):
                shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)


# -- 6. the trainer's own file descriptors ---------------------------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(120)
async def test_runs_that_leave_a_background_child_holding_the_pipes_leak_no_fds(
    builder, host_backend
):
    # The child keeps the write ends of stdout and stderr; the run returns after its
    # grace, but the transport stayed open with both read ends registered in the loop,
    # 2 fds per run in the trainer until the child exited (200 for 100 such runs).
    async with builder(host_backend, LIMITS) as b:
        await b.sandbox.run("true")  # the sandbox's own fds are open before we count
        before = _open_fds()
        results = await asyncio.gather(*(b.sandbox.run("sleep 60 & echo up") for _ in range(20)))
        assert all(r.stdout == "up\n" and r.exit_code == 0 for r in results), results
        assert _open_fds() - before < 2, os.listdir("/proc/self/fd")


@pytest.mark.timeout(120)
async def test_a_closed_interpreter_whose_snippet_left_a_setsid_child_leaks_no_fds(
    builder, host_backend
):
    # The child left the kernel's session, so killing the session spared it, and it
    # holds the protocol pipes: the closed kernel's stdin and stdout stayed open here.
    from agentrl.sandboxes import PythonInterpreter

    escape = "import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(60)\nprint('x')"
    async with builder(host_backend, LIMITS) as b:
        await b.sandbox.run("true")
        before = _open_fds()
        for _ in range(3):
            interp = PythonInterpreter(b.sandbox)
            assert (await interp.execute(escape, timeout=10)).stdout == "x\n"
            await interp.close()
        assert _open_fds() - before < 2, os.listdir("/proc/self/fd")
