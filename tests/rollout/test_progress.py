"""``on_episode_done`` is called once for every planned episode, played or dropped.

A progress bar counts planned episodes with it. An episode that never started because a
turns or tokens budget was spent first returned without a call, so the bar of a finished
run stopped short (1 of 3 below) and looked hung.
"""

from __future__ import annotations

from agentrl.config import load_config
from agentrl.policy import MockPolicy
from agentrl.rollout import Budget, collect
from agentrl.rollout.allocators import Independent, IndependentOptions


def test_episodes_dropped_for_a_spent_budget_are_reported_done(tokenizer):
    cfg = load_config(overrides=["rollout.max_turns=8", "env.kwargs={high: 1000, max_turns: 8}",
                                 "rollout.concurrency=1"])
    done = []
    plan = Independent(IndependentOptions(n=3, est_leaf_cost=1.0))  # 3 episodes for 3 turns
    (tree,) = collect("agentrl/GuessNumber-v0", MockPolicy(tokenizer, ["1"]), cfg, [0], plan,
                      Budget(3, "turns"), on_episode_done=done.append)
    assert len(list(tree.episodes())) == 1  # the first episode spent all 3 turns; the others never started
    assert len(done) == 3 and all(t is tree for t in done)
