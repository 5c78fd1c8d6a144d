"""Process plumbing shared by the host-process backends (local, bwrap).

- ``UidLease``: a private unprivileged uid per sandbox, claimed with an ``flock``
  so concurrent sandboxes (and concurrent test runs) never share one. A private
  uid makes ``RLIMIT_NPROC`` a per-sandbox pids limit and lets ``kill_uid`` end
  every process of the sandbox, even ones that called ``setsid()``.
- ``collect``: runs a started process to completion with bounded memory: stdout
  and stderr are kept up to a limit and the rest is read and dropped.
- ``PipeProcess``: a ``SandboxProcess`` over an asyncio subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import random
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from agentrl.errors import SandboxError

from .base import ExecResult, SandboxLimits, SandboxProcess

__all__ = [
    "PipeProcess",
    "UidLease",
    "collect",
    "kill_marked",
    "kill_session",
    "kill_uid",
    "pids_of_uid",
    "prlimit_argv",
    "scrubbed_env",
    "spawn",
    "sandbox_python",
]

SETPRIV = "/usr/bin/setpriv"
PRLIMIT = "/usr/bin/prlimit"
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
        os.makedirs(_LOCK_DIR, mode=0o700, exist_ok=True)
        for _ in range(200):
            uid = UID_BASE + random.randrange(UID_COUNT)
            fd = os.open(os.path.join(_LOCK_DIR, f"{uid}.lock"), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        raise SandboxError(f"no free sandbox uid in {_LOCK_DIR}; remove stale lock files there")

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing drops the flock
            self._fd = -1


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
    """``asyncio.create_subprocess_exec`` whose process has an ``exited`` event."""
    loop = asyncio.get_running_loop()
    protocol = _Protocol(limit, loop)
    transport, _ = await loop.subprocess_exec(lambda: protocol, *argv, **kwargs)
    proc = asyncio.subprocess.Process(transport, protocol, loop)
    proc.exited = protocol.exited  # type: ignore[attr-defined]
    return proc


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
    exited = getattr(proc, "exited", None)
    waiter = asyncio.ensure_future(exited.wait() if exited else proc.wait())
    timed_out = False
    done, _ = await asyncio.wait([waiter], timeout=timeout)
    if not done:
        timed_out = True
        await kill_tree()
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.wait([waiter], timeout=10.0)
    _, pending = await asyncio.wait([*readers, feeder], timeout=1.0 if not timed_out else 5.0)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
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
