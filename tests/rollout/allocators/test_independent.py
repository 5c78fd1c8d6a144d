"""The independent allocator (GRPO): n episodes per task, in one round."""

from __future__ import annotations

from agentrl.allocator_options import IndependentOptions
from agentrl.rollout.allocators import AllocState, Budget, Independent
from agentrl.types import RolloutTree


def test_independent_spreads_a_small_budget_and_never_overspends():
    state = AllocState([RolloutTree() for _ in range(3)], Budget(10))
    reqs = Independent(IndependentOptions(n=4)).plan(state)
    assert [(r.task, r.n) for r in reqs] == [(0, 4), (1, 3), (2, 3)]
    state = AllocState([RolloutTree() for _ in range(3)], Budget(2))
    assert [(r.task, r.n) for r in Independent(IndependentOptions(n=4)).plan(state)] == [(0, 1), (1, 1)]


def test_independent_n_none_reaches_the_budget_and_n_caps_it():
    state = AllocState([RolloutTree() for _ in range(3)], Budget(20))
    assert [r.n for r in Independent().plan(state)] == [7, 7, 6]
    assert [r.n for r in Independent(IndependentOptions(n="all")).plan(state)] == [7, 7, 6]
    state = AllocState([RolloutTree() for _ in range(3)], Budget(20))
    assert [r.n for r in Independent(IndependentOptions(n=4)).plan(state)] == [4, 4, 4]
    state.round = 1
    assert Independent(IndependentOptions(n=4)).plan(state) == []
