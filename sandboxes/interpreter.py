"""``PythonInterpreter``: a persistent Python kernel inside any sandbox backend.

Like a notebook kernel: variables, functions, classes and imports defined by one
``execute`` are visible to the next. The value of a final expression is printed,
as a REPL does.

State semantics (see ``_kernel.py`` for the mechanism):
- Each snippet runs in a forked child. When it finishes — normally, with an
  exception or with ``sys.exit`` — its state becomes the kernel's state.
- When it crashes (``os._exit``, a signal, a segfault) or hits the timeout, its
  process group is killed and the state rolls back to just before the snippet.
  The result says so in ``stderr``.
- When the ``execute`` call itself is cancelled (``asyncio.wait_for`` around
  it), the kernel is told to stop the snippet, which rolls back as on a
  timeout. Every reply echoes its request's id and stale ones are skipped, so
  the next call reads its own output; a kernel that does not acknowledge the
  cancel is dropped.
- When the whole kernel dies (killed from outside, sandbox reset or closed), the
  next ``execute`` raises ``SandboxDeadError``; the call after that starts a
  fresh, empty kernel.

``history`` lists the snippets whose changes the kernel kept, so that a fresh
kernel can rebuild the state by running them again (the ``python`` tool does
this when an env is restored).

Trust: a snippet runs in a fork of the kernel, so it holds the protocol pipes and
everything the kernel knows (its request, the id). It can write a reply of its
own, and a child it leaves behind can read or forge later ones; no token could be
kept from it. A result is therefore the snippet's own claim, as its printed
output is: a reward must never be read from this interpreter (grade in a fresh
``run``). What the host does guarantee: a line of the wrong shape (not JSON, not
an object, a field of the wrong type) drops the kernel with ``SandboxDeadError``,
and every wait is bounded by the snippet's timeout plus a grace.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import zlib
from importlib import resources

from agentrl.errors import SandboxDeadError, SandboxError

from .base import ExecResult, Sandbox, SandboxProcess

__all__ = ["PythonInterpreter"]

_GRACE_S = 15.0  # on top of a snippet's timeout, for the kernel's own kill and reply


@functools.lru_cache(maxsize=1)
def _kernel_command() -> str:
    """A short ``-c`` program carrying the kernel source compressed (keeps ``ps`` readable)."""
    src = resources.files(__package__).joinpath("_kernel.py").read_bytes()
    blob = base64.b64encode(zlib.compress(src, 9)).decode()
    return f"import base64,zlib;exec(zlib.decompress(base64.b64decode('{blob}')))"


class PythonInterpreter:
    """A stateful Python worker living in ``sandbox``; one snippet at a time."""

    def __init__(self, sandbox: Sandbox, output_bytes: int | None = None) -> None:
        self.sandbox = sandbox
        limits = getattr(sandbox, "limits", None)
        self.output_bytes = output_bytes or (limits.output_bytes if limits else 1 << 20)
        self._proc: SandboxProcess | None = None
        self._lock = asyncio.Lock()
        self.restarts = 0  # kernels started after the first (each one lost the state)
        self._started_once = False
        self._last_id = 0
        # (code, timeout) of each snippet whose changes the kernel kept, oldest first:
        # running them in order in a fresh kernel rebuilds the state (see ``replay``).
        self.history: list[tuple[str, float]] = []

    @property
    def running(self) -> bool:
        return self._proc is not None

    async def start(self, timeout: float = 60.0) -> None:
        """Start the kernel (done lazily by ``execute`` too)."""
        if self._proc is not None:
            return
        argv = [self.sandbox.python, "-I", "-c", _kernel_command()]
        proc = await self.sandbox.open_process(argv)
        try:
            hello = await asyncio.wait_for(proc.readline(), timeout)
        except (TimeoutError, SandboxError) as e:
            await proc.kill()
            raise SandboxError(f"the Python kernel did not start within {timeout:.0f}s") from e
        if not hello.startswith(b'{"ready"'):
            await proc.kill()
            raise SandboxError(
                f"the Python kernel failed to start (is {self.sandbox.python} in the sandbox?): "
                f"{hello[:300]!r}"
            )
        self._proc = proc

    async def execute(self, code: str, timeout: float = 30.0) -> ExecResult:
        """Run ``code`` in the kernel; stdout/stderr are the snippet's own output.

        Cancelling the call (``asyncio.wait_for`` around it, say) stops the snippet
        and rolls the state back, as a timeout does, and the next call reads its
        own reply: replies carry the request's id, and a cancel is acknowledged.
        A kernel that cannot be brought back in step is dropped (state lost).
        """
        async with self._lock:
            if self._proc is None:
                if self._started_once:
                    self.restarts += 1
                await self.start()
            self._started_once = True
            self._last_id += 1
            rid = self._last_id
            request = {"id": rid, "code": code, "timeout": timeout, "limit": self.output_bytes}
            try:
                reply = await asyncio.wait_for(self._ask(request, rid), timeout + _GRACE_S)
            except asyncio.CancelledError:
                await self._cancel(rid, code, timeout)
                raise
            except (TimeoutError, SandboxError) as e:
                await self._drop()
                raise SandboxDeadError(
                    f"the Python kernel stopped answering ({type(e).__name__}); its state is "
                    "lost, and the next execute() starts a fresh kernel"
                ) from e
            if reply is None:
                await self._drop()
                raise SandboxDeadError(
                    "the Python kernel died (killed from outside, or its sandbox was reset or "
                    "closed); its state is lost, and the next execute() starts a fresh kernel"
                )
            if reply.get("promoted"):
                self.history.append((code, timeout))
            return _result(reply)

    async def _ask(self, request: dict, rid: int) -> dict | None:
        """Send ``request``; its reply, skipping replies to earlier (cancelled) requests."""
        assert self._proc is not None
        raw = await self._proc.exchange((json.dumps(request) + "\n").encode())
        while raw:
            reply = _decode(raw)
            if reply.get("id") == rid:
                return reply
            raw = await self._proc.readline()
        return None

    async def _cancel(self, rid: int, code: str, timeout: float) -> None:
        """Stop request ``rid`` and read up to the kernel's ack; else drop the kernel."""
        proc = self._proc
        if proc is None:
            return
        try:
            raw = await asyncio.wait_for(proc.exchange(_cancel_line(rid)), _GRACE_S)
            while raw:
                reply = _decode(raw)
                if reply.get("cancel_ack") == rid:
                    if reply.get("promoted"):  # it finished before the cancel arrived
                        self.history.append((code, timeout))
                    return
                raw = await asyncio.wait_for(proc.readline(), _GRACE_S)
            raise SandboxError("the kernel died")
        except (Exception, asyncio.CancelledError):  # cannot resync: a fresh kernel next time
            await self._drop()

    async def _drop(self) -> None:
        proc, self._proc = self._proc, None
        self.history = []
        if proc is not None:
            await proc.kill()

    async def close(self) -> None:
        """Stop the kernel and everything it started. Idempotent."""
        async with self._lock:
            await self._drop()

    async def __aenter__(self) -> PythonInterpreter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _cancel_line(rid: int) -> bytes:
    return (json.dumps({"op": "cancel", "id": rid}) + "\n").encode()


# The type of each field a kernel's reply may carry. The snippet can write to the
# protocol pipe itself (it runs in a fork of the kernel, see the module docstring):
# a line of any other shape is treated as garbled, never trusted to be well formed.
_REPLY_FIELDS: dict[str, type | tuple[type, ...]] = {
    "id": int,
    "stdout": str,
    "stderr": str,
    "exit_code": int,
    "duration_s": (int, float),
    "timed_out": bool,
    "truncated": bool,
    "promoted": bool,
    "cancelled": bool,
    "cancel_ack": int,
}


def _decode(raw: bytes) -> dict:
    """One reply line as a dict whose known fields have their types; else SandboxError."""
    try:
        reply = json.loads(raw)
    except ValueError as e:
        raise SandboxError(f"the Python kernel sent a garbled line: {raw[:200]!r}") from e
    if not isinstance(reply, dict):
        raise SandboxError(f"the Python kernel sent a garbled line: {raw[:200]!r}")
    for name, kind in _REPLY_FIELDS.items():
        if name in reply and not isinstance(reply[name], kind):
            raise SandboxError(
                f"the Python kernel sent a malformed reply ({name} is "
                f"{type(reply[name]).__name__}): {raw[:200]!r}"
            )
    return reply


def _result(reply: dict) -> ExecResult:
    stderr = reply.get("stderr", "")
    if reply.get("timed_out"):
        stderr += "\n[interpreter] timed out: the snippet was killed and the state rolled back\n"
    elif not reply.get("promoted", True):
        stderr += (
            f"\n[interpreter] the snippet crashed (exit {reply.get('exit_code')}); "
            "the state rolled back to before it\n"
        )
    return ExecResult(
        stdout=reply.get("stdout", ""),
        stderr=stderr,
        exit_code=int(reply.get("exit_code", -1)),
        timed_out=bool(reply.get("timed_out")),
        oom_killed="MemoryError" in reply.get("stderr", "")[-2000:],
        truncated=bool(reply.get("truncated")),
        duration_s=float(reply.get("duration_s", 0.0)),
    )
