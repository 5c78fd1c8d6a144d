"""``local``: a plain subprocess with rlimits — isolation ``none``.

What it does:
- Each command runs through ``prlimit`` (CPU, address space, open files, file
  size, processes) and, when we are root, ``setpriv`` to a private unprivileged
  uid claimed for this sandbox (``UidLease``). RLIMIT_NPROC is ignored for root,
  and a private uid makes it a per-sandbox process limit. No ``preexec_fn``.
- A private workdir (mode 0700, owned by the sandbox uid) and a scrubbed env.
- A timeout kills the run's session and every process carrying the run's marker
  in its environment (that catches grandchildren that called ``setsid()``).
  ``reset``/``close`` kill every process of the sandbox uid.
- stdout/stderr are truncated to ``limits.output_bytes`` with bounded memory.
- ``oom_killed`` is set when the process died of an allocation failure under
  RLIMIT_AS (MemoryError and friends in stderr); there is no cgroup here.

What it does not do: the filesystem and the network are visible (the child can
read world-readable files and write world-writable dirs such as /tmp). Use
``bwrap`` or ``docker`` for untrusted code.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
import time

from agentrl.errors import SandboxDeadError, SandboxError

from ._files import read_beneath, tar_dir, untar_into, write_beneath
from ._procs import (
    SETPRIV,
    PipeProcess,
    UidLease,
    collect,
    kill_marked,
    kill_session,
    kill_uid,
    prlimit_argv,
    sandbox_python,
    scrubbed_env,
    spawn,
)
from .base import ExecResult, Isolation, Sandbox, SandboxLimits, SandboxProcess

__all__ = ["LocalSandbox"]


def _as_bytes(data: str | bytes | None) -> bytes | None:
    return data.encode() if isinstance(data, str) else data


class LocalSandbox(Sandbox):
    """Run commands as host subprocesses under rlimits (see the module docstring)."""

    ISOLATION: Isolation = "none"
    NAME = "local"

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        root_dir: str | None = None,
        drop_privileges: bool | None = None,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.python = sandbox_python()
        self._root_dir = root_dir
        self._drop = os.geteuid() == 0 if drop_privileges is None else drop_privileges
        self._lease: UidLease | None = None
        self.workdir: str | None = None
        self._closed = False
        self._marker = f"AGENTRL_SANDBOX={secrets.token_hex(8)}"
        self._start_lock = asyncio.Lock()

    @property
    def uid(self) -> int:
        """The uid sandboxed processes run as."""
        return self._lease.uid if self._lease else os.getuid()

    async def start(self) -> None:
        async with self._start_lock:
            if self._closed:
                raise SandboxDeadError("this sandbox was closed; create a new one")
            if self.workdir is not None:
                return
            if self._drop:
                if os.geteuid() != 0:
                    raise SandboxError("drop_privileges=True needs root (it switches uid)")
                self._lease = UidLease()
                await kill_uid(self._lease.uid)  # leftovers of a crashed earlier owner
            self.workdir = await asyncio.to_thread(self._make_dirs)

    def _make_dirs(self) -> str:
        """Create the private workdir, owned by the sandbox uid."""
        workdir = tempfile.mkdtemp(prefix=f"agentrl-{self.NAME}-", dir=self._root_dir)
        if self._lease:
            os.chown(workdir, self._lease.uid, self._lease.uid)
        return workdir

    # Hooks for backends that wrap the same process handling (bwrap).
    workdir_alias: str | None = None  # the workdir's path as sandboxed code sees it

    def _inner_paths(self, workdir: str) -> tuple[str, str]:
        """(HOME, TMPDIR) as the sandboxed process sees them."""
        return workdir, workdir

    def _wipe_dirs(self, workdir: str) -> None:
        _empty_dir(workdir)

    def _remove_dirs(self, workdir: str) -> None:
        shutil.rmtree(workdir, ignore_errors=True)

    def _wrap(self, argv: list[str], pass_fds: list[int]) -> list[str]:
        """The full command line; fds appended to ``pass_fds`` are inherited, then closed."""
        prefix = prlimit_argv(self.limits, as_root_uid=not self._drop and os.geteuid() == 0)
        if self._lease:
            uid = str(self._lease.uid)
            prefix += [
                SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                "--no-new-privs", "--bounding-set=-all", "--",
            ]  # fmt: skip
        return prefix + argv

    async def _live_workdir(self) -> str:
        await self.start()
        assert self.workdir is not None
        if not os.path.isdir(self.workdir):
            raise SandboxDeadError(
                f"sandbox workdir {self.workdir} was removed from outside; create a new sandbox"
            )
        return self.workdir

    async def _spawn(
        self, argv: list[str], env: dict[str, str] | None, marker: str, with_stdin: bool
    ) -> asyncio.subprocess.Process:
        workdir = await self._live_workdir()
        pipe = asyncio.subprocess.PIPE
        fds: list[int] = []
        try:
            return await spawn(
                self._wrap(argv, fds),
                16 * self.limits.output_bytes + (1 << 20),
                stdin=pipe if with_stdin else asyncio.subprocess.DEVNULL,
                stdout=pipe,
                stderr=pipe,
                cwd=workdir,
                env=scrubbed_env(
                    *self._inner_paths(workdir),
                    {**(env or {}), **_env_entries(self._marker, marker)},
                ),
                start_new_session=True,
                pass_fds=tuple(fds),
            )
        except OSError as e:
            raise SandboxError(f"cannot start {argv[0]!r} in the {self.NAME} sandbox: {e}") from e
        finally:
            for fd in fds:
                os.close(fd)

    async def run(
        self,
        command: str | list[str],
        stdin: str | bytes | None = None,
        timeout: float = 30.0,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        data = _as_bytes(stdin)
        marker = f"AGENTRL_RUN={secrets.token_hex(8)}"
        started = time.monotonic()
        proc = await self._spawn(argv, env, marker, with_stdin=data is not None)

        async def kill_tree() -> None:
            await asyncio.to_thread(kill_session, proc.pid)
            await asyncio.to_thread(kill_marked, marker)

        return await collect(proc, data, timeout, self.limits, kill_tree, started)

    async def open_process(
        self, argv: list[str], env: dict[str, str] | None = None
    ) -> SandboxProcess:
        proc = await self._spawn(argv, env, f"AGENTRL_RUN={secrets.token_hex(8)}", True)
        assert proc.stderr is not None
        proc.stderr.feed_eof()  # never read; the pipe end closes with the process
        return PipeProcess(proc)

    async def write_file(self, path: str, data: str | bytes) -> None:
        workdir = await self._live_workdir()
        owner = (self._lease.uid, self._lease.uid) if self._lease else None
        alias = self.workdir_alias or workdir
        payload = _as_bytes(data) or b""
        await asyncio.to_thread(write_beneath, workdir, path, payload, owner, alias)

    async def read_file(self, path: str) -> bytes:
        workdir = await self._live_workdir()
        limit = self.limits.fsize_mb << 20
        alias = self.workdir_alias or workdir
        return await asyncio.to_thread(read_beneath, workdir, path, limit, alias)

    async def _kill_all(self, wait_reaped: bool = False) -> None:
        if self._lease:
            if not await kill_uid(self._lease.uid, wait_reaped=wait_reaped):
                raise SandboxError(f"processes of sandbox uid {self._lease.uid} survived SIGKILL")
        elif not await asyncio.to_thread(kill_marked, self._marker):
            raise SandboxError("processes of the sandbox survived SIGKILL")

    async def reset(self) -> None:
        workdir = await self._live_workdir()
        await self._kill_all(wait_reaped=True)  # the uid runs on: it needs its NPROC slots
        await asyncio.to_thread(self._wipe_dirs, workdir)

    async def snapshot(self) -> bytes:
        """The workdir as a tar archive (files only: running processes are not captured)."""
        return await asyncio.to_thread(tar_dir, await self._live_workdir())

    async def restore(self, snapshot: bytes) -> None:
        """Reset, then put back the workdir saved by ``snapshot``."""
        await self.reset()
        owner = (self._lease.uid, self._lease.uid) if self._lease else None
        await asyncio.to_thread(untar_into, await self._live_workdir(), snapshot, owner)

    async def close(self) -> None:
        async with self._start_lock:
            if self._closed:
                return
            self._closed = True
            try:
                await self._kill_all()
            finally:
                if self.workdir:
                    await asyncio.to_thread(self._remove_dirs, self.workdir)
                if self._lease:
                    self._lease.release()


def _env_entries(*markers: str) -> dict[str, str]:
    return dict(m.split("=", 1) for m in markers)


def _empty_dir(path: str) -> None:
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            os.unlink(full)
