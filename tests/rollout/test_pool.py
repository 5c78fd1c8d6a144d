"""The env-step thread pool (``agentrl.rollout.pool.DaemonPool``)."""

from __future__ import annotations

import time

import pytest

from agentrl.rollout.pool import DaemonPool


def test_a_submit_after_shutdown_is_refused_not_left_waiting():
    """An idle worker took the shutdown's stop and left; a later submit was counted on it and
    queued behind the stop, and its future never finished (an engine used after ``close``)."""
    pool = DaemonPool(idle_s=30)
    assert pool.submit(lambda: 1).result(timeout=5) == 1
    time.sleep(0.1)  # the worker is idle again
    pool.shutdown(wait=False)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: 2)


def test_an_engine_run_after_close_is_refused(tokenizer):
    import asyncio

    from agentrl.config import load_config
    from agentrl.policy import MockPolicy
    from agentrl.rollout import Engine

    engine = Engine(MockPolicy(tokenizer, ["1"]), load_config(), "agentrl/GuessNumber-v0")
    assert len(asyncio.run(engine.run([0]))) == 1
    engine.close()
    with pytest.raises(RuntimeError, match="this Engine is closed"):
        asyncio.run(engine.run([0]))
