"""Asynchronous training: the next steps roll out while this one trains.

The bounded-staleness scheme of AReaL (Fu et al. 2025, Sec. 4: a sample may be
at most eta versions older than the policy it trains) and of M2PO (Zheng et
al. 2025, which trains on data k versions stale), without Ray:

- a producer thread runs the trainer's own ``rollout(step)`` for steps
  ``start, start + 1, ...`` and puts each step's trees into a bounded queue;
  it waits while the queue is full (backpressure);
- it samples from a ``SnapshotPolicy`` (``agentrl.policy.snapshot``): an ``hf``
  policy over its own copy of the weights, so the optimizer's in-place updates
  never reach a running episode. At each sync the trainer copies its weights in, between two
  ``generate`` batches; every token keeps the version that sampled it, so the
  loss's corrections (TIS, ``loss.max_token_staleness``, M2PO) see real versions;
- it starts its ``n``-th batch only once the trainer has taken ``n - k``
  batches and synced after each (a dropped batch is taken without a sync), so
  the oldest token of a batch is at most ``k`` versions behind when it trains.
  ``k = 0`` waits for each sync: the synchronous run (with
  ``rollout.deterministic: true``, bit for bit), with eval and checkpoints
  overlapped. A batch that is older anyway (a sampler that missed a sync) is
  dropped and counted (``async/dropped_batches``), and the producer rolls out
  one step more in its place at once: a drop never waits for a sync;
- what the trainer decides for the next rollouts is handed over with each
  sync, never read across threads: TurnOPD's depth budget (``max_turns``);
  the allocator's report is read by the trainer from the batch it takes;
- ``take`` waits at most ``batch_timeout_s`` for a batch, then fails naming
  what the producer was doing (a hung generate, say);
- with every Ray worker the rollouts need lost for good (``workers_gone``),
  the producer hands the trainer that error instead of a batch: each later
  episode would fail, and the run would go on learning nothing.

With rollout workers (``distributed.num_rollout_workers``) the workers hold
their own copy already: the producer samples through a ``RaySampler`` over
them, and the sync's push reaches each worker between two of its batches
(``agentrl.distributed.rollout_workers``).

Deviation from AReaL: no interruptible generation; a sync waits for the
running ``generate`` batch to finish, and the prefix cache of the old weights
is dropped, so a live episode's next turn prefills again under the new ones.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import RolloutError
from ..types import RolloutTree

__all__ = ["RolloutProducer", "StepBatch", "may_start", "oldest_version", "staleness_stats", "workers_gone"]

_POLL_S = 0.05  # how often a blocked producer or trainer looks whether the other side stopped


# --------------------------------------------------------------------------- staleness


def oldest_version(trees: list[RolloutTree]) -> int | None:
    """The version of the oldest sampled turn in ``trees``; None when nothing was sampled."""
    versions = [n.version for t in trees for n in t.nodes.values() if n.action_ids]
    return min(versions) if versions else None


def staleness_stats(trees: list[RolloutTree], current_version: int) -> dict[str, float]:
    """How many versions behind ``current_version`` each action token's sampler was."""
    turns = [(current_version - n.version, len(n.action_ids)) for t in trees for n in t.nodes.values()
             if n.action_ids]
    tokens = sum(n for _, n in turns)
    return {"async/staleness_mean": sum(a * n for a, n in turns) / tokens if tokens else 0.0,
            "async/staleness_max": max((a for a, _ in turns), default=0)}


# --------------------------------------------------------------------------- the producer


def workers_gone(policy: Any) -> str | None:
    """Why rollouts can run no more episodes, when the Ray workers they need are all lost: the
    rollout workers ``policy`` samples on (a ``RaySampler``), or the env workers of a pool of
    this process; else None. Without Ray in the run, None."""
    check = getattr(policy, "workers_gone", None)
    if check is not None and (why := check()):
        return why
    env_workers = sys.modules.get("agentrl.distributed.env_workers")  # imported where a run has env workers
    return env_workers.lost_env_workers() if env_workers is not None else None


@dataclass(slots=True)
class StepBatch:
    """One step's rollout as the producer hands it over."""

    step: int  # the data position: step_task_seeds(cfg, step) rolled out
    trees: list[RolloutTree]
    stats: dict[str, Any]
    finished: float  # time.perf_counter() when it was queued


# (step, policy, max_turns or None) -> trees, stats
RolloutFn = Callable[[int, Any, int | None], tuple[list[RolloutTree], dict[str, Any]]]


def may_start(batch: int, synced: int, dropped: int, k: int) -> bool:
    """Whether the producer may start its ``batch``-th rollout (0-based) after the trainer's
    ``synced`` syncs and ``dropped`` drops: the batch trains after ``batch - dropped`` syncs at
    the earliest, so starting after ``batch - dropped - k`` keeps its tokens within k versions.
    Counting drops is what lets a dropped batch be replaced without a sync that cannot come."""
    return synced + dropped >= batch - k


class RolloutProducer:
    """A thread that rolls out steps ``start .. end - 1`` with ``policy`` into a bounded queue.

    The trainer calls ``take(version)`` for each step's batch and ``synced(net, version)``
    after each sync; ``close()`` stops the thread. ``max_turns`` (and each sync's) caps the
    turns of the rollouts started after it (TurnOPD's depth budget; None: the config's).
    """

    def __init__(self, rollout: RolloutFn, policy: Any, start: int, end: int, max_batch_staleness: int,
                 queue_size: int, batch_timeout_s: float | None = None, max_turns: int | None = None):
        self.rollout, self.policy = rollout, policy
        self.start, self.end = start, end
        self.max_staleness = max_batch_staleness  # train.asynchronous.max_batch_staleness
        self.batch_timeout_s = batch_timeout_s
        self.queue: queue.Queue[StepBatch | BaseException] = queue.Queue(maxsize=queue_size)
        self.synced_steps = 0  # syncs since the producer started
        self.dropped = 0
        self.max_turns = max_turns
        # the version the sampler's weights are: a sync that leaves it (no optimizer step) copies nothing
        self.weights_version = getattr(policy, "version", None)
        self.doing = "starting"  # what the thread is doing, for take()'s timeout message
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="agentrl-rollout-producer", daemon=True)

    def begin(self) -> RolloutProducer:
        self.thread.start()
        return self

    # -- the producer thread --------------------------------------------------------------
    def _may_start(self, step: int) -> bool:
        return step < self.end and may_start(step - self.start, self.synced_steps, self.dropped, self.max_staleness)

    def _wait_to_start(self, step: int) -> tuple[bool, int | None]:
        """Block until step ``step`` may start: (False when stopped instead, its ``max_turns``)."""
        with self._cond:
            if not self._may_start(step):
                self.doing = (f"waiting to start step {step + 1}: the trainer has synced {self.synced_steps} "
                              f"times since it started, and rollouts may run {self.max_staleness} ahead")
            self._cond.wait_for(lambda: self._stop.is_set() or self._may_start(step))
            self.doing = f"rolling out step {step + 1} (since {time.strftime('%H:%M:%S')})"
            return not self._stop.is_set(), self.max_turns

    def _run(self) -> None:
        step = self.start
        try:
            while True:
                go, max_turns = self._wait_to_start(step)
                if not go:
                    return
                trees, stats = self.rollout(step, self.policy, max_turns)
                if why := workers_gone(self.policy):  # each step after would fail every episode
                    raise RolloutError(f"{why}: no episode can run, so the run stops")
                self.doing = f"waiting for room in the queue for step {step + 1}'s batch"
                if not self._put(StepBatch(step, trees, stats, time.perf_counter())):
                    return
                step += 1
        except BaseException as e:  # handed to the trainer, which raises it
            self.doing = f"stopped by {type(e).__name__}: {e}"
            self._put(e)

    def _put(self, item: StepBatch | BaseException) -> bool:
        """Queue ``item``, waiting while the queue is full; False when stopped meanwhile."""
        while not self._stop.is_set():
            try:
                self.queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    # -- the trainer's side -----------------------------------------------------------------
    def take(self, current_version: int) -> tuple[StepBatch, dict[str, Any]]:
        """The next batch whose oldest token is at most ``max_staleness`` versions old, and the
        async stats of this step; older batches are dropped (the producer rolls out more).
        Raises ``TimeoutError`` naming what the producer was doing after ``batch_timeout_s``."""
        t0 = time.perf_counter()
        deadline = None if self.batch_timeout_s is None else time.monotonic() + self.batch_timeout_s
        while True:
            item = self._get(deadline)
            oldest = oldest_version(item.trees)
            if oldest is None or current_version - oldest <= self.max_staleness:
                break
            with self._cond:
                self.dropped += 1
                self.end += 1  # one more step rolled out in its place, started at once (may_start)
                self._cond.notify_all()
        now = time.perf_counter()
        return item, {**staleness_stats(item.trees, current_version), "async/dropped_batches": self.dropped,
                      "async/queue_wait_s": now - t0, "async/batch_age_s": now - item.finished,
                      "async/data_step": item.step}

    def _get(self, deadline: float | None) -> StepBatch:
        while True:
            try:
                item = self.queue.get(timeout=_POLL_S)
            except queue.Empty:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"no rollout batch came within {self.batch_timeout_s:.0f} s "
                                       f"(train.asynchronous.batch_timeout_s); the rollout producer is "
                                       f"{self.doing}") from None
                if self.thread.is_alive():
                    continue
                try:  # it may have queued its last item just before it ended
                    item = self.queue.get_nowait()
                except queue.Empty:
                    raise RuntimeError("the rollout producer stopped without a batch") from None
            if isinstance(item, BaseException):
                raise item
            return item

    def synced(self, net: torch.nn.Module, version: int, max_turns: int | None = None) -> None:
        """The trainer synced: copy its weights into the sampling policy, take the turn cap of
        the rollouts to come (``max_turns``); the next step may start. A sync that left the
        version (a step with no optimizer step) left the weights too: nothing is copied."""
        if version != self.weights_version:
            self.policy.refresh(net, version)
            self.weights_version = version
        with self._cond:
            self.synced_steps += 1
            self.max_turns = max_turns
            self._cond.notify_all()

    def close(self, timeout: float = 60.0) -> None:
        """Stop the thread: a running rollout fails its remaining requests and ends. A Ctrl-C
        while this waits (a second one, on the way out of the first) ends the wait with a
        warning and returns: what the caller closes next (the rollout source, its env workers)
        must still be closed, and the thread is a daemon."""
        try:
            self._stop.set()
            with self._cond:
                self._cond.notify_all()
            if hasattr(self.policy, "close"):
                try:
                    self.policy.close()
                except Exception as e:  # noqa: BLE001 - the thread is stopped all the same, and the caller goes on
                    warnings.warn(f"closing the rollout producer's sampler raised {type(e).__name__}: {e}",
                                  RuntimeWarning, stacklevel=2)
            self.thread.join(timeout)
        except KeyboardInterrupt:
            warnings.warn("Ctrl-C: stopped waiting for the rollout producer; its thread ends when its running "
                          "generate batch does", RuntimeWarning, stacklevel=2)
            return
        if self.thread.is_alive():  # a generate batch still running: say so rather than pretend
            warnings.warn(f"the rollout producer did not stop within {timeout:.0f} s; its thread "
                          "ends when its running generate batch does", RuntimeWarning, stacklevel=2)
