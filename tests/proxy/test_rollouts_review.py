"""Harness rollouts: what a group's tree keeps of its sessions."""

from __future__ import annotations

from agentrl.proxy.rollouts import merge_sessions
from agentrl.types import Node, RolloutTree


def test_the_group_keeps_how_many_rewards_a_harness_posted_for_itself():
    """``run_harness_episode`` zeroes a reward the harness posted with its session key
    (``meta["dropped_rewards"]``): the group's tree says so, as it says why a session failed."""
    cheat = RolloutTree(meta={"session_id": "a", "dropped_rewards": 2})
    cheat.add(Node(action_ids=[1], reward=0.0, terminated=True))
    honest = RolloutTree(meta={"session_id": "b"})
    honest.add(Node(action_ids=[2], reward=1.0, terminated=True))
    group = merge_sessions([cheat, honest], {"task": 0})
    assert [s.get("dropped_rewards") for s in group.meta["sessions"]] == [2, None]
