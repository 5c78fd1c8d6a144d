"""The key-state allocator (Spark): low top-1 turns, branched before or inside."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agentrl.allocator_options import KeyStateOptions
from agentrl.rollout.allocators import AllocState, Branch, Budget, Fresh, KeyState, key_states
from agentrl.types import RolloutTree
from tests.rollout.allocators.sim import linear


def test_key_state_branches_before_the_lowest_top1_turn():
    tree = RolloutTree()
    a = linear(tree, [{"top1": [0.9, 0.9]}, {"top1": [0.3, 0.5, 0.1, 0.1, 0.0]},
                      {"top1": [0.45], "terminated": True}])
    b = linear(tree, [{"top1": [0.2, 0.4]}, {"top1": [0.9], "terminated": True}])
    assert key_states(tree, first_tokens=4, top1_threshold=0.5) == [
        pytest.approx((0.25, a[1])), pytest.approx((0.3, b[0])), pytest.approx((0.45, a[2]))]
    state = AllocState([tree], Budget(7), spent=2, round=1)
    reqs = KeyState(KeyStateOptions(k=2, first_tokens=4)).plan(state)
    # a1 -> from a0; b0 is a first turn -> fresh episodes; a2 -> from a1 (1 leaf left)
    assert reqs == [Branch(0, a[0], 2, reason="key state"), Fresh(0, 2, reason="key state"),
                    Branch(0, a[1], 1, reason="key state")]
    assert state.report["key_state"] == {"candidates": 3, "top1_seen": True, "branches": 3,
                                         "fresh_leftover": 0,
                                         "branch_points": [(0, a[0]), (0, None), (0, a[1])]}
    assert KeyState.top_logprobs == 1 and KeyState.needs_snapshots


def test_key_state_in_turn_forks_a_single_turn_task_inside_the_turn():
    tree = RolloutTree()
    (a,) = linear(tree, [{"action_ids": [1, 2, 3, 4], "top1": [0.6, 0.1, 0.3, 0.9], "terminated": True}])
    (b,) = linear(tree, [{"action_ids": [5, 6], "top1": [0.2, 0.4], "terminated": True}])
    state = AllocState([tree], Budget(6), spent=2, round=1)
    # b's most uncertain token is its first: the state before it is the prompt -> fresh episodes;
    # a's is token 1 -> fork after a's first token
    assert KeyState(KeyStateOptions(k=2, first_tokens=4, in_turn=True)).plan(state) == [
        Fresh(0, 2, reason="key state"), Branch(0, a, 2, at_token=1, reason="key state")]
    # turn-level, a single-turn task has nothing to branch before but the prompt
    turn_level = KeyState(KeyStateOptions(k=2, first_tokens=4)).plan(AllocState([tree], Budget(6), spent=2, round=1))
    assert not any(isinstance(r, Branch) for r in turn_level)
    with pytest.raises(ValidationError, match="in_turn"):
        KeyState(KeyStateOptions(in_turn="yes"))
