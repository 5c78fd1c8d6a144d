"""SandboxPool: warm leases, reset between episodes, replacement, lifetime, leak reclaim."""

from __future__ import annotations

import asyncio
import gc
import shutil

import pytest

from agentrl.errors import SandboxError
from agentrl.sandboxes import LocalSandbox, SandboxPool

pytestmark = pytest.mark.anyio


class Episode:
    """Any weak-referenceable object can own a lease."""


async def test_lease_resets_between_episodes():
    async with SandboxPool(LocalSandbox, size=1) as pool:
        assert pool.idle == 1
        async with pool.lease() as sb:
            await sb.write_file("left-behind.txt", "x")
        async with pool.lease() as again:
            assert again is sb  # warm: the same sandbox, reused
            assert (await again.run("ls -A")).stdout == ""
        assert pool.stats.created == 1


async def test_dead_sandbox_is_replaced_on_acquire():
    async with SandboxPool(LocalSandbox, size=1) as pool:
        first = await pool.acquire()
        await pool.release(first)
        shutil.rmtree(first.workdir)  # killed from outside while idle
        second = await pool.acquire()
        assert second is not first
        assert (await second.run("echo ok")).stdout == "ok\n"
        assert pool.stats.replaced == 1
        await pool.release(second)


async def test_max_uses_and_lifetime_retire_sandboxes():
    async with SandboxPool(LocalSandbox, size=1, max_uses=2) as pool:
        seen = []
        for _ in range(3):
            async with pool.lease() as sb:
                seen.append(sb)
        assert seen[0] is seen[1] and seen[2] is not seen[0]
    async with SandboxPool(LocalSandbox, size=1, max_lifetime_s=0.0) as pool:
        a = await pool.acquire()
        await pool.release(a)
        b = await pool.acquire()
        assert b is not a
        await pool.release(b)


async def test_leaked_lease_is_reclaimed_by_end_episode_and_by_gc():
    async with SandboxPool(LocalSandbox, size=2) as pool:
        await pool.acquire(episode="ep-1")
        assert pool.leased == 1
        assert await pool.end_episode("ep-1") == 1
        assert pool.leased == 0
        episode = Episode()
        await pool.acquire(episode=episode)
        del episode
        gc.collect()
        for _ in range(100):
            if pool.leased == 0:
                break
            await asyncio.sleep(0.05)
        assert pool.leased == 0
        assert pool.stats.reclaimed == 2


async def test_exhausted_pool_times_out_with_advice():
    async with SandboxPool(LocalSandbox, size=1, acquire_timeout=0.3) as pool:
        held = await pool.acquire()
        with pytest.raises(SandboxError, match="pool size"):
            await pool.acquire()
        await pool.release(held)


async def test_waiter_gets_the_sandbox_when_released():
    async with SandboxPool(LocalSandbox, size=1) as pool:
        held = await pool.acquire()
        waiter = asyncio.create_task(pool.acquire())
        await asyncio.sleep(0.1)
        assert not waiter.done()
        await pool.release(held)
        got = await asyncio.wait_for(waiter, 30)
        assert got is held
        await pool.release(got)


async def test_close_closes_leased_and_idle():
    pool = SandboxPool(LocalSandbox, size=2)
    await pool.start()
    leased = await pool.acquire()
    await pool.close()
    assert pool.total == 0
    with pytest.raises(SandboxError):
        await leased.run("true")
    with pytest.raises(SandboxError):
        await pool.acquire()
