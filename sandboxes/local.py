"""``local``: a plain subprocess with rlimits — isolation ``none``.

What it does:
- Each command runs through ``prlimit`` (CPU, address space, open files, file
  size, processes) and, when we are root, ``setpriv`` to a private unprivileged
  uid claimed for this sandbox (``UidLease``). RLIMIT_NPROC is ignored for root,
  and a private uid makes it a per-sandbox process limit. No ``preexec_fn``.
- Where a cgroup can be made (v1 memory+pids, or v2), the sandbox's processes
  together are capped at ``limits.memory_mb`` and ``limits.pids``; without one,
  memory is only capped per process (RLIMIT_AS), so N processes may use N times
  as much. The kernel's OOM kills in the cgroup set ``oom_killed``; without a
  cgroup it is guessed from allocation errors in stderr.
- As root, the workdir lives on a private tmpfs of ``limits.workdir_mb``; not as
  root it sits on host disk, uncapped.
- A scrubbed env. The caller's ``env`` is checked and applied by ``env -i``
  after the uid drop: host helpers running as root never see it.
- A timeout kills the run's session and every process carrying the run's marker
  in its environment (that catches grandchildren that called ``setsid()``).
  ``reset``/``close`` kill every process of the sandbox uid and cgroup.
- stdout/stderr are truncated to ``limits.output_bytes`` with bounded memory.

What it does not do: the filesystem and the network are visible (the child can
read world-readable files and write world-writable dirs such as /tmp, uncapped).
What the sandbox's uid leaves at the top of /tmp, /var/tmp and /dev/shm is
removed at reset and close, and when a uid is leased, so the next episode does
not find it; files it writes deeper, into other users' world-writable dirs, stay.
Not as root it runs model code as your own uid: no isolation at all, and
cleanup relies on an environment marker that the code can remove. Whatever of
this the machine lacks is said once at start with an ``IsolationWarning``
(``describe()`` lists it too). Use ``bwrap`` or ``docker`` for untrusted code.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass

from agentrl.errors import SandboxDeadError, SandboxError

from ._files import read_beneath, read_limit, tar_dir, untar_into, write_beneath
from ._procs import (
    HOST_ENV,
    SETPRIV,
    Cgroup,
    PipeProcess,
    UidLease,
    cgroup_unavailable,
    checked_env,
    collect,
    env_argv,
    kill_marked,
    kill_session,
    kill_uid,
    kill_uid_now,
    mount_tmpfs,
    prlimit_argv,
    remove_files_of_uid,
    sandbox_name,
    sandbox_python,
    scrubbed_env,
    spawn,
    sweep_stale,
    unmount,
)
from .base import ExecResult, Isolation, Sandbox, SandboxLimits, SandboxProcess, warn_once

__all__ = ["LocalSandbox"]


def _as_bytes(data: str | bytes | None) -> bytes | None:
    return data.encode() if isinstance(data, str) else data


class LocalSandbox(Sandbox):
    """Run commands as host subprocesses under rlimits (see the module docstring)."""

    ISOLATION: Isolation = "none"
    NAME = "local"
    ENFORCES = (
        "private uid, rlimits per process, memory and pids per sandbox (cgroup), "
        "workdir on a capped tmpfs; host files and network visible"
    )

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
        # What we hold on the host; freed by close, or at GC or exit if never closed.
        self._held = _Held()
        self._free = weakref.finalize(self, self._held.free)
        self.workdir: str | None = None
        self._closed = False
        self._marker = f"AGENTRL_SANDBOX={secrets.token_hex(8)}"
        self._start_lock = asyncio.Lock()

    @property
    def uid(self) -> int:
        """The uid sandboxed processes run as."""
        return self._held.lease.uid if self._held.lease else os.getuid()

    def _owner(self) -> tuple[int, int] | None:
        """(uid, gid) that host-side writes hand files to: the private uid, when dropping."""
        lease = self._held.lease
        return (lease.uid, lease.uid) if lease else None

    @property
    def cgroup(self) -> Cgroup | None:
        """The cgroup capping the whole sandbox, or None where this machine gives none."""
        return self._held.cgroup

    @classmethod
    def shortfalls(cls) -> list[str]:
        """What of ``ENFORCES`` this machine cannot give (empty when it all holds)."""
        gaps = host_shortfalls()
        if os.geteuid() != 0:
            gaps.insert(
                0,
                "not root: model code runs as your own uid, with no isolation from your files "
                "and processes, and may escape cleanup; use bwrap",
            )
        return gaps

    @classmethod
    def describe(cls) -> str:
        gaps = cls.shortfalls()
        missing = f"; NOT here: {'; '.join(gaps)}" if gaps else ""
        return f"isolation {cls.ISOLATION}: {cls.ENFORCES}{missing}"

    async def start(self) -> None:
        async with self._start_lock:
            if self._closed:
                raise SandboxDeadError("this sandbox was closed; create a new one")
            if self.workdir is not None:
                return
            for gap in self.shortfalls():
                warn_once(f"{self.NAME} sandbox: {gap}")
            if self._drop:
                if os.geteuid() != 0:
                    raise SandboxError("drop_privileges=True needs root (it switches uid)")
                self._held.lease = UidLease()
                await kill_uid(self._held.lease.uid)  # leftovers of a crashed earlier owner
                await asyncio.to_thread(remove_files_of_uid, self._held.lease.uid)
            elif os.geteuid() == 0:
                warn_once(f"{self.NAME} sandbox: drop_privileges=False runs model code as root")
            await asyncio.to_thread(sweep_stale)  # leftovers of killed trainers, once
            if cgroup_unavailable() is None:
                self._held.cgroup = await asyncio.to_thread(self._make_cgroup)
            self.workdir = await asyncio.to_thread(self._make_dirs)

    def _make_cgroup(self) -> Cgroup:
        try:
            return Cgroup.create(sandbox_name(self.NAME) + secrets.token_hex(6), self.limits)
        except OSError as e:
            raise SandboxError(f"cannot create the {self.NAME} sandbox's cgroup: {e}") from e

    def _make_dirs(self) -> str:
        """A private base dir (a tmpfs of ``workdir_mb`` as root) holding ``work``, the workdir."""
        prefix = sandbox_name(self.NAME)
        base = self._held.base = tempfile.mkdtemp(prefix=prefix, dir=self._root_dir)
        if os.geteuid() == 0:
            try:
                mount_tmpfs(base, self.limits.workdir_mb)
                self._held.tmpfs = True
            except OSError as e:
                warn_once(f"{self.NAME} sandbox: the workdir is on host disk, uncapped: {e}")
        os.chmod(base, 0o711)  # the sandbox uid passes through to its dirs, cannot rename them
        for sub in self._writable_dirs():
            os.mkdir(os.path.join(base, sub), 0o700)
            if owner := self._owner():
                os.chown(os.path.join(base, sub), *owner)
        return os.path.join(base, "work")

    # Hooks for backends that wrap the same process handling (bwrap).
    workdir_alias: str | None = None  # the workdir's path as sandboxed code sees it

    def _writable_dirs(self) -> tuple[str, ...]:
        """The dirs made under the base dir, all on its tmpfs; ``work`` is the workdir."""
        return ("work",)

    def _inner_paths(self, workdir: str) -> tuple[str, str]:
        """(HOME, TMPDIR) as the sandboxed process sees them."""
        return workdir, workdir

    def _wipe_dirs(self, workdir: str) -> None:
        base = os.path.dirname(workdir)
        for sub in self._writable_dirs():
            _empty_dir(os.path.join(base, sub))

    def _host_prefix(self) -> list[str]:
        """The host helpers in front of the sandboxed part: cgroup, rlimits, uid drop."""
        cmd = self._held.cgroup.enter_argv() if self._held.cgroup else []
        cmd += prlimit_argv(self.limits, as_root_uid=self._held.lease is None and os.geteuid() == 0)
        if self._held.lease:
            uid = str(self._held.lease.uid)
            cmd += [
                SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                "--no-new-privs", "--bounding-set=-all", "--",
            ]  # fmt: skip
        return cmd

    def _wrap(self, argv: list[str], env: dict[str, str], pass_fds: list[int]) -> list[str]:
        """The full command line; fds appended to ``pass_fds`` are inherited, then closed.

        ``env`` is the sandboxed program's whole environment, set after the uid drop.
        """
        return [*self._host_prefix(), *env_argv(env), *argv]

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
        markers = _env_entries(self._marker, marker)
        inner_env = scrubbed_env(*self._inner_paths(workdir), {**checked_env(env), **markers})
        pipe = asyncio.subprocess.PIPE
        fds: list[int] = []
        try:
            return await spawn(
                self._wrap(argv, inner_env, fds),
                16 * self.limits.output_bytes + (1 << 20),
                stdin=pipe if with_stdin else asyncio.subprocess.DEVNULL,
                stdout=pipe,
                stderr=pipe,
                cwd=workdir,
                env={**HOST_ENV, **markers},  # the helpers' env; the marker finds them too
                start_new_session=True,
                pass_fds=tuple(fds),
            )
        except (OSError, ValueError) as e:  # ValueError: a NUL byte in an argument
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
        if not argv:
            raise SandboxError("run: the command is empty; give a shell string or an argv list")
        if any("\0" in arg for arg in argv):  # no exec can carry it: a failed run, as in docker
            stderr = f"{argv[0][:100]}: cannot run a command line holding a NUL byte\n"
            return ExecResult(stderr=stderr, exit_code=126)
        data = _as_bytes(stdin)
        marker = f"AGENTRL_RUN={secrets.token_hex(8)}"
        started = time.monotonic()
        ooms = self._held.cgroup.oom_kills() if self._held.cgroup else 0
        proc = await self._spawn(argv, env, marker, with_stdin=data is not None)

        async def kill_tree() -> None:
            await asyncio.to_thread(kill_session, proc.pid)
            await asyncio.to_thread(kill_marked, marker)

        result = await collect(proc, data, timeout, self.limits, kill_tree, started)
        if self._held.cgroup and result.exit_code != 0 and not result.timed_out:
            result.oom_killed |= self._held.cgroup.oom_kills() > ooms
        return result

    async def open_process(
        self, argv: list[str], env: dict[str, str] | None = None
    ) -> SandboxProcess:
        proc = await self._spawn(argv, env, f"AGENTRL_RUN={secrets.token_hex(8)}", True)
        assert proc.stderr is not None
        proc.stderr.feed_eof()  # never read; the pipe end closes with the process
        return PipeProcess(proc)

    async def write_file(self, path: str, data: str | bytes) -> None:
        workdir = await self._live_workdir()
        owner = self._owner()
        alias = self.workdir_alias or workdir
        payload = _as_bytes(data) or b""
        await asyncio.to_thread(write_beneath, workdir, path, payload, owner, alias)

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        limit = read_limit(self.limits.fsize_mb, max_bytes)
        workdir = await self._live_workdir()
        alias = self.workdir_alias or workdir
        return await asyncio.to_thread(read_beneath, workdir, path, limit, alias)

    async def _kill_all(self, wait_reaped: bool = False) -> None:
        if self._held.cgroup and not await asyncio.to_thread(self._held.cgroup.kill):
            raise SandboxError(f"processes in cgroup {self._held.cgroup.dirs[0]} survived SIGKILL")
        if self._held.lease:
            if not await kill_uid(self._held.lease.uid, wait_reaped=wait_reaped):
                raise SandboxError(
                    f"processes of sandbox uid {self._held.lease.uid} survived SIGKILL"
                )
        elif not await asyncio.to_thread(kill_marked, self._marker):
            raise SandboxError("processes of the sandbox survived SIGKILL")

    async def reset(self) -> None:
        workdir = await self._live_workdir()
        await self._kill_all(wait_reaped=True)  # the uid runs on: it needs its NPROC slots
        await asyncio.to_thread(self._wipe_dirs, workdir)
        if self._held.lease:  # the next episode must not find this one's files in /tmp
            await asyncio.to_thread(remove_files_of_uid, self._held.lease.uid)

    async def snapshot(self) -> bytes:
        """The workdir as a tar archive (files only: running processes are not captured).

        Refused over ``workdir_mb`` + 16 MiB, as docker's is.
        """
        limit = (self.limits.workdir_mb + 16) << 20
        return await asyncio.to_thread(tar_dir, await self._live_workdir(), limit)

    async def restore(self, snapshot: bytes) -> None:
        """Reset, then put back the workdir saved by ``snapshot``."""
        await self.reset()
        owner = self._owner()
        await asyncio.to_thread(untar_into, await self._live_workdir(), snapshot, owner)

    async def close(self) -> None:
        async with self._start_lock:
            if self._closed:
                return
            self._closed = True
            try:
                await self._kill_all()
            finally:
                await asyncio.to_thread(self._free)


@dataclass(slots=True)
class _Held:
    """What a sandbox holds on the host. ``free`` runs once: at close, or when a sandbox
    that was never closed is collected or the interpreter exits."""

    lease: UidLease | None = None
    cgroup: Cgroup | None = None
    base: str | None = None  # holds the workdir
    tmpfs: bool = False  # base is our tmpfs mount

    def free(self) -> None:
        if self.cgroup:
            self.cgroup.kill()
        if self.lease:
            kill_uid_now(self.lease.uid)
            remove_files_of_uid(self.lease.uid)
        if self.base:
            if self.tmpfs:
                unmount(self.base)
            shutil.rmtree(self.base, ignore_errors=True)
        if self.cgroup:
            self.cgroup.remove()
        if self.lease:
            self.lease.release()


def host_shortfalls() -> list[str]:
    """The whole-sandbox limits this machine cannot give host-process backends."""
    gaps = []
    if reason := cgroup_unavailable():
        gaps.append(f"memory is capped per process only, pids per uid: {reason}")
    if os.geteuid() != 0:
        gaps.append("the writable dirs are on host disk, uncapped (mounting a tmpfs needs root)")
    return gaps


def _env_entries(*markers: str) -> dict[str, str]:
    return dict(m.split("=", 1) for m in markers)


def _empty_dir(path: str) -> None:
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            os.unlink(full)
