"""The ``bash`` tool: run a shell command in the episode's sandbox."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from agentrl.sandboxes.base import Sandbox

from ._sandbox_errors import format_exec, require_sandbox
from .base import Tool, ToolResult, positive_setting

__all__ = ["BashArgs", "BashTool"]


class BashArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    command: str = Field(description="Shell command line, run by /bin/sh -c in the working dir.")
    timeout: float = Field(30.0, gt=0, le=300, description="Seconds before the command is killed.")


class BashTool(Tool):
    """Runs a command with ``Sandbox.run``; a non-zero exit is an error result."""

    name: ClassVar[str] = "bash"
    description: ClassVar[str] = (
        "Run a shell command in the working directory and return its stdout, stderr and exit code."
    )
    Args: ClassVar[type[BaseModel]] = BashArgs
    needs_sandbox: ClassVar[bool] = True

    def __init__(self, max_timeout: float = 120.0):
        self.max_timeout = positive_setting("BashTool", "max_timeout", max_timeout)

    async def __call__(self, args: BashArgs, sandbox: Sandbox | None) -> ToolResult:
        timeout = min(args.timeout, self.max_timeout)
        result = await require_sandbox(sandbox, self.name).run(args.command, timeout=timeout)
        return ToolResult(
            content=format_exec(result, timeout),
            is_error=not result.ok,
            metadata={"exit_code": result.exit_code, "timed_out": result.timed_out},
        )
