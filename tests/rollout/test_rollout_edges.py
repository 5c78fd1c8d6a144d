"""Edges of the rollout engine and its allocators: a failing progress callback, a backend that
overspends, groups written however a run ends, per-task pricing, and the trainer's bar."""

from __future__ import annotations

import warnings

import pytest

from agentrl.config import load_config
from agentrl.policy import MockPolicy
from agentrl.rollout import collect
from agentrl.rollout.allocators import Independent, IndependentOptions


def _cfg(*extra: str):
    return load_config(overrides=["rollout.max_turns=2", "env.kwargs={high: 1000, max_turns: 2}", *extra])


def test_a_raising_on_episode_done_loses_no_episode(tokenizer):
    """A progress callback that raised went up through the batch's gather: the run stopped and
    every episode of every task was lost. Now the run plays on and returns its trees; the
    callback's error is warned about once, naming it, and it is not called again."""
    calls = []

    def bar(tree):
        calls.append(tree)
        raise ValueError("bar closed")

    cfg = _cfg("rollout.concurrency=1", "rollout.group_size=3")
    with pytest.warns(RuntimeWarning, match="on_episode_done.*ValueError: bar closed") as caught:
        trees = collect("agentrl/GuessNumber-v0", MockPolicy(tokenizer, ["1"]), cfg, [0, 1],
                        Independent(IndependentOptions(n=3)), on_episode_done=bar)
    assert [len(list(t.episodes())) for t in trees] == [3, 3]
    assert all(n.error is None for t in trees for n in t.nodes.values())
    assert len(calls) == 1  # not called again after it raised
    assert len([w for w in caught if "on_episode_done" in str(w.message)]) == 1


def test_a_keyboard_interrupt_in_on_episode_done_still_stops_the_run(tokenizer):
    """Only an ``Exception`` is warned about: Ctrl-C met inside the callback still stops the run."""
    def bar(_tree):
        raise KeyboardInterrupt

    with warnings.catch_warnings(), pytest.raises(KeyboardInterrupt):
        warnings.simplefilter("ignore")
        collect("agentrl/GuessNumber-v0", MockPolicy(tokenizer, ["1"]), _cfg(), [0],
                Independent(IndependentOptions(n=2)), on_episode_done=bar)


class _Overlong(MockPolicy):
    """A backend that ignores ``max_new_tokens``: it samples as if it were 64."""

    async def agenerate(self, request):
        import dataclasses

        params = dataclasses.replace(request.params, max_new_tokens=64)
        return await super().agenerate(dataclasses.replace(request, params=params))


def test_a_backend_over_max_new_tokens_fails_its_episode_and_spends_nothing(tokenizer):
    """The turn reserved 4 tokens and was settled with the 12 the backend returned: a 10-token
    budget was spent to 12, and the 12 were trained on although no request asked past 4. Now
    such a result fails its episode, naming the backend and both counts, and nothing of it is
    charged or recorded (as the openai backend already refused a server's over-long reply)."""
    from agentrl.rollout import Budget

    cfg = _cfg("sampling.max_new_tokens=4", "rollout.concurrency=1")
    text = "1 2 3 4 5 6"
    assert len(tokenizer.encode(text, add_special_tokens=False)) > 4
    (tree,) = collect("agentrl/GuessNumber-v0", _Overlong(tokenizer, [text]), cfg, [0],
                      Independent(IndependentOptions(n=2, est_leaf_cost=4)), Budget(10, "tokens"))
    assert tree.meta["budget"]["spent"] == 0
    assert all(len(n.action_ids) <= 4 for n in tree.nodes.values())
    errors = [n.error for n in tree.nodes.values() if n.error]
    assert len(errors) == 2 and all("_Overlong" in e and "max_new_tokens=4" in e for e in errors), errors


def test_an_interrupted_contrastive_run_keeps_the_prefix_groups_of_its_finished_trees(tokenizer):
    """``prefix_groups`` was written only by the contrastive allocator's last, empty plan: the
    finished trees an interrupted run hands back (and ``agentrl rollout`` writes) had none. The
    engine now calls the allocator's ``finish`` however the run ends. Two tasks, 6 leaves:
    round 0 plays 2 + 1 fresh episodes, round 1 branches task 0's first turn twice, then task 1's
    once, and that last call (the 9th, one at a time) is cancelled: task 0 is finished."""
    import asyncio

    from agentrl.allocator_options import ContrastiveOptions
    from agentrl.rollout import Budget
    from agentrl.rollout.allocators import Contrastive
    from agentrl.rollout.engine import Engine

    class CancelledAt(MockPolicy):
        async def agenerate(self, request):
            if self.calls == 8:
                raise asyncio.CancelledError  # as Ctrl-C cancels the run's tasks
            return await super().agenerate(request)

    engine = Engine(CancelledAt(tokenizer, ["1"]), _cfg("rollout.concurrency=1"), "agentrl/GuessNumber-v0")
    try:
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(engine.run([0, 1], Contrastive(ContrastiveOptions()), Budget(6)))
    finally:
        engine.close()
    (tree,) = engine.finished
    assert tree.meta["task"] == 0
    assert tree.meta["prefix_groups"] == [{"node": 0, "leaves": [1, 4, 5]}]


@pytest.mark.parametrize("allocator, budget, want", [
    ("independent", 3, 3),  # fewer than 2 tasks x group_size 2: the bar stopped at 3 of 4
    ("{name: independent, n: all}", 6, 6),  # the whole budget, spread: it ended at 6 of 4
    ("independent", 9, 4),  # n = group_size caps each task: 4, not the budget's 9
    ("contrastive", 5, 5),
])
def test_the_trainer_s_rollout_bar_counts_to_the_episodes_a_leaves_budget_plays(tokenizer, allocator, budget,
                                                                               want):
    """The trainer's bar was made for tasks x group_size episodes whatever ``rollout.budget`` said."""
    from agentrl.train.config import load_train_config
    from agentrl.train.rollouts import step_rollouts

    cfg = load_train_config(None, ["env.id=agentrl/GuessNumber-v0", "env.kwargs={high: 1000, max_turns: 2}",
                                   "rollout.max_turns=2", "rollout.group_size=2", "train.tasks_per_step=2",
                                   "sampling.max_new_tokens=4", f"rollout.budget={budget}",
                                   f"rollout.allocator={allocator}"])
    bars, done = [], []

    def advance_bar(total, label):
        bars.append(total)
        return done.append

    step_rollouts(cfg, 0, MockPolicy(tokenizer, ["1"]), advance_bar)
    assert (bars, len(done)) == ([want], want)


def _episodes(tree, turns: int, rewards: list[float]) -> None:
    """One finished episode of ``turns`` turns per reward."""
    from tests.rollout.allocators.sim import linear

    for r in rewards:
        linear(tree, [{}] * (turns - 1) + [{"terminated": True, "reward": r}])


def test_fresh_episodes_of_a_long_task_are_priced_by_its_own_episodes():
    """Task 0's episodes take 1 turn, task 1's take 5. 12 of 20 turns are left; the mean episode
    (3 x 1 + 5) / 4 = 2 turns bought 6 leaves, which the top-up gave (n=4 per task) 1 to task 0
    and 3 to task 1: 1 + 15 = 16 turns planned for 12, and the budget cut task 1's episodes.
    Priced by task: task 1 (fewest leaves) 5, 5, then task 0 1: 11 turns; a third episode of
    task 1 (5) does not fit the 1 left."""
    from agentrl.rollout.allocators import AllocState, Budget, Fresh
    from agentrl.types import RolloutTree

    trees = [RolloutTree(), RolloutTree()]
    _episodes(trees[0], 1, [1.0, 0.0, 1.0])
    _episodes(trees[1], 5, [0.0])
    state = AllocState(trees, Budget(20, "turns"), spent=8, round=1)
    plan = Independent(IndependentOptions(n=4)).plan(state)
    assert plan == [Fresh(0, 1, reason="independent"), Fresh(1, 2, reason="independent")]


def test_pilot_commit_prices_its_commit_by_the_tasks_it_goes_to():
    """Task 0 (1-turn episodes) is solved by both pilots, task 1 (5 turns) by one of two: the
    whole commit goes to task 1. The mean pilot, 12 / 4 = 3 turns, bought 4 episodes of it for
    the 12 turns left: 20 turns planned. Priced at task 1's 5 turns: 2 episodes, 10 turns."""
    from agentrl.allocator_options import PilotCommitOptions
    from agentrl.rollout.allocators import AllocState, Budget, Fresh, PilotCommit
    from agentrl.types import RolloutTree

    trees = [RolloutTree(), RolloutTree()]
    _episodes(trees[0], 1, [1.0, 1.0])
    _episodes(trees[1], 5, [1.0, 0.0])
    state = AllocState(trees, Budget(24, "turns"), spent=12, round=1)
    assert PilotCommit(PilotCommitOptions()).plan(state) == [Fresh(1, 2, reason="commit")]
    assert state.report["pilot_commit"]["commit"] == [0, 2]


def test_priced_fill_hands_out_by_fewest_leaves_while_each_task_s_price_fits():
    from agentrl.rollout.allocators import priced_fill

    # 10 units: slot 1 (0 leaves) 4 -> 6 left; slot 1 again (1 vs 2) 4 -> 2; slot 0 (2) 1 -> 1;
    # slot 0 (3 vs 2: slot 1 costs 4, closed) 1 -> 0
    assert priced_fill([2, 0], 10, [1.0, 4.0]) == [2, 2]
    assert priced_fill([2, 0], 10, [1.0, 4.0], caps=[1, 5]) == [1, 2]
    assert priced_fill([0, 0], 2.5, [3.0, 3.0]) == [0, 0]
    assert priced_fill([0, 0, 0], 7, [2.0, 2.0, 2.0]) == [1, 1, 1]  # as fill_evenly at one price


def test_the_fresh_episodes_left_after_branching_are_priced_by_their_tasks():
    """No turn's entropy rose, so the branch round's 12 turns all go to fresh episodes. Priced at
    the mean episode (2 turns) they were 6, spread to the fewest leaves: 2 of task 0 (1 turn) and
    4 of task 1 (5 turns), 22 turns for 12. By task: 5, 5, 1, 1 turns (see ``priced_fill``)."""
    from agentrl.allocator_options import EntropyBranchOptions
    from agentrl.rollout.allocators import AllocState, Budget, EntropyBranch, Fresh
    from agentrl.types import RolloutTree

    trees = [RolloutTree(), RolloutTree()]
    _episodes(trees[0], 1, [1.0, 0.0, 1.0])
    _episodes(trees[1], 5, [0.0])
    state = AllocState(trees, Budget(20, "turns"), spent=8, round=1)
    plan = EntropyBranch(EntropyBranchOptions()).plan(state)
    reason = "no high-entropy turn left"
    assert plan == [Fresh(0, 2, reason=reason), Fresh(1, 2, reason=reason)]
    assert state.report["entropy_branch"]["fresh_leftover"] == 4


def test_a_task_whose_episodes_all_failed_is_priced_by_the_mean_episode_not_at_one_token():
    """Task 0's two episodes failed at reset (empty error nodes, 0 tokens), task 1's one took 30
    tokens. Priced by its own failures, task 0 cost 1 token an episode (the floor), and a
    top-up sent it one fresh episode per token left. Failures say nothing of what an episode
    that plays costs: it takes the mean episode, (0 + 0 + 30) / 3 = 10."""
    from agentrl.rollout.allocators import AllocState, Budget, fresh_costs
    from agentrl.types import Node, RolloutTree

    trees = [RolloutTree(), RolloutTree()]
    for _ in range(2):
        trees[0].add(Node(truncated=True, error="env.reset raised OSError: gone"))
    trees[1].add(Node(action_ids=list(range(30)), terminated=True))
    state = AllocState(trees, Budget(100, "tokens"), spent=30, round=1)
    assert fresh_costs(state) == [10.0, 30.0]
