"""The async per-request path for backends whose native call is a batch.

``MicroBatcher`` gathers the ``agenerate`` calls pending on an event loop into
one ``generate(list)`` call, run on a single worker thread so the loop stays
free while the model works. Requests that arrive during a batch wait for the
next one, which takes everything pending; no request waits for a batch it
was not part of to be filled.

A failed batch is retried one request at a time, so a request that breaks
generation fails alone and the others still get their results.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .base import GenerateRequest, GenerateResult

__all__ = ["MicroBatcher"]

GenerateFn = Callable[[list[GenerateRequest]], list[GenerateResult]]


class MicroBatcher:
    """Turns concurrent ``submit(request)`` awaits into batched ``generate`` calls.

    ``max_batch`` caps the requests per ``generate`` call (the backend may
    split further). The batcher follows the running loop: a new loop (a fresh
    ``asyncio.run``) gets fresh queue state.
    """

    def __init__(self, generate: GenerateFn, max_batch: int = 256, name: str = "agentrl-generate"):
        self.generate = generate
        self.max_batch = max_batch
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[tuple[GenerateRequest, asyncio.Future[GenerateResult]]] = []
        self._worker: asyncio.Task[None] | None = None
        self.batches = 0
        self.batched_requests = 0

    @property
    def mean_batch(self) -> float:
        """Mean requests per ``generate`` call so far (batch occupancy)."""
        return self.batched_requests / self.batches if self.batches else 0.0

    async def submit(self, request: GenerateRequest) -> GenerateResult:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop, self._pending, self._worker = loop, [], None
        fut: asyncio.Future[GenerateResult] = loop.create_future()
        self._pending.append((request, fut))
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            await asyncio.sleep(0)  # let callers woken in this loop tick join the batch
            batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
            batch = [(r, f) for r, f in batch if not f.cancelled()]
            if not batch:
                continue
            self.batches += 1
            self.batched_requests += len(batch)
            results = await self._run(loop, [r for r, _ in batch])
            for (_, fut), res in zip(batch, results, strict=True):
                if fut.done():  # its episode timed out meanwhile
                    continue
                if isinstance(res, BaseException):
                    fut.set_exception(res)
                else:
                    fut.set_result(res)

    async def _run(self, loop: asyncio.AbstractEventLoop,
                   requests: list[GenerateRequest]) -> list[GenerateResult | BaseException]:
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

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
