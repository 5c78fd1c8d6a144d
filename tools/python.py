"""The ``python`` tool: run code in a persistent interpreter, state kept between calls.

Each sandbox gets one interpreter (``agentrl.sandboxes.interpreter.PythonInterpreter``),
started on the first call and closed by ``release`` when the episode ends. Calls
into the same interpreter are serialized, so concurrent calls in one turn run in
the order they were made.

Branching: ``snapshot_state`` is the interpreter's ``history`` (the snippets whose
changes it kept), and ``restore_state`` runs them again, at once, in a fresh
interpreter. That replay has its side effects again: it runs against the
sandbox's current files and may change them. ``ToolEnv`` therefore calls
``restore_state`` only right before the python tool is next used, and then puts
the files back as they were (see ``ToolEnv.restore``). The rebuilt variables are
identical when the snippets are deterministic; one that reads the clock, draws
unseeded random numbers or reads a file that later snippets changed sees
something else the second time.

A snippet that kills or garbles the kernel itself (not just its own process,
which rolls back) gets an error result saying the state is lost, and a fresh
kernel answers the next call; only when no fresh kernel starts (the sandbox is
gone) does the episode fail.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from agentrl.errors import SandboxDeadError, SandboxError
from agentrl.sandboxes.base import Sandbox

from ._sandbox_errors import format_exec, require_sandbox
from .base import Tool, ToolResult, positive_setting

__all__ = ["PythonArgs", "PythonTool"]


class PythonArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str = Field(
        description="Python code. Variables persist between calls; print() what you want to see."
    )
    timeout: float = Field(30.0, gt=0, le=300, description="Seconds before the snippet is killed.")


def _default_interpreter(sandbox: Sandbox) -> Any:
    from agentrl.sandboxes.interpreter import PythonInterpreter  # lazy: optional module

    return PythonInterpreter(sandbox)


@dataclass(slots=True)
class _Session:
    interpreter: Any
    lock: asyncio.Lock
    started: bool = False


class PythonTool(Tool):
    """Stateful Python through the sandbox's persistent interpreter."""

    name: ClassVar[str] = "python"
    description: ClassVar[str] = (
        "Run Python code in a persistent session (like a notebook): variables, imports and "
        "functions stay defined between calls. Returns what the code printed."
    )
    Args: ClassVar[type[BaseModel]] = PythonArgs
    needs_sandbox: ClassVar[bool] = True

    def __init__(
        self,
        interpreter_factory: Callable[[Sandbox], Any] | None = None,
        max_timeout: float = 120.0,
    ):
        self._factory = interpreter_factory or _default_interpreter
        self.max_timeout = positive_setting("PythonTool", "max_timeout", max_timeout)
        self._sessions: weakref.WeakKeyDictionary[Sandbox, _Session] = weakref.WeakKeyDictionary()

    def _session(self, sandbox: Sandbox) -> _Session:
        session = self._sessions.get(sandbox)
        if session is None:
            session = _Session(self._factory(sandbox), asyncio.Lock())
            self._sessions[sandbox] = session
        return session

    async def __call__(self, args: PythonArgs, sandbox: Sandbox | None) -> ToolResult:
        session = self._session(require_sandbox(sandbox, self.name))
        timeout = min(args.timeout, self.max_timeout)
        async with session.lock:
            await self._start(session)
            try:
                result = await session.interpreter.execute(args.code, timeout)
            except SandboxDeadError as e:
                return await self._after_kernel_death(session, e)
        return ToolResult(
            content=format_exec(result, timeout),
            is_error=not result.ok,
            metadata={"exit_code": result.exit_code, "timed_out": result.timed_out},
        )

    @staticmethod
    async def _after_kernel_death(session: _Session, err: SandboxDeadError) -> ToolResult:
        """The kernel died during this call: the snippet may have killed or garbled it
        (``os.kill(os.getppid(), 9)``, writing to the kernel's pipes). Where a fresh kernel
        starts, the model is told its state is lost and goes on; where none starts, the
        sandbox itself is gone and the episode fails, as before."""
        try:
            await session.interpreter.start()
        except SandboxError as e:
            raise SandboxDeadError(f"{err}; a fresh kernel did not start either: {e}") from e
        return ToolResult(content="[interpreter] the Python kernel itself died or stopped answering during this "
                                  "code; every variable, import and function is lost. A fresh kernel answers "
                                  "the next call.",
                          is_error=True, metadata={"exit_code": None, "timed_out": False, "kernel_lost": True})

    @staticmethod
    async def _start(session: _Session) -> None:
        if not session.started:
            await session.interpreter.start()
            session.started = True

    async def snapshot_state(self, sandbox: Sandbox) -> list[tuple[str, float]] | None:
        session = self._sessions.get(sandbox)
        if session is None:
            return None
        async with session.lock:  # between calls, never mid-snippet
            return list(getattr(session.interpreter, "history", None) or []) or None

    async def restore_state(self, sandbox: Sandbox, state: list[tuple[str, float]] | None) -> None:
        """Run the snippets of ``state`` now, in a fresh interpreter, side effects and all."""
        await self.release(sandbox)
        if not state:
            return
        session = self._session(sandbox)
        async with session.lock:
            await self._start(session)
            for code, timeout in state:
                await session.interpreter.execute(code, timeout)

    async def release(self, sandbox: Sandbox) -> None:
        session = self._sessions.pop(sandbox, None)
        if session is not None and session.started:
            await session.interpreter.close()
