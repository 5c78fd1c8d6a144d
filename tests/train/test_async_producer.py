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
