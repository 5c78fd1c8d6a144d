"""The sandbox protocol: every backend runs commands behind the same async API.

A tool never knows which backend runs it. Each backend declares the isolation it
gives (``ISOLATION``); asking for more than the machine can give raises
``SandboxUnavailableError`` naming what to install, never a silent downgrade.
Where a backend runs with less than its docstring promises on this machine (no
writable cgroup, not root), it says so once at runtime with an ``IsolationWarning``.
"""

from __future__ import annotations

import abc
import warnings
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ExecResult",
    "Isolation",
    "Sandbox",
    "ISOLATION_ORDER",
    "IsolationWarning",
    "SandboxLimits",
    "SandboxProcess",
    "isolation_at_least",
    "warn_once",
]

Isolation = Literal["none", "namespaces", "container", "gvisor", "remote"]
# From weakest to strongest; "remote" is as strong as the far side, checked there.
ISOLATION_ORDER: tuple[str, ...] = ("none", "namespaces", "container", "gvisor")


def isolation_at_least(have: str, want: str) -> bool:
    """True when isolation level ``have`` gives at least what ``want`` asks for."""
    if want == "remote" or have == "remote":
        return have == want or want == "none"
    return ISOLATION_ORDER.index(have) >= ISOLATION_ORDER.index(want)


class IsolationWarning(RuntimeWarning):
    """Model code runs with less isolation, or looser limits, than a sandbox suggests.

    A ``RuntimeWarning``: it describes this machine, not a mistake in the caller's code.
    """


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Emit ``message`` as an ``IsolationWarning`` once per process, whatever the filters."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, IsolationWarning, stacklevel=3)


class SandboxLimits(BaseModel):
    """Resource limits every backend enforces (each in its own way)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_s: int = Field(60, ge=1, description="CPU seconds per process (RLIMIT_CPU).")
    memory_mb: int = Field(
        1024,
        ge=16,
        description="Memory per process (RLIMIT_AS), and of the whole sandbox where a cgroup "
        "or container caps it, MiB.",
    )
    pids: int = Field(128, ge=4, description="Max processes/threads of the sandbox.")
    nofile: int = Field(256, ge=16, description="Max open files per process.")
    fsize_mb: int = Field(256, ge=1, description="Max size of one written file, MiB.")
    output_bytes: int = Field(
        1 << 20, ge=1024, description="stdout and stderr are each truncated to this many bytes."
    )
    workdir_mb: int = Field(
        512, ge=1, description="Size of the writable workdir (and bwrap's /tmp) where capped, MiB."
    )


@dataclass(slots=True)
class ExecResult:
    """What one ``Sandbox.run`` produced."""

    stdout: str = ""
    stderr: str = ""
    exit_code: int = 0
    timed_out: bool = False
    oom_killed: bool = False
    truncated: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.oom_killed


class SandboxProcess(abc.ABC):
    """A long-lived process inside a sandbox, spoken to through stdin/stdout lines.

    Used by the persistent interpreter. stderr is discarded by backends.
    """

    @abc.abstractmethod
    async def write(self, data: bytes) -> None: ...

    @abc.abstractmethod
    async def readline(self) -> bytes:
        """One line including its newline; ``b""`` at end of stream."""

    @abc.abstractmethod
    async def kill(self) -> None:
        """Kill the process (and what it spawned, where the backend can). Idempotent."""

    async def exchange(self, data: bytes) -> bytes:
        """Write ``data`` and read one line back (one round trip where remote)."""
        await self.write(data)
        return await self.readline()


class Sandbox(abc.ABC):
    """An isolated place to run untrusted commands and code.

    ``run`` takes a shell command string (run by ``/bin/sh -c``) or an argv list.
    Files live under the sandbox's private working directory; relative paths in
    ``write_file`` / ``read_file`` are relative to it.
    """

    ISOLATION: Isolation = "none"
    # The interpreter used by run_python and the persistent interpreter.
    python: str = "python3"

    @abc.abstractmethod
    async def run(
        self,
        command: str | list[str],
        stdin: str | bytes | None = None,
        timeout: float = 30.0,
        env: dict[str, str] | None = None,
    ) -> ExecResult: ...

    @abc.abstractmethod
    async def write_file(self, path: str, data: str | bytes) -> None: ...

    @abc.abstractmethod
    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """The file's bytes. Over ``max_bytes`` (capped at, and by default, the backend's
        own limit, ``fsize_mb`` where it has one) it raises ``SandboxError`` naming the
        limit, having held at most that many bytes (+1) in this process's memory."""

    @abc.abstractmethod
    async def reset(self) -> None:
        """Return to a fresh state: empty workdir, no leftover processes."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Kill every process of the sandbox and free its resources. Idempotent."""

    async def open_process(
        self, argv: list[str], env: dict[str, str] | None = None
    ) -> SandboxProcess:
        """Start a long-lived process with piped stdin/stdout (the persistent interpreter)."""
        raise NotImplementedError(f"{type(self).__name__} cannot open long-lived processes")

    async def run_python(
        self, code: str, stdin: str | bytes | None = None, timeout: float = 30.0
    ) -> ExecResult:
        """Run a Python snippet in a fresh interpreter (no state kept between calls)."""
        return await self.run([self.python, "-c", code], stdin=stdin, timeout=timeout)

    async def healthy(self) -> bool:
        """A cheap liveness probe used by pools: can the sandbox still run ``true``?"""
        try:
            return (await self.run(["true"], timeout=10.0)).exit_code == 0
        except Exception:  # any failure means unhealthy; the pool replaces it
            return False

    @classmethod
    def describe(cls) -> str:
        """What this backend enforces on this machine, in one line (``agentrl sandbox backends``)."""
        return f"isolation {cls.ISOLATION}"

    async def snapshot(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} cannot snapshot")

    async def restore(self, snapshot: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot restore")

    async def start(self) -> None:  # noqa: B027 -- optional hook, not abstract
        """Create the sandbox's resources now (backends also start lazily on first use)."""

    async def __aenter__(self) -> Sandbox:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
