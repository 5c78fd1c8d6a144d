"""The async per-request path for backends whose native call is a batch.

``MicroBatcher`` gathers the ``agenerate`` calls pending on an event loop into
one ``generate(list)`` call, run on a single worker thread so the loop stays
free while the model works. Requests that arrive during a batch wait for the
next one, which takes everything pending; no request waits for a batch it
was not part of to be filled.

Before a batch starts, the batcher lingers while requests keep arriving, for
at most ``max_wait_s``: episodes whose env steps end a moment apart then share
one forward pass instead of taking turns. On a backend whose batch takes
seconds, a few milliseconds of lingering cost nothing and can double the
batch.

A failed batch is retried one request at a time, so a request that breaks
generation fails alone and the others still get their results.

A cancelled ``submit`` leaves no work behind: a request still pending is
dropped, and one already in the running batch has its ``RequestControl``
cancelled (one is attached if the caller gave none), which ``hf`` honours at
its next decode step.

``close`` fails every request not yet running with a ``PolicyError``, on
every loop, and refuses later ones; a batch already running finishes.

A backend's own ``generate`` method is held by weak reference: the backend
holds its batcher, and a strong reference back would make the pair a cycle
that only the cyclic garbage collector frees, keeping a finished run's model
and caches in memory until it happens to run.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import PolicyError
from .base import GenerateRequest, GenerateResult, RequestControl

__all__ = ["MicroBatcher"]

GenerateFn = Callable[[list[GenerateRequest]], list[GenerateResult]]


@dataclass
class _Queue:
    """One event loop's pending requests and the task that drains them."""

    pending: list[tuple[GenerateRequest, asyncio.Future[GenerateResult]]] = field(default_factory=list)
    worker: asyncio.Task[None] | None = None


class MicroBatcher:
    """Turns concurrent ``submit(request)`` awaits into batched ``generate`` calls.

    ``max_batch`` caps the requests per ``generate`` call (the backend may
    split further). Each event loop that submits gets its own queue (an engine
    and an in-process proxy may run on two loops); their batches take turns on
    the one generate thread.
    """

    def __init__(self, generate: GenerateFn, max_batch: int = 256, name: str = "agentrl-generate",
                 max_wait_s: float = 0.02, quiet_s: float = 0.002):
        bad = [f"{k}={v!r} ({rule})" for k, v, ok, rule in (
            ("max_batch", max_batch, isinstance(max_batch, int) and max_batch >= 1, "an int >= 1"),
            ("max_wait_s", max_wait_s, 0 <= max_wait_s < math.inf, "finite, >= 0: it bounds the linger"),
            ("quiet_s", quiet_s, quiet_s >= 0, ">= 0"),
        ) if not ok]
        if bad:  # max_batch=0 took empty batches forever: every submit hung
            raise PolicyError("invalid MicroBatcher settings: " + ", ".join(bad))
        self._generate: Callable[[], GenerateFn | None] = (
            weakref.WeakMethod(generate) if inspect.ismethod(generate) else lambda: generate)
        self.max_batch = max_batch
        self.max_wait_s, self.quiet_s = max_wait_s, quiet_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Queue] = weakref.WeakKeyDictionary()
        self.batches = 0
        self.batched_requests = 0
        self.closed = False

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """The backend's ``generate``; ``PolicyError`` once the batcher is closed or the backend gone."""
        fn = self._generate()
        if fn is None or self.closed:
            raise PolicyError("the policy of this batcher was closed")
        return fn(requests)

    @property
    def mean_batch(self) -> float:
        """Mean requests per ``generate`` call so far (batch occupancy)."""
        return self.batched_requests / self.batches if self.batches else 0.0

    async def submit(self, request: GenerateRequest) -> GenerateResult:
        if self.closed:
            raise PolicyError("the policy of this batcher was closed")
        loop = asyncio.get_running_loop()
        q = self._queues.get(loop)
        if q is None:
            q = self._queues[loop] = _Queue()
        control = request.control or RequestControl()
        if request.control is None:
            request = replace(request, control=control)
        fut: asyncio.Future[GenerateResult] = loop.create_future()
        q.pending.append((request, fut))
        if q.worker is None or q.worker.done():
            q.worker = loop.create_task(self._drain(q))
        try:
            return await fut
        except asyncio.CancelledError:
            control.cancel()  # in the running batch: the backend drops the row
            raise

    async def _drain(self, q: _Queue) -> None:
        try:
            await self._drain_pending(q)
        finally:
            # A finished task holds its loop: kept in the queue, it would keep every loop that
            # ever submitted alive (the queues are weakly keyed by loop), with its futures.
            if q.worker is asyncio.current_task():
                q.worker = None

    async def _drain_pending(self, q: _Queue) -> None:
        loop = asyncio.get_running_loop()
        while q.pending:
            await self._linger(loop, q)
            batch, q.pending = q.pending[:self.max_batch], q.pending[self.max_batch:]
            batch = [(r, f) for r, f in batch if not f.cancelled()]
            if not batch:
                continue
            self.batches += 1
            self.batched_requests += len(batch)
            results = await self._run(loop, [r for r, _ in batch])
            if len(results) != len(batch):  # a backend bug: fail the batch, not the batcher
                err = RuntimeError(f"generate returned {len(results)} results for {len(batch)} requests")
                results = [err] * len(batch)
            for (_, fut), res in zip(batch, results, strict=True):
                if fut.done():  # its episode timed out meanwhile
                    continue
                if isinstance(res, BaseException):
                    fut.set_exception(res)
                else:
                    fut.set_result(res)

    async def _linger(self, loop: asyncio.AbstractEventLoop, q: _Queue) -> None:
        """Wait while requests keep arriving: until ``quiet_s`` passes with none, or ``max_wait_s``."""
        await asyncio.sleep(0)  # callers woken in this loop tick join at once
        start = seen = loop.time()
        count = len(q.pending)
        while len(q.pending) < self.max_batch and loop.time() - start < self.max_wait_s:
            await asyncio.sleep(self.quiet_s / 2)
            if len(q.pending) > count:
                count, seen = len(q.pending), loop.time()
            elif loop.time() - seen >= self.quiet_s:
                break

    async def _run(self, loop: asyncio.AbstractEventLoop,
                   requests: list[GenerateRequest]) -> list[GenerateResult | BaseException]:
        if self.closed:  # the pool takes no more work
            return [PolicyError("the policy of this batcher was closed") for _ in requests]
        try:
            return list(await loop.run_in_executor(self._pool, self.generate, requests))
        except Exception as e:
            if len(requests) == 1:
                return [e]
        out: list[Any] = []
        for r in requests:  # find the request(s) that broke the batch
            try:
                out += await loop.run_in_executor(self._pool, self.generate, [r])
            except Exception as e:
                out.append(e)
        return out

    def wait_idle(self, timeout: float | None = None) -> None:
        """Block until every ``generate`` call queued so far has finished (they run in order
        on one thread); raises ``TimeoutError`` after ``timeout`` seconds."""
        self._pool.submit(lambda: None).result(timeout)

    def close(self) -> None:
        # Queued batches are not cancelled: another loop awaits each, and a cancelled one ended
        # that loop's drain task with its requests unanswered (they hung). They run, and fail
        # at once in ``generate``.
        self.closed = True
        self._pool.shutdown(wait=False)
