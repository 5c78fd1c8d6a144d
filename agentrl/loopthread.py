"""A private event loop on a daemon thread, so sync APIs can run coroutines even
when the caller already runs an event loop (a notebook, an async test).

The same loop serves every sync call of its owner, which matters because asyncio
subprocesses and locks belong to the loop that made them. Async code on another
loop reaches them with ``await LoopThread.arun(coro)``, which runs the
coroutine there and awaits its result without blocking the caller's loop.

Users: ``ToolEnv``'s sync ``reset``/``step`` (the process-wide ``shared_loop``,
so envs that share a sandbox pool share its loop) and the ``openai`` policy's
sync ``generate`` (a loop of its own).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread", "shared_loop"]

T = TypeVar("T")


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    if loop.is_closed():
        return
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    if not thread.is_alive():
        loop.close()


async def _exits_raise(coro: Coroutine[Any, Any, T]) -> T:
    """``coro``, with a ``sys.exit()`` (argparse on bad input) or a stray KeyboardInterrupt
    inside it raised as a RuntimeError: asyncio re-raises those two out of ``run_forever``,
    which ended the loop's thread, and every later call on the loop then waited for ever."""
    try:
        return await coro
    except SystemExit as e:
        raise RuntimeError(f"sys.exit({e.code!r}) was called on the loop thread") from None
    except KeyboardInterrupt:
        raise RuntimeError("KeyboardInterrupt was raised on the loop thread") from None


class LoopThread:
    """Runs coroutines to completion on one background loop, started on first use."""

    def __init__(self, name: str = "agentrl-loop"):
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()

    def _ensure(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name=self.name, daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
                self._finalizer = weakref.finalize(self, _stop, loop, thread)
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the background loop and return its result (blocking)."""
        if self._thread is not None and threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a sync API was called from its own loop; await the async API")
        loop = self._ensure()
        return asyncio.run_coroutine_threadsafe(_exits_raise(coro), loop).result()

    async def arun(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the background loop and await its result from the running loop.

        Cancelling the awaiting task cancels ``coro`` too. Called from the
        background loop itself, it simply awaits ``coro``.
        """
        loop = self._ensure()
        if asyncio.get_running_loop() is loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_exits_raise(coro), loop))

    def close(self) -> None:
        """Stop the loop and its thread; a later ``run`` starts a fresh one."""
        with self._lock:
            if self._finalizer is not None:
                self._finalizer()
            self._loop = self._thread = self._finalizer = None


_shared: LoopThread | None = None
_shared_lock = threading.Lock()


def shared_loop() -> LoopThread:
    """The process-wide loop that sync env APIs use, so that every env's asyncio
    objects (a shared ``SandboxPool``, say) live on the same loop."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = LoopThread("agentrl-sync")
        return _shared
