"""``docker``: a warm container per sandbox, commands run by ``exec`` — isolation ``container``.

The container: ``--network none``, memory (= memory+swap), cpu and pids limits,
a read-only root fs with size-capped tmpfs ``/work`` and ``/tmp``, ``--cap-drop
ALL``, ``no-new-privileges``, user 65534, and an init (tini) that reaps orphans.
It idles on ``sleep infinity``; every ``run`` is a ``docker exec``.

Timeouts: the exec carries a marker in its environment; when dockerd runs on
this host (we see its processes in /proc) every marked process is killed from
the host. Else a small killer is exec'd inside: it kills, as the sandbox user,
the marked processes, the sessions they lead (docker starts every exec in its
own session) and their descendants, and nothing else, so the persistent
interpreter and concurrent runs live on. ``reset`` kills every process but
init and empties /work, /tmp, /dev/shm, /dev/mqueue and SysV IPC.
``oom_killed`` comes from the container's memory cgroup ``oom_kill`` counter
where readable, else from exit code 137 without a timeout.

Files: ``read_file``/``write_file`` run ``dd`` with ``nofollow,nonblock`` as the
sandbox user and refuse symlinks, FIFOs and devices; ``snapshot`` and
``restore`` fail loudly on a timeout, an unknown exit or a truncated archive,
and ``restore`` unpacks into a staging dir before it replaces /work. Every wait
on an exec is bounded.

A sandbox never closed removes its container when it is collected or the
interpreter exits; the containers of a killed process are removed by the next
sandbox started in the same pid namespace (their labels name the owner).

The default image is built offline: ``build_image()`` (``agentrl sandbox
build-image``) runs ``debootstrap --variant=minbase --include=python3`` and
``docker import``s the rootfs; nothing is pulled from a registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import select
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import weakref
from dataclasses import dataclass
from typing import Any

from agentrl.errors import SandboxDeadError, SandboxError, SandboxUnavailableError

from ._files import read_limit, relative_parts, too_large
from ._procs import kill_marked
from .base import ExecResult, Isolation, Sandbox, SandboxLimits, SandboxProcess

__all__ = [
    "DEFAULT_IMAGE",
    "DockerSandbox",
    "GvisorSandbox",
    "build_image",
    "docker_client",
    "docker_host",
]

DEFAULT_IMAGE = "agentrl-sandbox:bookworm"
USER = "65534:65534"  # every exec runs as nobody
PRIVATE_SOCKET = "/run/agentrl-docker.sock"  # the private dockerd of .ci/sandbox-setup.sh
_MEMORY_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"bad_alloc", b"out of memory")
_FILE_OP_S = 60.0  # a file operation still running after this is killed and reported
_STAGE = "/tmp/.agentrl-restore"  # restore unpacks here before it replaces /work
_SCRATCH = ("/tmp", "/dev/shm", "/dev/mqueue")  # writable besides /work; reset empties them

# Refuse a symlink, FIFO or device (a FIFO would block the call); dd's nofollow,nonblock
# also covers a swap made between the test and the open.
_NOT_REGULAR = (
    '{ [ -L "$1" ] || { [ -e "$1" ] && [ ! -f "$1" ]; }; } && '
    '{ echo "${1#/work/} is not a regular file" >&2; exit 3; }; '
)
# At most $2 bytes: a read over its limit must not stream the rest of a huge file.
_READ = _NOT_REGULAR + 'exec dd if="$1" iflag=nofollow,nonblock,count_bytes count="$2" bs=64K status=none'
_WRITE = (
    _NOT_REGULAR + 'mkdir -p -- "$(dirname -- "$1")" && '
    'exec dd of="$1" oflag=nofollow,nonblock bs=64K status=none'
)

# Exec'd as the sandbox user with a run's marker when we cannot kill from the host:
# kills the marked processes, the sessions they lead (each docker exec starts its own)
# and their descendants, until none is left. Nothing else, so other runs live on.
_KILL_TREE = r"""
import os, sys, time
marker = sys.argv[1].encode()
def targets():
    parent, sid, marked = {}, {}, set()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if fields[0] in (b"Z", b"X"):
                continue
            pid = int(name)
            parent[pid], sid[pid] = int(fields[1]), int(fields[3])
            with open("/proc/%s/environ" % name, "rb") as f:
                if marker in f.read().split(b"\0"):
                    marked.add(pid)
        except (OSError, IndexError, ValueError):
            continue
    hit = marked | {p for p in sid if sid[p] in marked}
    while True:
        more = {p for p in parent if parent[p] in hit} - hit
        if not more:
            return hit
        hit |= more
for _ in range(50):
    pids = targets()
    if not pids:
        sys.exit(0)
    for pid in pids:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    time.sleep(0.01)
sys.exit(1)
"""


def _wipe_script(dirs: tuple[str, ...]) -> str:
    """Shell that empties ``dirs`` (every name, ``..x`` too) and fails naming leftovers."""
    listed = " ".join(dirs)
    globs = " ".join(f"{d}/* {d}/.[!.]* {d}/..?*" for d in dirs)
    return (
        f"chmod -R u+rwX {listed} 2>/dev/null; rm -rf {globs} 2>/dev/null; "
        f"left=$(find {listed} -mindepth 1 2>/dev/null | head -n 3); "
        '[ -z "$left" ] || { echo "left behind:" $left >&2; exit 1; }'
    )


def _tar_complete(data: bytes) -> bool:
    """A tar archive ends with zero blocks; one cut off at a member boundary does not."""
    return len(data) >= 1024 and len(data) % 512 == 0 and not data[-1024:].strip(b"\0")


def docker_host() -> str | None:
    """Where the engine is: $AGENTRL_DOCKER_HOST, $DOCKER_HOST, our private socket, or default."""
    for var in ("AGENTRL_DOCKER_HOST", "DOCKER_HOST"):
        if os.environ.get(var):
            return os.environ[var]
    if os.path.exists(PRIVATE_SOCKET):
        return f"unix://{PRIVATE_SOCKET}"
    return None


def docker_client(base_url: str | None = None) -> Any:
    """A ``docker.DockerClient`` that answered a ping; SandboxUnavailableError says why not."""
    try:
        import docker
    except ImportError as e:
        raise SandboxUnavailableError(
            "the docker backend needs the docker SDK: `pip install 'agentrl[docker]'`"
        ) from e
    url = base_url or docker_host()
    try:
        client = docker.DockerClient(base_url=url, timeout=120) if url else docker.from_env()
        client.ping()
    except docker.errors.DockerException as e:
        raise SandboxUnavailableError(
            f"no docker engine answers at {url or 'the default socket'}: {e}. Start one "
            "(`.ci/sandbox-setup.sh` starts a private dockerd) or set DOCKER_HOST"
        ) from e
    return client


def _owner_labels() -> dict[str, str]:
    """Who started a container: our pid, and the pid namespace (on this boot) it means
    something in, so ``_sweep_stale`` never judges a pid of another host or container."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    pidns = os.readlink("/proc/self/ns/pid")
    return {"agentrl.owner_pid": str(os.getpid()), "agentrl.owner_pidns": f"{boot}/{pidns}"}


_swept: set[str] = set()  # engines swept by this process


def _sweep_stale(client: Any) -> None:
    """Once per process and engine: remove the containers of sandboxes whose owner (a
    killed trainer, in our pid namespace) exited without closing them."""
    url = str(client.api.base_url)
    if url in _swept:
        return
    _swept.add(url)
    ns = _owner_labels()["agentrl.owner_pidns"]
    wanted = {"label": ["agentrl.sandbox=1", f"agentrl.owner_pidns={ns}"]}
    with contextlib.suppress(Exception):  # a sweep that fails leaves what it found
        for c in client.containers.list(all=True, filters=wanted):
            pid = c.labels.get("agentrl.owner_pid", "")
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                c.remove(force=True)


def _remove(container: Any, client: Any) -> None:
    """Remove a sandbox's container: at close, or when a sandbox never closed is
    collected or the interpreter exits. Already gone is fine."""
    with contextlib.suppress(Exception):
        container.remove(force=True)
    with contextlib.suppress(Exception):
        client.close()


def _map_error(what: str, e: Exception) -> SandboxError:
    text = str(e)
    gone = ("is not running", "No such container", "is paused", "No such exec instance")
    if any(g in text for g in gone):
        return SandboxDeadError(f"the container died ({what}): {text}; create a new sandbox")
    return SandboxError(f"docker failed to {what}: {text}")


class DockerSandbox(Sandbox):
    """One long-lived locked-down container; see the module docstring."""

    ISOLATION: Isolation = "container"
    NAME = "docker"
    workdir_alias = "/work"

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        image: str = DEFAULT_IMAGE,
        cpus: float = 1.0,
        base_url: str | None = None,
        runtime: str | None = None,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.image, self.cpus, self.runtime = image, cpus, runtime
        self.python = "/usr/bin/python3"
        self._base_url = base_url
        self._client: Any = None
        self.container: Any = None
        self._closed = False
        self._host_pids = False  # can we see (and kill) the container's processes from here?
        self._lock = asyncio.Lock()
        self._free: weakref.finalize | None = None  # removes the container, once

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        async with self._lock:
            if self._closed:
                raise SandboxDeadError("this sandbox was closed; create a new one")
            if self.container is None:
                await asyncio.to_thread(self._start_blocking)

    def _start_blocking(self) -> None:
        import docker

        self._client = docker_client(self._base_url)
        _sweep_stale(self._client)
        lim = self.limits
        tmpfs_opts = "uid=65534,gid=65534,mode=0755,exec"
        kwargs: dict[str, Any] = dict(
            command=["sleep", "infinity"],
            detach=True,
            init=True,
            network_mode="none",
            mem_limit=f"{lim.memory_mb}m",
            memswap_limit=f"{lim.memory_mb}m",
            pids_limit=lim.pids,
            nano_cpus=int(self.cpus * 1e9),
            read_only=True,
            tmpfs={
                "/work": f"size={lim.workdir_mb}m,{tmpfs_opts}",
                "/tmp": f"size={lim.workdir_mb}m,{tmpfs_opts}",
            },
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            user="0:0",  # only init and `sleep` (no capabilities); every exec runs as USER
            working_dir="/work",
            environment={"HOME": "/work", "TMPDIR": "/tmp", "LANG": "C.UTF-8"},
            ulimits=[
                docker.types.Ulimit(name="nofile", soft=lim.nofile, hard=lim.nofile),
                docker.types.Ulimit(name="fsize", soft=lim.fsize_mb << 20, hard=lim.fsize_mb << 20),
                docker.types.Ulimit(name="core", soft=0, hard=0),
            ],
            labels={"agentrl.sandbox": "1", **_owner_labels()},
        )
        if self.runtime:
            kwargs["runtime"] = self.runtime
        try:
            self.container = self._client.containers.run(self.image, **kwargs)
            self._free = weakref.finalize(self, _remove, self.container, self._client)
            self.container.reload()
        except docker.errors.ImageNotFound as e:
            raise SandboxUnavailableError(
                f"docker image {self.image!r} is missing; build it with `agentrl sandbox "
                "build-image` (debootstrap + docker import, about a minute)"
            ) from e
        except docker.errors.DockerException as e:
            raise _map_error("start the container", e) from e
        pid = self.container.attrs.get("State", {}).get("Pid", 0)
        self._host_pids = (
            bool(pid) and os.path.exists(f"/proc/{pid}") and os.geteuid() == 0 and not self.runtime
        )

    async def close(self) -> None:
        async with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._free is not None:
                await asyncio.to_thread(self._free)

    async def reset(self) -> None:
        """Kill every sandboxed process; empty /work, /tmp, /dev/shm, /dev/mqueue and IPC."""
        await self._ensure()
        await self._kill_all_and_wipe(("/work", *_SCRATCH))

    async def _kill_all_and_wipe(self, dirs: tuple[str, ...]) -> None:
        # kill(-1) as the sandbox user reaches every sandboxed process (the idle init and
        # `sleep` run as capability-less root, out of reach); a few passes catch forks.
        script = (
            "for i in 1 2 3; do kill -9 -1 2>/dev/null; done; ipcrm --all 2>/dev/null; "
            + _wipe_script(dirs)
        )
        for _ in range(5):  # right after a fork bomb the pids limit may still be exhausted
            r = await self.run(["/bin/sh", "-c", script], timeout=60)
            if r.ok:
                return
            await asyncio.sleep(0.2)
        raise SandboxError(f"reset failed: {r.stderr.strip() or r.exit_code}")

    # -- exec --------------------------------------------------------------------------
    async def _ensure(self) -> None:
        await self.start()

    def _exec_socket(self, argv: list[str], stdin: bool, env: dict[str, str]) -> tuple[str, Any]:
        api = self._client.api
        try:
            ex = api.exec_create(
                self.container.id, argv, stdin=stdin, environment=env, workdir="/work", user=USER
            )
            sock = api.exec_start(ex["Id"], socket=True)
        except Exception as e:  # docker.errors.* and requests errors alike
            raise _map_error("exec", e) from e
        if not hasattr(sock, "_sock"):
            return ex["Id"], sock
        # docker-py hands over a file object (SocketIO) made from the socket, and the socket's
        # close() keeps the descriptor open while that object lives: until the collector found
        # its cycle, dockerd kept streaming into it, and removing the container waited 20 s.
        raw = sock._sock
        sock.close()  # the file object only; the socket stays ours to read and close
        return ex["Id"], raw

    def _oom_count(self) -> int:
        cid = self.container.id
        for path in (
            f"/sys/fs/cgroup/memory/docker/{cid}/memory.oom_control",
            f"/sys/fs/cgroup/docker/{cid}/memory.events",
            f"/sys/fs/cgroup/system.slice/docker-{cid}.scope/memory.events",
        ):
            with contextlib.suppress(OSError, ValueError):
                with open(path) as f:
                    for line in f:
                        if line.startswith("oom_kill "):
                            return int(line.split()[1])
        return -1

    def _run_blocking(
        self,
        argv: list[str],
        data: bytes | None,
        timeout: float,
        env: dict[str, str] | None,
        limit: int | None = None,
        marker: str | None = None,
    ) -> _Exec:
        marker = marker or _new_marker()
        full_env = {**(env or {}), marker.split("=")[0]: marker.split("=")[1]}
        oom_before = self._oom_count()
        deadline = time.monotonic() + timeout
        exec_id, raw = self._exec_socket(argv, data is not None, full_env)
        try:
            if data is not None:
                # A process that never reads its stdin must not hold us past the deadline.
                raw.settimeout(max(0.1, deadline - time.monotonic()))
                with contextlib.suppress(OSError):  # socket.timeout too: _read_frames ends it
                    raw.sendall(data)
                with contextlib.suppress(OSError):
                    raw.shutdown(socket.SHUT_WR)
            out, err, truncated, timed_out = _read_frames(
                raw, deadline, limit or self.limits.output_bytes
            )
        finally:
            raw.close()
        if timed_out:
            self._kill_marked(marker)
        try:
            info = self._exec_info(exec_id, wait=not timed_out)
        except SandboxDeadError:
            # The whole container went down mid-run (gVisor answers OOM that way): report
            # this run as killed; the next call raises SandboxDeadError.
            state = self._state()
            return _Exec(out, err, 137, timed_out, bool(state.get("OOMKilled", True)), truncated)
        if info.get("Running") and not timed_out:  # the stream ended, the process did not
            self._kill_marked(marker)
        code = None if info.get("Running") or info.get("ExitCode") is None else info["ExitCode"]
        oom_after = self._oom_count()
        oom = oom_after > oom_before >= 0 or (oom_before < 0 and code == 137 and not timed_out)
        oom = oom or (
            not timed_out and code != 0 and any(m in err[-4096:] for m in _MEMORY_MARKERS)
        )
        return _Exec(out, err, code, timed_out, oom, truncated)

    def _exec_info(self, exec_id: str, wait: bool) -> dict:
        # The stream can end a moment before dockerd records the exit code.
        for _ in range(100 if wait else 1):
            try:
                info = self._client.api.exec_inspect(exec_id)
            except Exception as e:
                raise _map_error("inspect the exec", e) from e
            if not info.get("Running"):
                return info
            time.sleep(0.01)
        return info

    def _state(self) -> dict:
        with contextlib.suppress(Exception):
            self.container.reload()
            return self.container.attrs.get("State", {})
        return {}

    def _kill_marked(self, marker: str) -> None:
        """Kill one run's process tree; other runs and the interpreter are left alone."""
        if self._host_pids:
            kill_marked(marker)
            return
        with contextlib.suppress(Exception):  # a dead container has nothing left to kill
            self.container.exec_run([self.python, "-I", "-S", "-c", _KILL_TREE, marker], user=USER)

    async def run(
        self,
        command: str | list[str],
        stdin: str | bytes | None = None,
        timeout: float = 30.0,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        await self._ensure()
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        started = time.monotonic()
        marker = _new_marker()
        try:
            r = await asyncio.to_thread(self._run_blocking, argv, data, timeout, env, None, marker)
        except asyncio.CancelledError:  # the caller gave up: the run and what it started die now
            await asyncio.shield(asyncio.to_thread(self._kill_marked, marker))
            raise
        if r.code == 126 and b"container" in r.err and b"not running" in r.err:
            raise SandboxDeadError("the container is not running; create a new sandbox")
        return ExecResult(
            stdout=r.out.decode("utf-8", "replace"),
            stderr=r.err.decode("utf-8", "replace"),
            exit_code=137 if r.code is None else int(r.code),
            timed_out=r.timed_out,
            oom_killed=r.oom,
            truncated=r.truncated,
            duration_s=time.monotonic() - started,
        )

    async def _checked(
        self, what: str, argv: list[str], limit: int, data: bytes | None = None, too_big: str = ""
    ) -> bytes:
        """stdout of an exec that must exit 0, in time, with its whole output; else raise."""
        await self._ensure()
        r = await asyncio.to_thread(self._run_blocking, argv, data, _FILE_OP_S, None, limit)
        if r.timed_out:
            raise SandboxError(f"{what}: timed out after {_FILE_OP_S:.0f}s and was killed")
        if r.code != 0:
            detail = r.err.decode(errors="replace").strip() or "no message"
            status = "did not report an exit code" if r.code is None else f"exit {r.code}"
            raise SandboxError(f"{what}: {detail} ({status})")
        if r.truncated:
            raise SandboxError(too_big or f"{what}: more than {limit} bytes")
        return r.out

    # -- files -------------------------------------------------------------------------
    def _inner_path(self, path: str) -> str:
        return "/work/" + "/".join(relative_parts(path, self.workdir_alias))

    async def write_file(self, path: str, data: str | bytes) -> None:
        """Write a regular file as the sandbox user; symlinks, FIFOs and devices are refused."""
        payload = data.encode() if isinstance(data, str) else data
        argv = ["/bin/sh", "-c", _WRITE, "sh", self._inner_path(path)]
        await self._checked(f"cannot write {path!r} in the sandbox", argv, 1 << 16, payload)

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """Read a regular file up to ``max_bytes`` (at most ``fsize_mb``); symlinks, FIFOs
        and devices are refused. dd stops one byte past the limit, which tells a file
        over it from one exactly at it."""
        limit = read_limit(self.limits.fsize_mb, max_bytes)
        argv = ["/bin/sh", "-c", _READ, "sh", self._inner_path(path), str(limit + 1)]
        too_big = str(too_large(path, limit))
        return await self._checked(
            f"cannot read {path!r} in the sandbox", argv, limit, too_big=too_big
        )

    async def snapshot(self) -> bytes:
        """/work as a tar archive (files only: running processes are not captured).

        Raises ``SandboxError`` rather than return an archive that may be incomplete.
        """
        argv = ["tar", "-C", "/work", "-cf", "-", "."]
        return await self._checked("snapshot", argv, (self.limits.workdir_mb + 16) << 20)

    async def restore(self, snapshot: bytes) -> None:
        """Reset, then put back the /work saved by ``snapshot``.

        The archive is unpacked into a staging dir under /tmp first, and /work is
        replaced only once that succeeded: a bad archive leaves /work as it was.
        """
        if not _tar_complete(snapshot):
            raise SandboxError("restore: the snapshot is not a complete tar archive")
        await self._ensure()
        await self._kill_all_and_wipe(_SCRATCH)  # /work stays until the new one is ready
        # One exec: /work is wiped only after tar unpacked the whole archive.
        script = (
            f"mkdir {_STAGE} && tar -C {_STAGE} -xf - || {{ rm -rf {_STAGE}; exit 1; }}; "
            + _wipe_script(("/work",))
            + f" && cp -a {_STAGE}/. /work/ && chmod -R u+rwX {_STAGE} && rm -rf {_STAGE}"
        )
        await self._checked("restore", ["/bin/sh", "-c", script], 1 << 16, snapshot)

    # -- long-lived processes ----------------------------------------------------------
    async def open_process(
        self, argv: list[str], env: dict[str, str] | None = None
    ) -> SandboxProcess:
        await self._ensure()
        marker = _new_marker()
        full_env = {**(env or {}), "AGENTRL_RUN": marker.split("=")[1]}
        _, raw = await asyncio.to_thread(self._exec_socket, argv, True, full_env)
        raw.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=raw, limit=1 << 26)
        return _DockerProcess(self, reader, writer, marker)


@dataclass(slots=True)
class _Exec:
    """What one exec gave: ``code`` is None when docker never reported an exit."""

    out: bytes
    err: bytes
    code: int | None
    timed_out: bool
    oom: bool
    truncated: bool


class _DockerProcess(SandboxProcess):
    """An exec'd process over the hijacked socket; stdout frames are demultiplexed.

    A line longer than ``16 * output_bytes + 1 MiB`` raises ``SandboxError``, as the
    pipe reader of the host-process backends does.
    """

    def __init__(
        self,
        box: DockerSandbox,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        marker: str,
    ) -> None:
        self._box, self._reader, self._writer, self._marker = box, reader, writer, marker
        self._buf = bytearray()
        self._max_line = 16 * box.limits.output_bytes + (1 << 20)
        # A frame header read by a readline that was cancelled while it waited for the
        # payload: the next readline goes on from there, in step.
        self._header: bytes | None = None

    async def write(self, data: bytes) -> None:
        try:
            self._writer.write(data)
            await self._writer.drain()
        except (ConnectionError, OSError) as e:
            raise SandboxError(f"sandbox process stdin closed: {e}") from e

    async def readline(self) -> bytes:
        while b"\n" not in self._buf:
            if len(self._buf) > self._max_line:
                self._buf = bytearray()
                raise SandboxError(
                    f"sandbox process wrote an over-long line: over {self._max_line} bytes"
                )
            try:
                if self._header is None:
                    self._header = await self._reader.readexactly(8)
                header = self._header
                size = struct.unpack(">xxxxI", header)[0]
                if size > self._max_line:
                    raise SandboxError(f"docker sent a {size}-byte frame; the stream is corrupt")
                payload = await self._reader.readexactly(size)
                self._header = None
            except (asyncio.IncompleteReadError, ConnectionError):
                line, self._buf = bytes(self._buf), bytearray()
                return line
            if header[0] == 1:  # stdout; stderr frames are dropped
                self._buf += payload
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        return line + b"\n"

    async def kill(self) -> None:
        with contextlib.suppress(Exception):
            self._writer.close()
        if self._box.container is not None and not self._box._closed:
            await asyncio.to_thread(self._box._kill_marked, self._marker)


def _new_marker() -> str:
    """The env entry that marks one run's processes, so that it can be killed alone."""
    return f"AGENTRL_RUN={secrets.token_hex(8)}"


def _read_frames(
    raw: socket.socket, deadline: float, limit: int
) -> tuple[bytes, bytes, bool, bool]:
    """Demultiplex docker's 8-byte-header frames until EOF or ``deadline``; bounded memory."""
    bufs = (bytearray(), bytearray())
    pending, truncated = b"", False
    raw.setblocking(False)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return bytes(bufs[0]), bytes(bufs[1]), truncated, True
        ready, _, _ = select.select([raw], [], [], min(left, 1.0))
        if not ready:
            continue
        try:
            chunk = raw.recv(1 << 16)
        except BlockingIOError:
            continue
        except OSError:
            chunk = b""
        if not chunk:
            return bytes(bufs[0]), bytes(bufs[1]), truncated, False
        pending += chunk
        while len(pending) >= 8:
            kind, size = pending[0], struct.unpack(">xxxxI", pending[:8])[0]
            if len(pending) < 8 + size:
                break
            payload, pending = pending[8 : 8 + size], pending[8 + size :]
            buf = bufs[1] if kind == 2 else bufs[0]
            room = limit - len(buf)
            if room > 0:
                buf += payload[:room]
            truncated = truncated or len(payload) > room


class GvisorSandbox(DockerSandbox):
    """``DockerSandbox`` under gVisor's user-space kernel (docker runtime ``runsc``)."""

    ISOLATION: Isolation = "gvisor"
    NAME = "gvisor"

    def __init__(self, *args: Any, runtime: str = "runsc", **kwargs: Any) -> None:
        super().__init__(*args, runtime=runtime, **kwargs)


def build_image(
    tag: str = DEFAULT_IMAGE,
    suite: str = "bookworm",
    mirror: str = "http://deb.debian.org/debian",
    include: tuple[str, ...] = ("python3",),
    base_url: str | None = None,
) -> str:
    """Build the sandbox image offline from a debootstrap rootfs; returns the image id.

    Needs root, ``debootstrap`` (apt-get install debootstrap) and a reachable
    Debian mirror (apt's own mirror works). Takes about a minute.
    """
    if shutil.which("debootstrap") is None:
        raise SandboxUnavailableError(
            "build_image needs debootstrap: `apt-get install debootstrap`"
        )
    client = docker_client(base_url)
    root = tempfile.mkdtemp(prefix="agentrl-rootfs-", dir="/var/tmp")
    tarball = root + ".tar"
    try:
        cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(include)}", suite, root]
        done = subprocess.run([*cmd, mirror], capture_output=True, text=True)
        if done.returncode != 0:
            raise SandboxError(f"debootstrap failed: {done.stderr[-2000:] or done.stdout[-2000:]}")
        subprocess.run(["tar", "-C", root, "-cf", tarball, "."], check=True)
        repo, _, version = tag.partition(":")
        changes = [
            "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "USER 65534:65534",
            "WORKDIR /work",
        ]
        try:
            client.api.import_image_from_file(
                tarball, repository=repo, tag=version or "latest", changes=changes
            )
            return client.images.get(tag).id
        except Exception as e:
            raise _map_error("import the image", e) from e
    finally:
        shutil.rmtree(root, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(tarball)
