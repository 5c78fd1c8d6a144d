"""``SandboxPool``: warm sandboxes leased per episode.

- ``size`` sandboxes at most; ``start()`` warms ``warm`` of them up front.
- ``lease(episode=...)`` is an async context manager; ``acquire``/``release``
  are the explicit pair. A returned sandbox is ``reset()`` before reuse.
- On acquire a sandbox is health-checked (``Sandbox.healthy``); a dead one, one
  older than ``max_lifetime_s``, or one used ``max_uses`` times is closed and
  replaced.
- A leaked lease (the episode ended without releasing) is reclaimed by
  ``end_episode(episode)``, or automatically when the episode object is garbage
  collected (a ``weakref.finalize`` on it, where it can be weakly referenced).
- A sandbox that fails to start, or whose start, health check or reset is
  cancelled, is closed, never dropped; its place goes to the next waiter.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl.errors import SandboxError

from .base import Sandbox

__all__ = ["PoolStats", "SandboxPool"]


@dataclass(slots=True)
class _Slot:
    sandbox: Sandbox
    born: float = field(default_factory=time.monotonic)
    uses: int = 0
    episode: Any = None
    finalizer: weakref.finalize | None = None


@dataclass(slots=True)
class PoolStats:
    created: int = 0
    replaced: int = 0  # closed because dead, too old, used up, or failed reset
    reclaimed: int = 0  # leaked leases taken back
    leases: int = 0  # acquires served so far


class SandboxPool:
    """Keep up to ``size`` sandboxes from ``factory``; lease them out one episode at a time."""

    def __init__(
        self,
        factory: Callable[[], Sandbox],
        size: int = 4,
        warm: int | None = None,
        max_lifetime_s: float = 3600.0,
        max_uses: int | None = None,
        health_check: bool = True,
        acquire_timeout: float = 300.0,
    ) -> None:
        if size < 1:
            raise ValueError("SandboxPool size must be at least 1")
        self._factory, self.size = factory, size
        self.warm = size if warm is None else min(warm, size)
        self.max_lifetime_s, self.max_uses = max_lifetime_s, max_uses
        self.health_check, self.acquire_timeout = health_check, acquire_timeout
        self._idle: list[_Slot] = []
        self._leased: dict[int, _Slot] = {}  # id(sandbox) -> slot
        self._creating = 0
        self._cond: asyncio.Condition | None = None
        self._closed = False
        self._tasks: set[asyncio.Task] = set()  # reclaims in flight (kept from GC)
        self.stats = PoolStats()

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:  # created lazily: it binds to the running loop
            self._cond = asyncio.Condition()
        return self._cond

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def leased(self) -> int:
        return len(self._leased)

    @property
    def total(self) -> int:
        return len(self._idle) + len(self._leased) + self._creating

    async def start(self) -> None:
        """Create the warm sandboxes now, in parallel; raises the first failure, if any,
        once the others are in the pool."""
        need = max(0, self.warm - self.total)
        made = await asyncio.gather(*(self._create() for _ in range(need)), return_exceptions=True)
        async with self._condition():
            self._idle.extend(m for m in made if isinstance(m, _Slot))
            self._condition().notify_all()
        for failure in made:
            if isinstance(failure, BaseException):
                raise failure

    async def _create(self) -> _Slot:
        self._creating += 1
        sandbox = None
        try:
            sandbox = self._factory()
            await sandbox.start()
        except BaseException:  # failed or cancelled: it may hold part of what it started
            self._creating -= 1
            if sandbox is not None:
                await self._close_quietly(sandbox)
            async with self._condition():  # its place is free: a waiter may create one
                self._condition().notify_all()
            raise
        self._creating -= 1
        self.stats.created += 1
        return _Slot(sandbox)

    def _expired(self, slot: _Slot) -> bool:
        too_old = time.monotonic() - slot.born > self.max_lifetime_s
        return too_old or (self.max_uses is not None and slot.uses >= self.max_uses)

    async def _discard(self, slot: _Slot) -> None:
        self.stats.replaced += 1
        await self._close_quietly(slot.sandbox)

    @staticmethod
    async def _close_quietly(sandbox: Sandbox) -> None:
        # Shielded: a second cancel must not leave it running. It is being thrown away, so
        # a failure to close changes nothing.
        with contextlib.suppress(Exception):
            await asyncio.shield(sandbox.close())

    async def _take(self, deadline: float) -> _Slot:
        cond = self._condition()
        async with cond:
            while True:
                if self._closed:
                    raise SandboxError("the sandbox pool is closed")
                if self._idle:
                    return self._idle.pop()
                if self.total < self.size:
                    self._creating += 1  # reserve the place before creating outside the lock
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SandboxError(
                        f"no sandbox free within {self.acquire_timeout:.0f}s (pool size "
                        f"{self.size}); release leases or raise the pool size"
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(cond.wait(), left)
        self._creating -= 1
        return await self._create()

    async def acquire(self, episode: Any = None) -> Sandbox:
        """Lease a healthy sandbox, optionally tied to ``episode`` (an id or an object)."""
        deadline = time.monotonic() + self.acquire_timeout
        while True:
            slot = await self._take(deadline)
            # A sandbox started a moment ago is neither stale nor dead: skip its checks.
            fresh = slot.uses == 0 and time.monotonic() - slot.born < 1.0
            stale = slot.uses > 0 and self._expired(slot)
            try:
                usable = not stale and (
                    fresh or not self.health_check or await slot.sandbox.healthy()
                )
            except BaseException:  # cancelled mid-check: it is neither leased nor idle
                await self._give_back(slot, keep=False)
                raise
            if not usable:
                await self._discard(slot)
                continue
            slot.uses += 1
            self._leased[id(slot.sandbox)] = slot
            slot.finalizer = _finalizer_for(episode, self, slot.sandbox)
            # Hold an episode object only weakly, or it could never be collected.
            slot.episode = weakref.ref(episode) if slot.finalizer else episode
            self.stats.leases += 1
            return slot.sandbox

    async def release(self, sandbox: Sandbox, discard: bool = False) -> None:
        """Return ``sandbox``: reset and keep it, or close it when ``discard`` or reset fails."""
        slot = self._leased.pop(id(sandbox), None)
        if slot is None:
            return  # already returned or reclaimed
        if slot.finalizer is not None:
            slot.finalizer.detach()
        slot.episode = None
        keep = not discard and not self._closed and not self._expired(slot)
        if keep:
            try:
                await sandbox.reset()
            except Exception:  # a sandbox that cannot reset is replaced, not reused
                keep = False
            except BaseException:  # cancelled mid-reset: closed, never lost
                await self._give_back(slot, keep=False)
                raise
        await self._give_back(slot, keep)

    async def _give_back(self, slot: _Slot, keep: bool) -> None:
        """Put an unleased ``slot`` back in the pool, or close it; wake the waiters."""
        keep = keep and not self._closed
        if not keep:
            await self._discard(slot)
        async with self._condition():
            if keep:
                self._idle.append(slot)
            self._condition().notify_all()

    async def end_episode(self, episode: Any) -> int:
        """Reclaim every lease still held by ``episode``; returns how many there were."""
        leaked = [s.sandbox for s in list(self._leased.values()) if _held_by(s, episode)]
        for sandbox in leaked:
            self.stats.reclaimed += 1
            await self.release(sandbox)
        return len(leaked)

    @contextlib.asynccontextmanager
    async def lease(self, episode: Any = None) -> AsyncIterator[Sandbox]:
        """``async with pool.lease() as sandbox:`` — released (and reset) on exit."""
        sandbox = await self.acquire(episode)
        try:
            yield sandbox
        finally:
            # Also on failure: reset decides whether a possibly wrecked sandbox is kept.
            await asyncio.shield(self.release(sandbox))

    async def close(self) -> None:
        """Close every sandbox, leased or idle. Idempotent."""
        self._closed = True
        slots = self._idle + list(self._leased.values())
        self._idle, self._leased = [], {}
        for slot in slots:
            if slot.finalizer is not None:
                slot.finalizer.detach()
        await asyncio.gather(*(s.sandbox.close() for s in slots), return_exceptions=True)
        async with self._condition():
            self._condition().notify_all()

    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _held_by(slot: _Slot, episode: Any) -> bool:
    if isinstance(slot.episode, weakref.ref):
        return slot.episode() is episode
    return episode is not None and slot.episode == episode


def _finalizer_for(episode: Any, pool: SandboxPool, sandbox: Sandbox) -> weakref.finalize | None:
    """When ``episode`` is garbage collected with the lease still out, give it back."""
    try:
        loop = asyncio.get_running_loop()
        pool_ref = weakref.ref(pool)

        def reclaim() -> None:
            p = pool_ref()
            if p is None or loop.is_closed():
                return

            def schedule() -> None:
                if id(sandbox) in p._leased:
                    p.stats.reclaimed += 1
                    task = loop.create_task(p.release(sandbox))
                    p._tasks.add(task)
                    task.add_done_callback(p._tasks.discard)

            loop.call_soon_threadsafe(schedule)

        return weakref.finalize(episode, reclaim)
    except TypeError:  # ids like str/int cannot be weakly referenced: use end_episode
        return None
