"""``docker``: a warm container per sandbox, commands run by ``exec`` — isolation ``container``.

The container: ``--network none``, memory (= memory+swap), cpu and pids limits,
a read-only root fs with size-capped tmpfs ``/work`` and ``/tmp``, ``--cap-drop
ALL``, ``no-new-privileges``, user 65534, and an init (tini) that reaps orphans.
It idles on ``sleep infinity``; every ``run`` is a ``docker exec``.

Timeouts: the exec carries a marker in its environment; when dockerd runs on
this host (we see its processes in /proc) every marked process is killed from
the host, else ``kill -9 -1`` is exec'd inside. ``reset`` kills every process
but init and empties /work and /tmp. ``oom_killed`` comes from the container's
memory cgroup ``oom_kill`` counter where readable, else from exit code 137
without a timeout.

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
from typing import Any

from agentrl.errors import SandboxDeadError, SandboxError, SandboxUnavailableError

from ._files import relative_parts
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
            labels={"agentrl.sandbox": "1", "agentrl.owner_pid": str(os.getpid())},
        )
        if self.runtime:
            kwargs["runtime"] = self.runtime
        try:
            self.container = self._client.containers.run(self.image, **kwargs)
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
            if self.container is not None:
                await asyncio.to_thread(self._remove_blocking)

    def _remove_blocking(self) -> None:
        with contextlib.suppress(Exception):  # already gone is fine: close is idempotent
            self.container.remove(force=True)
        with contextlib.suppress(Exception):
            self._client.close()

    async def reset(self) -> None:
        # kill(-1) as the sandbox user reaches every sandboxed process (the idle init and
        # `sleep` run as capability-less root, out of reach); a few passes catch forks.
        await self._ensure()
        script = (
            "for i in 1 2 3; do kill -9 -1 2>/dev/null; done; "
            "rm -rf /work/* /work/.[!.]* /tmp/* /tmp/.[!.]* 2>/dev/null; true"
        )
        for _ in range(5):  # right after a fork bomb the pids limit may still be exhausted
            r = await self.run(["/bin/sh", "-c", script], timeout=60)
            if r.exit_code == 0:
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
        return ex["Id"], sock._sock if hasattr(sock, "_sock") else sock

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
        self, argv: list[str], data: bytes | None, timeout: float, env: dict[str, str] | None
    ) -> tuple[bytes, bytes, int, bool, bool, bool]:
        marker = f"AGENTRL_RUN={secrets.token_hex(8)}"
        full_env = {**(env or {}), marker.split("=")[0]: marker.split("=")[1]}
        oom_before = self._oom_count()
        exec_id, raw = self._exec_socket(argv, data is not None, full_env)
        try:
            if data is not None:
                with contextlib.suppress(OSError):
                    raw.sendall(data)
                with contextlib.suppress(OSError):
                    raw.shutdown(socket.SHUT_WR)
            out, err, truncated, timed_out = _read_frames(
                raw, time.monotonic() + timeout, self.limits.output_bytes
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
            return out, err, 137, timed_out, bool(state.get("OOMKilled", True)), truncated
        code = info.get("ExitCode")
        code = 137 if code is None else int(code)
        oom_after = self._oom_count()
        oom = oom_after > oom_before >= 0 or (oom_before < 0 and code == 137 and not timed_out)
        oom = oom or (
            not timed_out and code != 0 and any(m in err[-4096:] for m in _MEMORY_MARKERS)
        )
        return out, err, code, timed_out, oom, truncated

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
        if self._host_pids:
            kill_marked(marker)
        else:
            with contextlib.suppress(Exception):
                self.container.exec_run(["/bin/sh", "-c", "kill -9 -1"], user=USER)

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
        out, err, code, timed_out, oom, truncated = await asyncio.to_thread(
            self._run_blocking, argv, data, timeout, env
        )
        if code == 126 and b"container" in err and b"not running" in err:
            raise SandboxDeadError("the container is not running; create a new sandbox")
        return ExecResult(
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            exit_code=code,
            timed_out=timed_out,
            oom_killed=oom,
            truncated=truncated,
            duration_s=time.monotonic() - started,
        )

    # -- files -------------------------------------------------------------------------
    def _inner_path(self, path: str) -> str:
        return "/work/" + "/".join(relative_parts(path, self.workdir_alias))

    async def write_file(self, path: str, data: str | bytes) -> None:
        target = self._inner_path(path)
        payload = data.encode() if isinstance(data, str) else data
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
        r = await self.run(["/bin/sh", "-c", script, "sh", target], stdin=payload, timeout=60)
        if r.exit_code != 0:
            raise SandboxError(f"cannot write {path!r} in the sandbox: {r.stderr.strip()}")

    async def read_file(self, path: str) -> bytes:
        await self._ensure()
        target = self._inner_path(path)
        limit = self.limits.fsize_mb << 20
        out, err, code, _, _, truncated = await asyncio.to_thread(
            self._run_blocking_limit, ["cat", "--", target], limit
        )
        if code != 0:
            raise SandboxError(f"cannot read {path!r} in the sandbox: {err.decode().strip()}")
        if truncated:
            raise SandboxError(
                f"{path!r} is larger than {limit} bytes; read it in parts with run()"
            )
        return out

    def _run_blocking_limit(self, argv: list[str], limit: int) -> tuple:
        exec_id, raw = self._exec_socket(argv, False, {})
        try:
            out, err, truncated, _ = _read_frames(raw, time.monotonic() + 60, limit)
        finally:
            raw.close()
        code = self._exec_info(exec_id, wait=True).get("ExitCode") or 0
        return out, err, int(code), False, False, truncated

    async def snapshot(self) -> bytes:
        """/work as a tar archive (files only: running processes are not captured)."""
        await self._ensure()
        out, err, code, _, _, truncated = await asyncio.to_thread(
            self._run_blocking_limit,
            ["tar", "-C", "/work", "-cf", "-", "."],
            (self.limits.workdir_mb + 16) << 20,
        )
        if code != 0:
            raise SandboxError(f"snapshot failed: {err.decode(errors='replace').strip()}")
        return out

    async def restore(self, snapshot: bytes) -> None:
        """Reset, then put back the /work saved by ``snapshot``."""
        await self.reset()
        r = await self.run(["tar", "-C", "/work", "-xf", "-"], stdin=snapshot, timeout=120)
        if r.exit_code != 0:
            raise SandboxError(f"restore failed: {r.stderr.strip()}")

    # -- long-lived processes ----------------------------------------------------------
    async def open_process(
        self, argv: list[str], env: dict[str, str] | None = None
    ) -> SandboxProcess:
        await self._ensure()
        marker = f"AGENTRL_RUN={secrets.token_hex(8)}"
        full_env = {**(env or {}), "AGENTRL_RUN": marker.split("=")[1]}
        _, raw = await asyncio.to_thread(self._exec_socket, argv, True, full_env)
        raw.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=raw, limit=1 << 26)
        return _DockerProcess(self, reader, writer, marker)


class _DockerProcess(SandboxProcess):
    """An exec'd process over the hijacked socket; stdout frames are demultiplexed."""

    def __init__(
        self,
        box: DockerSandbox,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        marker: str,
    ) -> None:
        self._box, self._reader, self._writer, self._marker = box, reader, writer, marker
        self._buf = bytearray()

    async def write(self, data: bytes) -> None:
        try:
            self._writer.write(data)
            await self._writer.drain()
        except (ConnectionError, OSError) as e:
            raise SandboxError(f"sandbox process stdin closed: {e}") from e

    async def readline(self) -> bytes:
        while b"\n" not in self._buf:
            try:
                header = await self._reader.readexactly(8)
                payload = await self._reader.readexactly(struct.unpack(">xxxxI", header)[0])
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
