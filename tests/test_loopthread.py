"""The background loop survives what its coroutines raise."""

from __future__ import annotations

import asyncio
import sys

import pytest

from agentrl.loopthread import LoopThread


@pytest.mark.parametrize("stop", [lambda: sys.exit(2), lambda: (_ for _ in ()).throw(KeyboardInterrupt)])
def test_a_coroutine_that_exits_fails_alone_and_the_loop_serves_the_next_call(stop):
    """asyncio re-raises SystemExit and KeyboardInterrupt out of run_forever: the loop's thread
    died, and the next run() waited for ever on a loop no thread ran."""
    lt = LoopThread("test-loop")

    async def exits():
        stop()

    async def answer():
        return 42

    try:
        with pytest.raises(RuntimeError, match="on the loop thread"):
            lt.run(exits())
        assert lt._thread.is_alive()
        assert lt.run(answer()) == 42

        async def from_another_loop():
            with pytest.raises(RuntimeError, match="on the loop thread"):
                await lt.arun(exits())
            return await lt.arun(answer())

        assert asyncio.run(from_another_loop()) == 42
    finally:
        lt.close()
