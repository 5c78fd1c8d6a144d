"""Small fake sandboxes for the tool tests (in-memory files; a dead one)."""

from __future__ import annotations

from agentrl.errors import SandboxDeadError
from agentrl.sandboxes.base import ExecResult, Sandbox

__all__ = ["DeadSandbox", "MemorySandbox"]


class MemorySandbox(Sandbox):
    """Files in a dict, commands refused; counts resets and closes."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.resets = 0
        self.closed = False

    async def run(self, command, stdin=None, timeout=30.0, env=None) -> ExecResult:
        return ExecResult(stdout=f"ran {command}")

    async def write_file(self, path: str, data: str | bytes) -> None:
        self.files[path] = data.encode() if isinstance(data, str) else data

    async def read_file(self, path: str) -> bytes:
        if path not in self.files:
            raise FileNotFoundError(path)
        return self.files[path]

    async def reset(self) -> None:
        self.resets += 1
        self.files.clear()

    async def close(self) -> None:
        self.closed = True


class DeadSandbox(MemorySandbox):
    """A sandbox that was killed from outside: every call fails."""

    async def run(self, command, stdin=None, timeout=30.0, env=None) -> ExecResult:
        raise SandboxDeadError("sandbox was killed from outside")

    async def read_file(self, path: str) -> bytes:
        raise SandboxDeadError("sandbox was killed from outside")

    async def reset(self) -> None:
        raise SandboxDeadError("sandbox was killed from outside")
