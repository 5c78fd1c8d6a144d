"""Asynchronous training in one process: k=0 is the synchronous run, k=1 overlaps, stale
batches are dropped and replaced, the sampler's weights are a snapshot, a batch that never
comes fails loudly, and errors and resumes are clean."""

from __future__ import annotations

import json
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from agentrl.errors import ConfigError
from agentrl.models import load_model
from agentrl.policy import GenerateRequest, HFPolicy, SamplingParams
from agentrl.policy.snapshot import SnapshotPolicy
from agentrl.train.asynchronous import RolloutProducer, may_start, staleness_stats
from agentrl.train.config import load_train_config
from agentrl.train.step import Learner
from agentrl.train.trainer import Trainer, step_task_seeds, train
from agentrl.types import Node, RolloutTree
from tests.train.test_trainer import toy_config

# Deterministic sampling: a row's logprobs do not depend on what the prefix cache holds, and
# the snapshot's cache starts empty where the synchronous policy's holds the start eval's.
FAST = ["rollout.deterministic=true", "train.output.plot=false", "train.output.save_trees=0", "train.evaluation.episodes=4"]


def _async(k: int, queue_size: int = 1) -> str:
    return f"train.asynchronous={{max_batch_staleness: {k}, queue_size: {queue_size}}}"


def _rl_rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("phase") == "rl"]


def _producer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "agentrl-rollout-producer" and t.is_alive()]


def test_k0_repeats_the_synchronous_run_exactly(tmp_path):
    torch.set_num_threads(1)
    run = [*FAST, "train.steps=3", "train.evaluation.every=1", "train.checkpointing.every=1"]  # eval overlaps rollouts
    sync = train(toy_config(tmp_path / "sync", *run), progress=False)
    asyn = train(toy_config(tmp_path / "async", *run, _async(0)), progress=False)
    assert asyn["phases"] == sync["phases"]
    a, b = _rl_rows(tmp_path / "sync"), _rl_rows(tmp_path / "async")
    assert [r["step"] for r in b] == [1, 2, 3]
    skip = ("time/", "memory/", "async/", "train/tokens_per_s")
    for x, y in zip(a, b, strict=True):
        same = {k: v for k, v in x.items() if not k.startswith(skip)}
        assert {k: y[k] for k in same} == same  # same tasks, rollouts, losses: bit for bit
        assert y["async/staleness_max"] == 0 and y["async/dropped_batches"] == 0


def test_k1_rolls_out_the_next_step_while_this_one_trains(tmp_path, monkeypatch):
    """Step s's update waits until step s+1's rollout has finished: a run that cannot overlap
    them would time out here. Step s+1 then trains one version after the weights sampling it."""
    torch.set_num_threads(1)
    events: list[tuple[str, int]] = []
    rolled = {s: threading.Event() for s in range(4)}
    samplers: list[object] = []
    rollout, learn = Trainer.rollout, Learner.learn

    def gated_rollout(self, step, bars, policy=None, max_turns=None):
        events.append(("rollout", step))
        samplers.append(policy)
        out = rollout(self, step, bars, policy, max_turns)
        rolled[step].set()
        return out

    def gated_learn(self, trees, step, bars):
        if step + 1 < self.cfg.train.steps:
            assert rolled[step + 1].wait(60), f"step {step + 2} did not roll out while step {step + 1} trained"
        events.append(("learn", step))
        return learn(self, trees, step, bars)

    monkeypatch.setattr(Trainer, "rollout", gated_rollout)
    monkeypatch.setattr(Learner, "learn", gated_learn)
    train(toy_config(tmp_path, *FAST, "train.steps=3", "train.evaluation.episodes=0", _async(1)), progress=False)
    assert events == [("rollout", 0), ("rollout", 1), ("learn", 0), ("rollout", 2), ("learn", 1), ("learn", 2)]
    assert all(isinstance(p, SnapshotPolicy) for p in samplers)  # never the trained model's policy
    rows = _rl_rows(tmp_path)
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1]
    assert all(r["async/dropped_batches"] == 0 for r in rows)
    assert [r["data/first_task_seed"] for r in rows] == [0, 4, 8]
    assert [r["policy/version"] for r in rows] == [1, 2, 3]


class _Versioned:
    """A sampling policy stand-in: its version moves only on ``refresh``."""

    def __init__(self) -> None:
        self.version = 0

    def refresh(self, net, version) -> None:
        self.version = version


def _tree(version: int) -> RolloutTree:
    tree = RolloutTree(meta={"seed": 0, "task": 0})
    tree.add(Node(action_ids=[1, 2], logprobs=[-1.0, -1.0], version=version))
    return tree


def _wait_until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_producer_may_run_k_batches_ahead_and_one_more_per_dropped_batch():
    # k = 0: batch n waits for n syncs; after one drop, batch 2 needs only 1 sync
    assert may_start(0, synced=0, dropped=0, k=0)
    assert not may_start(1, synced=0, dropped=0, k=0) and may_start(1, synced=1, dropped=0, k=0)
    assert not may_start(2, synced=1, dropped=0, k=0) and may_start(2, synced=1, dropped=1, k=0)
    # k = 2: three batches before any sync
    assert may_start(2, synced=0, dropped=0, k=2) and not may_start(3, synced=0, dropped=0, k=2)


def test_a_stale_batch_is_dropped_and_replaced_without_waiting_for_a_sync(tmp_path, monkeypatch):
    """k = 0 and one batch comes back one version stale (a sampler that missed a sync): the
    trainer drops it, the producer rolls out the next step in its place at once (no sync can
    come while the trainer waits for a batch), and the run ends with every step trained."""
    import agentrl.rollout

    torch.set_num_threads(1)
    cfg = toy_config(tmp_path, *FAST, "train.steps=3", "train.evaluation.episodes=0", _async(0),
                     "train.asynchronous.batch_timeout_s=120")
    stale_seeds = step_task_seeds(cfg.train, 1)
    collect = agentrl.rollout.collect

    def one_stale_batch(env_id, policy, cfg, seeds, *args, **kwargs):
        trees = collect(env_id, policy, cfg, seeds, *args, **kwargs)
        if seeds == stale_seeds:  # step 2's data, sampled under version 1: stamped version 0
            for t in trees:
                for n in t.nodes.values():
                    n.version -= 1
        return trees

    monkeypatch.setattr(agentrl.rollout, "collect", one_stale_batch)
    done: list[dict] = []
    run = threading.Thread(target=lambda: done.append(train(cfg, progress=False)), daemon=True)
    run.start()
    run.join(300)  # a deadlock would hold it here (the bounded take() ends it after 120 s)
    assert done, "the run did not finish"
    rows = _rl_rows(tmp_path)
    assert [r["async/data_step"] for r in rows] == [0, 2, 3]  # step 2's data dropped, step 3's in its place
    assert [r["async/dropped_batches"] for r in rows] == [0, 1, 1]
    assert [r["policy/version"] for r in rows] == [1, 2, 3]
    assert all(r["async/staleness_max"] == 0 for r in rows)


def test_take_fails_naming_what_the_producer_does_when_no_batch_comes():
    """A rollout that never returns (a hung generate) fails the trainer's take() after
    batch_timeout_s, with the key to raise and the step being rolled out."""
    release = threading.Event()

    def hung(step, policy, max_turns):
        release.wait(60)
        raise RuntimeError("released")

    producer = RolloutProducer(hung, object(), start=4, end=8, max_batch_staleness=1, queue_size=1,
                               batch_timeout_s=0.3).begin()
    try:
        with pytest.raises(TimeoutError, match=r"train\.asynchronous\.batch_timeout_s.*rolling out step 5"):
            producer.take(0)
    finally:
        release.set()
        producer.close(timeout=30)
    assert not producer.thread.is_alive()


def test_each_sync_hands_the_next_rollouts_their_turn_cap():
    """TurnOPD's depth budget reaches the producer with the sync, never read across threads."""
    caps: list[int | None] = []

    def rollout(step, policy, max_turns):
        caps.append(max_turns)
        return [_tree(policy.version)], {}

    producer = RolloutProducer(rollout, _Versioned(), start=0, end=3, max_batch_staleness=0, queue_size=1,
                               max_turns=5).begin()
    try:
        producer.take(0)
        producer.synced(torch.nn.Linear(1, 1), 1, max_turns=2)
        producer.take(1)
        producer.synced(torch.nn.Linear(1, 1), 2, max_turns=None)
        producer.take(2)
    finally:
        producer.close()
    assert caps == [5, 2, None]


def test_staleness_is_counted_per_action_token():
    a, b = _tree(3), _tree(1)
    b.nodes[0].action_ids = [5, 6, 7, 8, 9, 10]
    assert staleness_stats([a, b], 3) == {"async/staleness_mean": 1.5, "async/staleness_max": 2}


def _reply(policy: HFPolicy) -> tuple[list[int], list[float]]:
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=7)
    out = policy.generate([GenerateRequest(list(range(20, 40)), params)])[0]
    return out.token_ids, out.logprobs


def test_the_snapshot_samples_the_old_weights_until_the_sync(tokenizer):
    torch.manual_seed(0)
    model, _ = load_model("tiny-random")
    live = HFPolicy(model, tokenizer)
    snap = SnapshotPolicy.of(live)
    before = _reply(snap)
    assert before == _reply(live) and snap.version == live.version == 0
    with torch.no_grad():  # an optimizer step in place on the trained model
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    live.weights_updated()
    after = _reply(live)
    assert after[1] != before[1]
    assert _reply(snap) == before and snap.version == 0  # isolated until the sync

    snap.weights_lock.acquire()  # a batch is sampling: the refresh waits for it to end
    refresh = threading.Thread(target=snap.refresh, args=(model, live.version))
    refresh.start()
    refresh.join(0.2)
    assert refresh.is_alive() and snap.version == 0
    snap.weights_lock.release()
    refresh.join(30)
    assert snap.version == live.version == 1
    assert _reply(snap) == after
    snap.close()


def test_a_trainer_error_mid_run_ends_the_producer(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    learn = Learner.learn

    def failing_learn(self, trees, step, bars):
        if step == 1:
            raise RuntimeError("boom in step 2")
        return learn(self, trees, step, bars)

    monkeypatch.setattr(Learner, "learn", failing_learn)
    with pytest.raises(RuntimeError, match="boom in step 2"):
        train(toy_config(tmp_path, *FAST, "train.steps=4", "train.evaluation.episodes=0", _async(1, 2)),
              progress=False)
    assert _producer_threads() == []


def test_resume_with_async_starts_a_fresh_producer_and_repeats_the_run(tmp_path, monkeypatch):
    """k=0 is exact, so a run stopped in step 3 and resumed equals the uninterrupted one."""
    torch.set_num_threads(1)
    run = [*FAST, "train.steps=4", "train.checkpointing.every=1", "train.evaluation.episodes=0", "train.optimizer.lr=1e-3", _async(0)]
    train(toy_config(tmp_path / "straight", *run), progress=False)
    learn = Learner.learn

    def dies_in_step_3(self, trees, step, bars):
        if step == 2:
            raise RuntimeError("killed in step 3")
        return learn(self, trees, step, bars)

    monkeypatch.setattr(Learner, "learn", dies_in_step_3)
    with pytest.raises(RuntimeError, match="killed in step 3"):
        train(toy_config(tmp_path / "stopped", *run), progress=False)
    assert _producer_threads() == []
    monkeypatch.setattr(Learner, "learn", learn)
    train(toy_config(tmp_path / "stopped", *run), resume=True, progress=False)
    a, b = _rl_rows(tmp_path / "straight"), _rl_rows(tmp_path / "stopped")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a[2:], b[2:], strict=True):
        assert y["async/data_step"] == x["async/data_step"] == y["step"] - 1
        assert y["loss/total"] == x["loss/total"] != 0.0
        assert y["rollout/reward"] == x["rollout/reward"]
        assert y["policy/version"] == y["step"]


@pytest.mark.parametrize(("overrides", "key"), [
    ([_async(-1)], "train.asynchronous.max_batch_staleness"),
    (["train.asynchronous={queue_size: 0}"], "train.asynchronous.queue_size"),
    (["policy.backend=mock", _async(1)], "train.asynchronous samples from a copy"),
    (["train.harness=python agent.py", _async(1)], "train: asynchronous needs native rollouts"),
])
def test_an_async_config_that_cannot_work_is_refused_naming_its_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_train_config(None, overrides)
    assert key in str(err.value)


def test_the_old_name_max_staleness_still_works_for_one_release_with_a_warning():
    with pytest.warns(FutureWarning, match=r"train\.asynchronous\.max_staleness is deprecated.*"
                                           r"use train\.asynchronous\.max_batch_staleness"):
        old = load_train_config(None, ["train.asynchronous={max_staleness: 0}"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = load_train_config(None, ["train.asynchronous={max_batch_staleness: 0}"])
    assert old.train.asynchronous == new.train.asynchronous and new.train.asynchronous.max_batch_staleness == 0
    with pytest.raises(ConfigError, match=r"train\.asynchronous\.max_staleness is the old name of "
                                          r"train\.asynchronous\.max_batch_staleness"):
        load_train_config(None, ["train.asynchronous={max_staleness: 0, max_batch_staleness: 1}"])


def test_async_off_is_the_default():
    assert load_train_config(None, []).train.asynchronous is None


def test_a_rollout_that_raises_fails_the_trainers_take_with_its_error():
    def boom(step: int, policy: object, max_turns: int | None) -> tuple:
        raise RuntimeError(f"env exploded at step {step}")

    producer = RolloutProducer(boom, object(), start=0, end=3, max_batch_staleness=1, queue_size=1).begin()
    with pytest.raises(RuntimeError, match="env exploded at step 0"):
        producer.take(0)
    producer.close(timeout=10)
    assert not producer.thread.is_alive()


def test_close_during_a_rollout_stops_the_sampler_and_the_thread():
    """close() closes the sampler, which fails the running rollout's requests; the thread ends."""
    started, stopped = threading.Event(), threading.Event()

    class Sampler:
        def close(self) -> None:
            stopped.set()

    def rollout(step: int, policy: object, max_turns: int | None) -> tuple:
        started.set()
        if not stopped.wait(30):  # a generate batch that only the sampler's close ends
            raise AssertionError("close() did not close the sampler")
        raise RuntimeError("sampling stopped")

    producer = RolloutProducer(rollout, Sampler(), start=0, end=3, max_batch_staleness=1, queue_size=1).begin()
    assert started.wait(30)
    producer.close(timeout=30)
    assert not producer.thread.is_alive()
