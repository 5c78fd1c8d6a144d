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
