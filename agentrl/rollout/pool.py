"""Threads for env steps that never block exit or starve the rest (the engine's executor).

``ThreadPoolExecutor`` joins its threads at interpreter exit and has a fixed
size, so one env step that hangs forever would hold a worker for good and
keep the process alive. ``DaemonPool``'s workers are daemon threads, and a
new one starts whenever every worker is busy.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

__all__ = ["DaemonPool"]


class DaemonPool(Executor):
    """Threads for env steps that never block exit or starve the rest.

    ``ThreadPoolExecutor`` joins its threads at interpreter exit and has a
    fixed size, so one env step that hangs forever would hold a worker for
    good and keep the process alive. Here workers are daemon threads, and a
    new one starts whenever every worker is busy (a hung step costs a thread,
    nothing more); idle workers exit after ``idle_s``.
    """

    def __init__(self, name: str = "agentrl-env", idle_s: float = 30.0):
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = \
            queue.SimpleQueue()
        self._name, self._idle_s = name, idle_s
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = 0
        self._shut = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._lock:
            if self._shut:  # its workers are told to leave: it would wait in the queue for good
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._queue.put((fut, lambda: fn(*args, **kwargs), ()))
            if self._idle == 0:
                self._threads += 1
                threading.Thread(target=self._work, daemon=True,
                                 name=f"{self._name}-{self._threads}").start()
            else:
                self._idle -= 1
        return fut

    def _work(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # no submit counted on this worker: it may leave
                        self._idle -= 1
                        return
                continue
            if item is None:
                return
            fut, call, _ = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(call())
                except BaseException as e:
                    fut.set_exception(e)
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shut = True
            for _ in range(self._idle):
                self._queue.put(None)
