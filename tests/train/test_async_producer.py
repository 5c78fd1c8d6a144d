"""The asynchronous rollout producer on its own (no model, no trainer): syncs that changed
nothing, a close interrupted by a second Ctrl-C, a run whose workers are all gone."""

from __future__ import annotations

import torch

from agentrl.train.asynchronous import RolloutProducer
from agentrl.types import Node, RolloutTree


class _Counting:
    """A sampling policy stand-in that counts the weight copies ``refresh`` makes."""

    def __init__(self) -> None:
        self.version, self.copies = 0, 0

    def refresh(self, net, version) -> None:
        self.copies += 1
        self.version = version


def _tree(version: int) -> RolloutTree:
    tree = RolloutTree(meta={"seed": 0, "task": 0})
    tree.add(Node(action_ids=[1, 2], logprobs=[-1.0, -1.0], version=version))
    return tree


def test_a_sync_that_made_no_optimizer_step_copies_no_weights():
    """A step with no sample makes no optimizer step: the version stays, and so do the weights,
    so the sampler's refresh (a full copy of the model under its lock) is skipped."""
    policy = _Counting()
    producer = RolloutProducer(lambda s, p, m: ([_tree(p.version)], {}), policy, start=0, end=4,
                               max_batch_staleness=0, queue_size=1)
    net = torch.nn.Linear(1, 1)
    producer.synced(net, 0)  # no step: version 0 still
    assert policy.copies == 0
    producer.synced(net, 1)
    producer.synced(net, 1)
    assert policy.copies == 1 and producer.synced_steps == 3  # each sync still lets a step start


def test_a_second_ctrl_c_during_close_ends_the_wait_not_the_cleanup_after_it():
    """The trainer closes the producer, then its rollout source, on the way out of a Ctrl-C. A
    second Ctrl-C while close waits (up to 60 s) for a hung rollout raised out of close, and
    what the caller closes after it (the env workers' pools, the sandboxes) stayed open."""
    import os
    import signal
    import threading
    import warnings

    import pytest

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("a signal reaches the main thread only")
    release = threading.Event()

    def hung(step, policy, max_turns):  # a generate batch that no close can stop
        release.wait(30)
        return [_tree(0)], {}

    producer = RolloutProducer(hung, _Counting(), start=0, end=2, max_batch_staleness=0, queue_size=1).begin()
    after: list[str] = []
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer.start()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                producer.close(timeout=20)
                after.append("rollouts.close()")  # the trainer's next line
            except KeyboardInterrupt:
                after.append("raised out of close")
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, old)
        release.set()
        producer.thread.join(10)
    assert after == ["rollouts.close()"]
    assert any("Ctrl-C" in str(w.message) for w in seen)


def test_a_run_whose_workers_are_all_lost_stops_saying_so(monkeypatch):
    """Every rollout worker (or every env worker of a pool) lost for good: each later episode
    would fail, and the run went on step after step learning nothing. The producer hands the
    trainer an error naming the loss instead of the batch."""
    import pytest

    from agentrl.distributed import env_workers
    from agentrl.errors import RolloutError

    class LosesItsWorkers(_Counting):
        rolled = 0

        def workers_gone(self):
            return "every rollout worker is lost (2 of them); last: rollout worker 1 died" if self.rolled else None

    def rollout(step, policy, max_turns):
        policy.rolled += 1
        return [_tree(0)], {}

    producer = RolloutProducer(rollout, LosesItsWorkers(), start=0, end=3, max_batch_staleness=1,
                               queue_size=1).begin()
    try:
        with pytest.raises(RolloutError, match="every rollout worker is lost.*worker 1 died.*the run stops"):
            producer.take(0)
    finally:
        producer.close(timeout=10)

    class DeadPool:
        def gone(self):
            return "every env worker of agentrl/GuessNumber-v0 is lost"

    monkeypatch.setitem(env_workers._POOLS, ("test",), DeadPool())
    producer = RolloutProducer(lambda s, p, m: ([_tree(0)], {}), _Counting(), start=0, end=3,
                               max_batch_staleness=1, queue_size=1).begin()
    try:
        with pytest.raises(RolloutError, match="every env worker of agentrl/GuessNumber-v0 is lost"):
            producer.take(0)
    finally:
        producer.close(timeout=10)


def test_a_sampler_whose_close_raises_still_has_its_producer_stopped():
    """The sampler's close raising (a rollout worker's cluster gone) skipped the join and raised
    out of close: the trainer's next line, closing the rollout source, never ran."""
    import warnings

    class Breaks(_Counting):
        def close(self) -> None:
            raise RuntimeError("the cluster is gone")

    producer = RolloutProducer(lambda s, p, m: ([_tree(0)], {}), Breaks(), start=0, end=2,
                               max_batch_staleness=0, queue_size=1).begin()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        producer.close(timeout=10)
    assert not producer.thread.is_alive()
    assert any("the cluster is gone" in str(w.message) for w in seen)
