"""A user allocator's bad request fails only that request: the rest of the run goes on.

Before, an unknown node or a fork point out of range raised out of the engine and
ended the whole run (a training step lost every episode already played), a
negative ``n`` gave leaves back to the budget, and an allocator whose ``plan`` was
a generator played nothing at all, silently.
"""

from __future__ import annotations

import pytest

from agentrl.config import load_config
from agentrl.policy import MockPolicy
from agentrl.rollout import Branch, Budget, Fresh, collect, summarize


class Scripted:
    """Plays ``rounds[r]`` in round r (each a function of the state), then stops."""

    name, needs_snapshots, top_logprobs = "scripted", True, 0

    def __init__(self, *rounds):
        self.rounds = rounds

    def plan(self, state):
        return self.rounds[state.round](state) if state.round < len(self.rounds) else []


def _cfg():
    return load_config(overrides=["rollout.max_turns=2", "env.kwargs={high: 1000, max_turns: 2}"])


def _run(tokenizer, alloc, tasks=2, budget=None):
    with pytest.warns(RuntimeWarning, match="allocator 'scripted'") as caught:
        trees = collect("agentrl/GuessNumber-v0", MockPolicy(tokenizer, ["1"]), _cfg(), list(range(tasks)),
                        alloc, budget or Budget(20))
    return trees, [str(w.message) for w in caught]


def _root(state, task=0):
    return state.trees[task].roots[0]


@pytest.mark.parametrize("bad, reason", [
    (lambda s: Branch(0, 999, 1), "branch from unknown node 999 of task 0"),
    (lambda s: Branch(0, _root(s), 1, at_token=50), "segment fork at token 50 of node 0"),
    (lambda s: Branch(0, _root(s), 1, at_token=0), "segment fork at token 0 of node 0"),
    (lambda s: Branch(0, _root(s), 1, at_token="2"), "segment fork at token '2' of node 0"),
    (lambda s: Branch(0, _root(s), 0), "k=0"),
    (lambda s: Fresh(0, -2), "n=-2"),
    (lambda s: Fresh(7, 1), "task 7; this run has tasks 0..1"),
    (lambda s: Fresh(-1, 1), "task -1; this run has tasks 0..1"),
    (lambda s: Fresh(0, 1, max_turns=0), "max_turns=0"),
    (lambda s: (0, 1), "not a Fresh or Branch"),
])
def test_a_bad_request_fails_alone_and_is_recorded(tokenizer, bad, reason):
    good = lambda s: Branch(1, _root(s, 1), 2)  # noqa: E731
    alloc = Scripted(lambda s: [Fresh(0, 1), Fresh(1, 1)], lambda s: [bad(s), good(s)])
    trees, warned = _run(tokenizer, alloc)
    assert len(trees[1].leaves()) == 1 + 2  # the good request of the round played
    assert len(trees[0].leaves()) == 1 and len(trees[0].nodes) == 2  # the bad one added nothing
    (rejected,) = trees[0].meta["allocation_report"]["rejected_requests"]
    assert reason in rejected["reason"] and rejected["round"] == 1
    assert any(reason in w for w in warned)
    summary = summarize(trees, 1.0)
    assert summary["rejected_requests"] == 1
    assert trees[0].meta["budget"]["spent"] == 1 + 1 + 2  # nothing charged (nor given back) for it


def test_a_round_of_bad_requests_only_ends_the_plan(tokenizer):
    alloc = Scripted(lambda s: [Fresh(0, 1)], lambda s: [Branch(0, 999, 1), Branch(0, 998, 1)])
    trees, warned = _run(tokenizer, alloc, tasks=1)
    assert len(trees[0].leaves()) == 1
    assert len(trees[0].meta["allocation_report"]["rejected_requests"]) == 2
    assert len(warned) == 2


def test_a_plan_given_as_a_generator_is_played(tokenizer):
    class Lazy:
        name, needs_snapshots, top_logprobs = "lazy", False, 0

        def plan(self, state):
            if state.round == 0:
                yield Fresh(0, 2)

    trees = collect("agentrl/GuessNumber-v0", MockPolicy(tokenizer, ["1"]), _cfg(), [0], Lazy(), Budget(2))
    assert len(trees[0].leaves()) == 2


def test_two_branches_from_one_open_leaf_in_a_round_never_overspend_leaves(tokenizer):
    # The paused leaf becomes internal once, so only the first branch from it saves a leaf:
    # each was charged k - 1 = 1, 1 + 1 + 1 = 3 of 3 leaves, and 4 leaves were played.
    def paused(s):
        return [Branch(0, _root(s), 2), Branch(0, _root(s), 2)]

    alloc = Scripted(lambda s: [Fresh(0, 1, max_turns=1)], paused)
    trees = collect("agentrl/GuessNumber-v0", MockPolicy(tokenizer, ["1"]), _cfg(), [0], alloc, Budget(3))
    assert len(trees[0].leaves()) == trees[0].meta["budget"]["spent"] == 3


def test_an_allocator_that_raises_stops_the_run_with_its_name_and_round_noted(tokenizer):
    """A plan that raises is a bug in the allocator's own code, with nothing left to play: the
    run stops with its exception (its type kept), now noted with the allocator and round."""

    def broken(s):
        return [Fresh(0, 1 // 0)]

    alloc = Scripted(lambda s: [Fresh(0, 1)], broken)
    with pytest.raises(ZeroDivisionError) as info:
        collect("agentrl/GuessNumber-v0", MockPolicy(tokenizer, ["1"]), _cfg(), [0], alloc, Budget(3))
    assert "allocator 'scripted' raised planning round 1" in "".join(getattr(info.value, "__notes__", []))
