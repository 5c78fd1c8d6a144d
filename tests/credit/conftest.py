"""Hand-built rollout trees for the credit tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from agentrl.types import Node, RolloutTree


def build_tree(spec: list[tuple[int | None, float, dict]], meta: dict | None = None) -> RolloutTree:
    """A tree from ``(parent index or None, reward, extra Node fields)`` rows, in id order.

    Each node gets two action tokens ``[10*id + 1, 10*id + 2]``; a root's context is
    ``[1, 2, 3]``, a child's ``[100 + id]`` (none under a partial node).
    """
    tree = RolloutTree(meta=dict(meta or {"instruction": "do the task"}))
    for i, (parent, reward, extra) in enumerate(spec):
        under_partial = parent is not None and tree.nodes[parent].partial
        context = [1, 2, 3] if parent is None else ([] if under_partial else [100 + i])
        node = Node(
            context_ids=context,
            action_ids=[10 * i + 1, 10 * i + 2],
            logprobs=[-0.5, -0.5],
            reward=reward,
            **extra,
        )
        tree.add(node, parent)
    return tree


@pytest.fixture
def make_tree() -> Callable[..., RolloutTree]:
    return build_tree
