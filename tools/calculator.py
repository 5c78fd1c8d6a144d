"""The ``calculator`` tool and ``evaluate``: safe arithmetic (see ``_arith``) under a hard deadline.

``_arith.evaluate`` checks sizes as it walks the expression, but some allowed
builtins compute a huge intermediate before any check can run
(``round(7, -3*10**8)`` builds a power of ten with 300 million digits), and a
C-level computation never yields to the event loop, so ``call_timeout_s``
could not fire. Both the tool and this module's ``evaluate`` therefore compute
in a worker process, and a call that passes its deadline kills the worker (a
fresh one serves the next call). The event loop only waits on a thread; it
never computes. Expressions that are too big or too slow are model mistakes
(error results, or ``CalcError`` from ``evaluate``); a worker killed from
outside while a call writes to it raises ``ToolError``.
"""

from __future__ import annotations

import asyncio
import json
import select
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from agentrl.errors import ToolError

from ._arith import FUNCTION_NAMES, CalcError, format_number
from .base import Tool, ToolResult, positive_setting

__all__ = ["CalculatorArgs", "CalculatorTool", "CalcError", "evaluate", "format_number"]

_WORKER_SCRIPT = str(Path(__file__).with_name("_arith.py"))


def _stop(box: list[subprocess.Popen | None]) -> None:
    proc, box[0] = box[0], None
    if proc is not None:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


class _Worker:
    """One ``_arith`` process, used by one call at a time; killed when a call is late.

    Blocking: call ``evaluate`` from a thread. The process exits when its stdin
    closes, so it never outlives the host.
    """

    def __init__(self) -> None:
        self._box: list[subprocess.Popen | None] = [None]
        self._lock = threading.Lock()
        weakref.finalize(self, _stop, self._box)

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", _WORKER_SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self._box[0] = proc
        return proc

    def evaluate(self, expression: str, timeout: float) -> dict[str, Any]:
        """``{"value": number}`` or ``{"error": reason}``, within ``timeout`` seconds."""
        with self._lock:
            proc = self._box[0]
            if proc is None or proc.poll() is not None:  # first use, or killed from outside
                _stop(self._box)
                proc = self._start()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write((json.dumps({"expression": expression}) + "\n").encode())
                proc.stdin.flush()
            except OSError as err:  # killed from outside: not the model's doing
                _stop(self._box)
                raise ToolError(f"the calculator worker died: {err}") from err
            if not select.select([proc.stdout], [], [], timeout)[0]:
                _stop(self._box)
                return {"error": f"the expression took longer than {timeout:g} s to compute"}
            line = proc.stdout.readline()
            if not line:
                _stop(self._box)
                return {"error": "the computation crashed the calculator (out of memory?)"}
            return json.loads(line)

    def close(self) -> None:
        with self._lock:
            _stop(self._box)

    def __reduce__(self) -> tuple[Any, ...]:  # a copy or a pickle gets its own worker
        return (_Worker, ())


_shared: _Worker | None = None
_shared_lock = threading.Lock()


def evaluate(expression: str, timeout_s: float = 2.0) -> int | float:
    """The value of an arithmetic ``expression``, computed as the ``calculator`` tool computes it:
    in a worker process, killed after ``timeout_s`` seconds.

    Raises ``CalcError`` saying why not, also when the computation is too slow.
    Blocking; calls share one worker per process and run one at a time.
    """
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = _Worker()
        worker = _shared
    out = worker.evaluate(expression, timeout_s)
    if "error" in out:
        raise CalcError(out["error"])
    return out["value"]


class CalculatorArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    expression: str = Field(
        description="Arithmetic expression, e.g. '(3 + 4) * 2**10 / sqrt(2)'. Use ** for powers."
    )


class CalculatorTool(Tool):
    """Evaluates arithmetic in a worker process, at most ``timeout_s`` per call; no sandbox."""

    name: ClassVar[str] = "calculator"
    description: ClassVar[str] = (
        "Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses, "
        "pi, e, tau and functions " + ", ".join(FUNCTION_NAMES) + "."
    )
    Args: ClassVar[type[BaseModel]] = CalculatorArgs

    def __init__(self, timeout_s: float = 2.0):
        self.timeout_s = positive_setting("CalculatorTool", "timeout_s", timeout_s)
        self._worker = _Worker()

    async def __call__(self, args: CalculatorArgs, sandbox: Any = None) -> ToolResult:
        out = await asyncio.to_thread(self._worker.evaluate, args.expression, self.timeout_s)
        if "error" in out:
            return ToolResult.error(f"calculator error: {out['error']}")
        return ToolResult(content=format_number(out["value"]))

    def close(self) -> None:
        """Stop the worker process now, not at garbage collection; a later call starts another."""
        self._worker.close()
