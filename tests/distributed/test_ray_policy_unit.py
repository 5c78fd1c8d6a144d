"""Worker bookkeeping that needs no cluster: what ``RayPolicy.close`` lets go of, when the workers are gone, what a pool shutdown kills."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("ray", reason="ray is not installed here: pip install 'agentrl[ray]' (make extras)")

from agentrl.distributed.rollout_workers import RayPolicy  # noqa: E402
from agentrl.errors import PolicyError  # noqa: E402


def _bare_policy(workers: int = 0) -> RayPolicy:
    """A RayPolicy's state without its actors (``__init__`` would start them)."""
    p = object.__new__(RayPolicy)
    p.workers, p._closed, p._dead, p._stale = [object()] * workers, False, set(), set()
    p._state_lock, p._push_lock = threading.Lock(), threading.Lock()
    p._weights_ref = object()  # what update_weights put in the object store
    p.model = None
    return p


def test_close_lets_go_of_the_last_weights(monkeypatch):
    """The object store holds the last pushed weights while a reference to them lives: a
    closed policy kept it until the policy itself was garbage-collected."""
    p = _bare_policy()
    p.close()
    assert p._weights_ref is None
    with pytest.raises(PolicyError, match="closed"):  # a push after close would put them back
        p.update_weights({})
    assert p._weights_ref is None


def test_workers_gone_says_why_once_every_worker_is_lost():
    p = _bare_policy(workers=2)
    p._max_restarts = 3
    p._dead = {0}
    assert p.workers_gone() is None  # one still serves
    p._dead, p._lost_reason = {0, 1}, "rollout worker 1 died or is unreachable (ActorDiedError: killed)"
    assert p.workers_gone() == ("every rollout worker is lost (2 of them; Ray restarts a worker "
                                "distributed.max_restarts=3 times); last: rollout worker 1 died or "
                                "is unreachable (ActorDiedError: killed)")


def test_a_pool_shutdown_kills_every_worker_when_one_kill_fails(monkeypatch):
    """``ray.kill`` raises for a worker its cluster cannot reach any more (its node lost): the
    workers after it in the list were left running, holding their CPUs and envs."""
    import ray

    from agentrl.distributed.env_workers import EnvWorkerPool

    killed: list[str] = []

    def kill(worker):
        if worker == "unreachable":
            raise ValueError("the actor's node is gone")
        killed.append(worker)

    monkeypatch.setattr(ray, "kill", kill)
    monkeypatch.setattr(ray, "wait", lambda refs, **kw: (refs, []))
    pool = object.__new__(EnvWorkerPool)
    pool.workers = ["unreachable", "w1", "w2"]  # close_all.remote fails on these too: skipped
    with pytest.raises(ValueError, match="node is gone"):  # said, once the others are killed
        pool.shutdown(close_wait_s=0)
    assert killed == ["w1", "w2"]
