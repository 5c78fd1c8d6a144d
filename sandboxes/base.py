"""The sandbox protocol: every backend runs commands behind the same async API.

A tool never knows which backend runs it. Each backend declares the isolation it
gives (``ISOLATION``); asking for more than the machine can give raises
``SandboxUnavailableError`` naming what to install, never a silent downgrade.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["ExecResult", "Isolation", "Sandbox", "ISOLATION_ORDER"]

Isolation = Literal["none", "namespaces", "container", "gvisor", "remote"]
# From weakest to strongest; "remote" is as strong as the far side, checked there.
ISOLATION_ORDER: tuple[str, ...] = ("none", "namespaces", "container", "gvisor")


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


class Sandbox(abc.ABC):
    """An isolated place to run untrusted commands and code.

    ``run`` takes a shell command string (run by ``/bin/sh -c``) or an argv list.
    Files live under the sandbox's private working directory; relative paths in
    ``write_file`` / ``read_file`` are relative to it.
    """

    ISOLATION: Isolation = "none"

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
    async def read_file(self, path: str) -> bytes: ...

    @abc.abstractmethod
    async def reset(self) -> None:
        """Return to a fresh state: empty workdir, no leftover processes."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Kill every process of the sandbox and free its resources. Idempotent."""

    async def snapshot(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} cannot snapshot")

    async def restore(self, snapshot: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot restore")

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
