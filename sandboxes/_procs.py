"""Process plumbing shared by the host-process backends (local, bwrap).

- ``UidLease``: a private unprivileged uid per sandbox, claimed with an ``flock``
  so concurrent sandboxes (and concurrent test runs) never share one. A private
  uid makes ``RLIMIT_NPROC`` a per-sandbox pids limit and lets ``kill_uid`` end
  every process of the sandbox, even ones that called ``setsid()``.
- ``collect``: runs a started process to completion with bounded memory: stdout
  and stderr are kept up to a limit and the rest is read and dropped.
- ``PipeProcess``: a ``SandboxProcess`` over an asyncio subprocess.
- ``Cgroup``: a cgroup per sandbox (v1 memory+pids hierarchies, or v2), so memory
  and process count are capped for the sandbox as a whole, not per process.
- ``mount_tmpfs``: a size-capped tmpfs for a sandbox's writable directories.
- ``sweep_stale``: frees the cgroups and mounts of sandboxes whose process was
  killed before it could close them (their names carry its pid).

Host helpers (``sh`` entering the cgroup, ``prlimit``, ``setpriv``, ``bwrap``) run
with ``HOST_ENV`` only. The caller's environment is applied by ``env -i`` as the
last step before the sandboxed program, after privileges are dropped: a variable
such as ``LD_PRELOAD`` can never steer a helper that still runs as root.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from agentrl.errors import SandboxError

from .base import ExecResult, SandboxLimits, SandboxProcess

__all__ = [
    "HOST_ENV",
    "Cgroup",
    "PipeProcess",
    "UidLease",
    "cgroup_unavailable",
    "checked_env",
    "collect",
    "env_argv",
    "kill_marked",
    "kill_session",
    "kill_uid",
    "kill_uid_now",
    "mount_tmpfs",
    "pids_of_uid",
    "prlimit_argv",
    "sandbox_name",
    "scrubbed_env",
    "spawn",
    "sandbox_python",
    "sweep_stale",
    "unmount",
]

SETPRIV = "/usr/bin/setpriv"
PRLIMIT = "/usr/bin/prlimit"
ENV = "/usr/bin/env"
MOUNT, UMOUNT = "/usr/bin/mount", "/usr/bin/umount"
# All the environment the host helpers get (markers are added; the caller's env never is).
HOST_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
UID_BASE = 1_000_000  # far above any real account; inside no subuid range Debian hands out
UID_COUNT = 50_000
_LOCK_DIR = os.path.join(tempfile.gettempdir(), "agentrl-uids")
_MEMORY_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"bad_alloc", b"out of memory")


def sandbox_python() -> str:
    """The real python3 for sandboxes (the pyenv shim adds ~80 ms and lives under /root)."""
    for path in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(path):
            return path
    return "python3"


def scrubbed_env(home: str, tmpdir: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """A minimal environment: nothing of the parent leaks (tokens, proxies, HOME)."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": tmpdir,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.update(extra or {})
    return env


def checked_env(env: dict[str, str] | None) -> dict[str, str]:
    """The caller's variables, refused unless each is ``NAME=value`` that ``env`` can set.

    Any valid name may pass (``LD_PRELOAD`` too): it only reaches the sandboxed
    program, which could set it itself.
    """
    for name, value in (env or {}).items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise SandboxError(
                f"env: {name!r} is not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)"
            )
        if not isinstance(value, str) or "\0" in value:
            raise SandboxError(f"env: the value of {name} must be a string without NUL bytes")
    return dict(env or {})


def env_argv(env: dict[str, str]) -> list[str]:
    """``env -i`` setting exactly ``env`` for the program after it (run after the drop)."""
    return [ENV, "-i", "--", *(f"{name}={value}" for name, value in env.items())]


def prlimit_argv(limits: SandboxLimits, as_root_uid: bool) -> list[str]:
    """``prlimit`` options for one process tree; NPROC only counts for a non-root uid."""
    argv = [
        PRLIMIT,
        f"--cpu={limits.cpu_s}",
        f"--as={limits.memory_mb << 20}",
        f"--nofile={limits.nofile}",
        f"--fsize={limits.fsize_mb << 20}",
        "--core=0",
    ]
    if not as_root_uid:
        argv.append(f"--nproc={limits.pids}")
    return [*argv, "--"]


class UidLease:
    """Claim a free uid in [UID_BASE, UID_BASE + UID_COUNT) for one sandbox's lifetime."""

    def __init__(self) -> None:
        dfd = _open_lock_dir(_LOCK_DIR)
        try:
            for _ in range(200):
                uid = UID_BASE + random.randrange(UID_COUNT)
                flags = os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK
                fd = os.open(f"{uid}.lock", flags, 0o600, dir_fd=dfd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self.uid, self._fd = uid, fd
                return
        finally:
            os.close(dfd)
        raise SandboxError(f"no free sandbox uid in {_LOCK_DIR}; remove stale lock files there")

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing drops the flock
            self._fd = -1


# Host dirs every user may write: a sandbox's files there outlive it (local shares them).
SHARED_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")


def remove_files_of_uid(uid: int, roots: tuple[str, ...] = SHARED_WRITABLE) -> int:
    """Remove what ``uid`` left at the top of the host's shared writable dirs (files, dirs,
    links it owns), so the next sandbox that leases the uid, or the next episode of a
    reset one, cannot read it. Call it with the uid's processes killed. Returns how many
    entries went."""
    gone = 0
    for root in roots:
        try:
            entries = list(os.scandir(root))
        except OSError:  # no such dir here
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
                if st.st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                gone += 1
            except OSError:  # gone already, or not ours to remove
                continue
    return gone


def _open_lock_dir(path: str) -> int:
    """The lock dir, opened as a private dir of ours: it sits in the world-writable /tmp,
    where another user may have planted a symlink or a dir of their own by that name."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        raise SandboxError(f"uid lock dir {path} is not a plain directory ({e}); remove it") from e
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        raise SandboxError(
            f"uid lock dir {path} belongs to uid {st.st_uid} with mode {st.st_mode & 0o777:o}; "
            f"it must be uid {os.geteuid()}'s, mode 700: remove it"
        )
    return fd


def pids_of_uid(uid: int, zombies: bool = False) -> list[int]:
    """Pids whose real uid is ``uid`` (read from /proc, so it sees every namespace below us).

    Zombies are dead already; count them only when asked (they still hold RLIMIT_NPROC
    slots until their new parent reaps them).
    """
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                for line in f:
                    if not zombies and line.startswith(b"State:") and line.split()[1] in b"ZX":
                        break  # dead; only waits for its parent to reap it
                    if line.startswith(b"Uid:"):
                        if int(line.split()[1]) == uid:
                            found.append(int(name))
                        break
        except OSError:
            continue
    return found


async def kill_uid(uid: int, rounds: int = 20, wait_reaped: bool = False) -> bool:
    """SIGKILL every process of ``uid``; True when none is left.

    ``wait_reaped`` also waits (up to 5 s) until init has reaped most zombies (a fork
    bomb leaves many), whose RLIMIT_NPROC slots the uid needs back to keep running.

    ``kill(-1)`` sent *as that uid* reaches all of its processes in one kernel pass,
    so a fork bomb cannot outrun it the way a /proc scan-and-kill loop can.
    """
    for _ in range(rounds):
        if not pids_of_uid(uid):
            break
        proc = await asyncio.create_subprocess_exec(
            SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
            "/usr/bin/kill", "-KILL", "-1",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        await proc.wait()
        await asyncio.sleep(0.02)  # let the kernel finish tearing down
    alive = pids_of_uid(uid)
    for _ in range(250 if wait_reaped else 0):
        if alive or len(pids_of_uid(uid, zombies=True)) <= 8:  # a few zombies cost nothing
            break
        await asyncio.sleep(0.02)
    return not alive


def kill_uid_now(uid: int) -> bool:
    """``kill_uid`` for sync callers (finalizers): scan /proc and SIGKILL until none is left."""
    return _kill_until_gone(lambda: pids_of_uid(uid), rounds=50)


def pids_of_session(sid: int) -> list[int]:
    """Pids whose session id is ``sid`` (catches children that only changed process group)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 3 and int(fields[3]) == sid and fields[0] not in (b"Z", b"X"):
            found.append(int(name))
    return found


def _kill_until_gone(find: Callable[[], list[int]], rounds: int) -> bool:
    """SIGKILL whatever ``find`` lists, again until it lists nothing; True when none is left."""
    for _ in range(rounds):
        pids = find()
        if not pids:
            return True
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    return not find()


def kill_session(sid: int, rounds: int = 20) -> bool:
    """SIGKILL every process of session ``sid``; True when none is left."""
    return _kill_until_gone(lambda: pids_of_session(sid), rounds)


def pids_marked(marker: str) -> list[int]:
    """Pids whose environment holds the entry ``marker`` (``KEY=value``; survives setsid)."""
    needle = marker.encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue
    return found


def kill_marked(marker: str, rounds: int = 20) -> bool:
    """SIGKILL every process whose environment holds ``marker``; True when none is left."""
    return _kill_until_gone(lambda: pids_marked(marker), rounds)


@dataclass(slots=True)
class _Stream:
    data: bytearray
    truncated: bool = False


async def _drain(reader: asyncio.StreamReader | None, limit: int, out: _Stream) -> None:
    if reader is None:
        return
    while chunk := await reader.read(1 << 16):
        room = limit - len(out.data)
        if room > 0:
            out.data += chunk[:room]
        if len(chunk) > room:
            out.truncated = True  # keep reading so the writer never blocks; drop the rest


async def _feed(proc: asyncio.subprocess.Process, data: bytes | None) -> None:
    if proc.stdin is None:
        return
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        if data:
            proc.stdin.write(data)
            await proc.stdin.drain()
        proc.stdin.close()


def _exit_code(returncode: int | None) -> int:
    if returncode is None:
        return -1
    return 128 - returncode if returncode < 0 else returncode  # shell convention for signals


class _Protocol(asyncio.subprocess.SubprocessStreamProtocol):
    """Signals process exit at once; ``Process.wait()`` also waits for the pipes to close,
    which a background grandchild holding stdout can delay until the timeout."""

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self.exited = asyncio.Event()

    def process_exited(self) -> None:
        super().process_exited()
        self.exited.set()


async def spawn(argv: list[str], limit: int, **kwargs: object) -> asyncio.subprocess.Process:
    """``asyncio.create_subprocess_exec`` whose process has an ``exited`` event and a
    ``close_pipes()`` that closes our ends of its pipes."""
    loop = asyncio.get_running_loop()
    protocol = _Protocol(limit, loop)
    transport, _ = await loop.subprocess_exec(lambda: protocol, *argv, **kwargs)
    proc = asyncio.subprocess.Process(transport, protocol, loop)
    proc.exited = protocol.exited  # type: ignore[attr-defined]
    proc.close_pipes = transport.close  # type: ignore[attr-defined]
    return proc


async def _close_pipes(proc: asyncio.subprocess.Process) -> None:
    """Close our ends of ``proc``'s pipes now. A background child still holding their
    other ends keeps them open otherwise (two fds in this process per run, registered
    in the event loop) until that child exits, however long after the run it is."""
    close = getattr(proc, "close_pipes", None)
    if close is not None:
        close()  # the transport; it would kill the process too, were it still running
        await asyncio.sleep(0)  # the pipe transports close their fds on the next loop pass


async def _wait_or_kill(
    proc: asyncio.subprocess.Process, timeout: float, kill_tree: Callable[[], Awaitable[None]]
) -> bool:
    """Wait for ``proc`` to exit; past ``timeout`` kill its tree. True when it timed out."""
    exited = getattr(proc, "exited", None)
    waiter = asyncio.ensure_future(exited.wait() if exited else proc.wait())
    try:
        done, _ = await asyncio.wait([waiter], timeout=timeout)
    except asyncio.CancelledError:  # the caller gave up: the run and what it started die now
        waiter.cancel()
        await asyncio.shield(_kill_now(proc, kill_tree))
        raise
    if done:
        return False
    await _kill_now(proc, kill_tree)
    await asyncio.wait([waiter], timeout=10.0)
    return True


async def _kill_now(proc: asyncio.subprocess.Process, kill_tree: Callable[[], Awaitable[None]]) -> None:
    """The run's tree (its session and every process with its marker), then the run itself."""
    await kill_tree()
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


async def collect(
    proc: asyncio.subprocess.Process,
    stdin: bytes | None,
    timeout: float,
    limits: SandboxLimits,
    kill_tree: Callable[[], Awaitable[None]],
    started: float,
) -> ExecResult:
    """Feed stdin, read bounded output, enforce the timeout by killing the whole tree.

    When the main process exits but a background child still holds the pipes, we
    stop reading after a short grace instead of waiting for it.
    """
    out, err = _Stream(bytearray()), _Stream(bytearray())
    readers = [
        asyncio.ensure_future(_drain(proc.stdout, limits.output_bytes, out)),
        asyncio.ensure_future(_drain(proc.stderr, limits.output_bytes, err)),
    ]
    feeder = asyncio.ensure_future(_feed(proc, stdin))
    try:  # our pipe ends close however the run ends: done, timed out, or cancelled
        timed_out = await _wait_or_kill(proc, timeout, kill_tree)
        _, pending = await asyncio.wait([*readers, feeder], timeout=5.0 if timed_out else 1.0)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    finally:
        await _close_pipes(proc)
    for task in (*readers, feeder):
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise SandboxError(f"reading sandbox output failed: {task.exception()}")
    code = _exit_code(proc.returncode)
    tail = bytes(err.data[-4096:])
    oom = not timed_out and code != 0 and any(m in tail for m in _MEMORY_MARKERS)
    return ExecResult(
        stdout=out.data.decode("utf-8", "replace"),
        stderr=err.data.decode("utf-8", "replace"),
        exit_code=code,
        timed_out=timed_out,
        oom_killed=oom,
        truncated=out.truncated or err.truncated,
        duration_s=time.monotonic() - started,
    )


class PipeProcess(SandboxProcess):
    """A long-lived asyncio subprocess started with ``start_new_session=True``.

    ``kill`` ends its whole session (not only its process group), leaving other
    processes of the same sandbox alone.
    """

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc

    async def write(self, data: bytes) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(data)
            await self._proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as e:
            raise SandboxError(f"sandbox process stdin closed: {e}") from e

    async def readline(self) -> bytes:
        assert self._proc.stdout is not None
        try:
            return await self._proc.stdout.readline()
        except ValueError as e:  # line longer than the reader's limit
            raise SandboxError(f"sandbox process wrote an over-long line: {e}") from e

    async def kill(self) -> None:
        await asyncio.to_thread(kill_session, self._proc.pid)
        with contextlib.suppress(ProcessLookupError):
            self._proc.kill()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._proc.wait(), 10.0)
        await _close_pipes(self._proc)  # a child that left the session may hold them still


_CGROUP_FS = "/sys/fs/cgroup"
# Moves itself into each cgroup dir given before "--", then execs the rest (still root).
_ENTER_CGROUPS = (
    'while [ "$1" != -- ]; do echo 0 > "$1/cgroup.procs" || exit 125; shift; done; shift; exec "$@"'
)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _own_cgroup_dirs() -> tuple[list[str], int]:
    """Where our process sits: ([memory dir, pids dir], 1) or ([dir], 2); ([], 0) if neither."""
    v1: dict[str, str] = {}
    v2 = None
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(",") if names else ():
                v1[name] = os.path.join(_CGROUP_FS, names, path.lstrip("/"))
            if not names:
                v2 = os.path.join(_CGROUP_FS, path.lstrip("/"))
    if "memory" in v1 and "pids" in v1:
        return [v1["memory"], v1["pids"]], 1
    if v2 and os.path.exists(os.path.join(_CGROUP_FS, "cgroup.controllers")):
        return [v2], 2
    return [], 0


@dataclass(slots=True)
class Cgroup:
    """One cgroup per sandbox: memory and pids are capped for all its processes together.

    v1 (memory and pids hierarchies, as Docker hosts often mount them) or v2 (the
    parent must let us enable the memory and pids controllers). Nested under our
    own cgroup, so the trainer's limits still hold over it.
    """

    dirs: list[str]
    version: int

    @classmethod
    def create(cls, name: str, limits: SandboxLimits) -> Cgroup:
        """Make the cgroup and set its limits; OSError when this machine does not let us."""
        parents, version = _own_cgroup_dirs()
        if not parents:
            raise OSError("no memory and pids cgroup controllers are mounted")
        cg = cls([os.path.join(p, name) for p in parents], version)
        memory = str(limits.memory_mb << 20)
        try:
            if version == 2:
                _write(os.path.join(parents[0], "cgroup.subtree_control"), "+memory +pids")
            for d in cg.dirs:
                os.mkdir(d, 0o755)
            if version == 1:
                _write(os.path.join(cg.dirs[0], "memory.limit_in_bytes"), memory)
                swap = os.path.join(cg.dirs[0], "memory.memsw.limit_in_bytes")
                if os.path.exists(swap):  # only where swap is accounted
                    _write(swap, memory)
                _write(os.path.join(cg.dirs[1], "pids.max"), str(limits.pids))
            else:
                _write(os.path.join(cg.dirs[0], "memory.max"), memory)
                if os.path.exists(os.path.join(cg.dirs[0], "memory.swap.max")):
                    _write(os.path.join(cg.dirs[0], "memory.swap.max"), "0")
                _write(os.path.join(cg.dirs[0], "pids.max"), str(limits.pids))
        except OSError:
            cg.remove()
            raise
        return cg

    def enter_argv(self) -> list[str]:
        """A prefix that puts the command (and all it spawns) into this cgroup."""
        return ["/bin/sh", "-c", _ENTER_CGROUPS, "sh", *self.dirs, "--"]

    def pids(self) -> list[int]:
        found: set[int] = set()
        for d in self.dirs:
            with contextlib.suppress(OSError), open(os.path.join(d, "cgroup.procs")) as f:
                found.update(int(line) for line in f if line.strip())
        return sorted(found)

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer has ended in this cgroup so far."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        with contextlib.suppress(OSError), open(os.path.join(self.dirs[0], name)) as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        return 0

    def kill(self) -> bool:
        """SIGKILL every process in the cgroup; True when none is left."""
        return _kill_until_gone(self.pids, rounds=500)  # returns once empty; a loaded CPU delays exits

    def remove(self, timeout_s: float = 10.0) -> bool:
        """Remove the cgroup dirs (they must be empty of processes); True when all are gone.

        A killed task leaves its cgroup only once it has run its exit, which on a loaded CPU
        takes seconds (1 s of retries left cgroups behind beside two busy processes)."""
        deadline = time.monotonic() + timeout_s
        for d in self.dirs:
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.02)
        return not any(os.path.exists(d) for d in self.dirs)


@functools.lru_cache(maxsize=1)
def cgroup_unavailable() -> str | None:
    """None when sandboxes here get a cgroup each; otherwise why not (probed once)."""
    try:
        cg = Cgroup.create(sandbox_name("probe") + "0", SandboxLimits())
    except OSError as e:
        return f"no writable cgroup for the memory and pids controllers ({e.strerror or e})"
    cg.remove()
    return None


def mount_tmpfs(path: str, size_mb: int) -> None:
    """Mount a root-owned tmpfs of ``size_mb`` MiB on ``path`` (needs root); OSError if refused.

    Mode 0711: the sandbox may pass through to its own dirs inside, never rename them.
    """
    opts = f"size={size_mb}m,mode=0711,nosuid,nodev"
    cmd = [MOUNT, "-t", "tmpfs", "-o", opts, "agentrl-sandbox", path]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=HOST_ENV)
    except (OSError, subprocess.SubprocessError) as e:
        raise OSError(f"mount failed: {e}") from e
    if done.returncode != 0:
        raise OSError(f"mount failed: {done.stderr.strip()}")


def unmount(path: str) -> None:
    """Detach a tmpfs mounted by ``mount_tmpfs`` (lazily: a late process cannot block it)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run([UMOUNT, "--lazy", path], capture_output=True, timeout=30, env=HOST_ENV)


def sandbox_name(backend: str) -> str:
    """``agentrl-<backend>-<our pid>-``: names our cgroups and base dirs start with, so
    ``sweep_stale`` can tell those of a process that has exited."""
    return f"agentrl-{backend}-{os.getpid()}-"


def _maker_exited(name: str) -> bool:
    parts = name.split("-")
    return len(parts) == 4 and parts[2].isdigit() and not os.path.exists(f"/proc/{parts[2]}")


@functools.cache
def sweep_stale() -> None:
    """Once per process: free what sandboxes of exited processes (a killed trainer) left:
    their cgroups, with any process still in them, and their tmpfs mounts."""
    parents, version = _own_cgroup_dirs()
    for parent in parents:
        with contextlib.suppress(OSError):
            for name in os.listdir(parent):
                if name.startswith("agentrl-") and _maker_exited(name):
                    stale = Cgroup([os.path.join(parent, name)], version)
                    stale.kill()
                    stale.remove()
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        target, source = fields[4], fields[-2]
        if source == "agentrl-sandbox" and _maker_exited(os.path.basename(target)):
            unmount(target)
            shutil.rmtree(target, ignore_errors=True)
