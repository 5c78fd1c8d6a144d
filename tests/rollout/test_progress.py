"""``on_episode_done`` is called once for every planned episode, played or dropped.

A progress bar counts planned episodes with it. An episode that never started because a
turns or tokens budget was spent first returned without a call, so the bar of a finished
run stopped short (1 of 3 below) and looked hung.
"""

from __future__ import annotations

import pytest

from agentrl.config import load_config
from agentrl.policy import MockPolicy
from agentrl.rollout import Budget, Fresh, collect
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


def test_a_tokens_budget_is_not_spent_by_the_reservations_of_turns_in_flight(tokenizer):
    """Each turn reserves ``max_new_tokens`` before its request and gets back what it did not
    generate. With a backend that serves requests concurrently (hf, vLLM), the first two
    turns reserved all 60 tokens: the six other episodes were cut at 0 tokens ('budget: 60
    tokens spent', an empty node: a 0-reward member of the GRPO group) and 12 tokens were
    spent in all. Now a turn that does not fit waits for the turns in flight to settle."""
    import asyncio

    class Concurrent(MockPolicy):
        async def agenerate(self, request):
            await asyncio.sleep(0.02)  # other episodes' requests go out meanwhile
            return await super().agenerate(request)

    cfg = load_config(overrides=["rollout.max_turns=3", "sampling.max_new_tokens=30", "rollout.concurrency=8",
                                 "env.kwargs={high: 1000, max_turns: 3}"])
    (tree,) = collect("agentrl/GuessNumber-v0", Concurrent(tokenizer, ["1"]), cfg, [0],
                      Independent(IndependentOptions(n=8, est_leaf_cost=6)), Budget(60, "tokens"))
    eps = list(tree.episodes())
    assert [ep.num_turns for ep in eps] == [3] * 8  # each turn "1" is 2 tokens: 8 x 3 x 2 = 48 <= 60
    assert tree.meta["budget"]["spent"] == 48
    assert not any(n.info.get("truncation_reason", "").startswith("budget") for n in tree.nodes.values())


@pytest.mark.parametrize("unit, total", [("turns", 5), ("tokens", 9)])
def test_paths_that_started_together_when_the_budget_ran_out_leave_no_empty_episodes(tokenizer, unit, total):
    """Eight paths start at once with room for some: those whose first turn found the budget
    spent were recorded as empty episodes (a node with no action, truncated 'budget: ...'),
    0-reward members of the group. Now they are dropped, as a path that never started is."""
    import asyncio

    class Concurrent(MockPolicy):
        async def agenerate(self, request):
            await asyncio.sleep(0.02)
            return await super().agenerate(request)

    class Eight:
        name, needs_snapshots, top_logprobs = "eight", False, 0

        def plan(self, state):
            return [Fresh(0, 8)] if state.round == 0 else []

    cfg = load_config(overrides=["rollout.max_turns=3", "rollout.concurrency=8",
                                 "env.kwargs={high: 1000, max_turns: 3}"])
    done = []
    (tree,) = collect("agentrl/GuessNumber-v0", Concurrent(tokenizer, ["1"]), cfg, [0], Eight(),
                      Budget(total, unit), on_episode_done=done.append)
    eps = list(tree.episodes())
    assert eps and all(sum(ep.loss_mask) > 0 for ep in eps), [sum(ep.loss_mask) for ep in eps]
    assert tree.meta["budget"]["spent"] == total and len(done) == 8
