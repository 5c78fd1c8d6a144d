"""Branching corner cases of the rollout engine: replaying past failed siblings, and
the bookkeeping of trees that hold failures next to branches."""

from __future__ import annotations

import itertools
from typing import Any

from agentrl.config import load_config
from agentrl.env import register_env
from agentrl.policy import MockPolicy
from agentrl.rollout import Branch, Budget, Fresh, collect
from tests.fakes import NoSnapshotEnv


class FirstResetFails(NoSnapshotEnv):
    """Cannot snapshot; the very first reset of a test fails (a sandbox that did not start)."""

    resets = itertools.count()

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        if next(FirstResetFails.resets) == 0:
            raise OSError("sandbox did not start")
        return super().reset(seed=seed, options=options)


register_env("agentrl/TestFirstResetFails-v0", entry_point=FirstResetFails)


class ForkTheGoodRoot:
    """Two fresh episodes, then a segment fork of the first turn of the one that played."""

    name, needs_snapshots, top_logprobs = "fork-good-root", True, 0

    def plan(self, state):
        tree = state.trees[0]
        if state.round == 0:
            return [Fresh(0, 2)]
        if state.round == 1:
            good = next(r for r in tree.roots if tree.nodes[r].action_ids)
            return [Branch(0, good, 1, at_token=1)]
        return []


def test_a_first_turn_fork_replays_past_a_root_whose_reset_failed(tokenizer):
    FirstResetFails.resets = itertools.count()
    cfg = load_config(overrides=["rollout.max_turns=3", "rollout.concurrency=1"])
    (tree,) = collect("agentrl/TestFirstResetFails-v0", MockPolicy(tokenizer, ["alpha beta gamma"]), cfg,
                      [0], ForkTheGoodRoot(), Budget(3))
    errors = sorted(ep.error or "" for ep in tree.episodes())
    assert errors == ["", "", "env.reset raised OSError: sandbox did not start"]
    fork = next(n for n in tree.nodes.values() if n.partial)
    assert len(fork.children) == 2  # the original turn's rest, and the fork's continuation


def test_a_budget_unit_without_a_budget_is_the_documented_leaves(tokenizer):
    """``rollout.budget: null`` is episodes * group_size leaves, whatever ``budget_unit`` says:
    taken as that many tokens, 4 episodes shared 4 tokens."""
    cfg = load_config(overrides=["rollout.budget_unit=tokens", "rollout.group_size=2", "rollout.max_turns=3",
                                 "env.kwargs={high: 1000, max_turns: 3}"])
    trees = collect("agentrl/GuessNumber-v0", MockPolicy(tokenizer, ["12 13"]), cfg, [0, 1])
    assert trees[0].meta["budget"] == {"unit": "leaves", "total": 4, "spent": 4}
    eps = [ep for t in trees for ep in t.episodes()]
    assert len(eps) == 4 and all(ep.num_turns == 3 and ep.error is None for ep in eps)


def test_no_task_seeds_give_no_trees(tokenizer):
    """An allocator's report went onto the first tree, which an empty batch does not have."""
    for allocator in ("independent", "segment_tree"):
        assert collect("agentrl/GuessNumber-v0", MockPolicy(tokenizer, ["1"]), load_config(), [], allocator) == []


class TwoForksOfOneTurn:
    """One episode, then two segment forks of its first turn in one round, after 2 and 1 tokens."""

    name, needs_snapshots, top_logprobs = "two-forks", True, 0

    def plan(self, state):
        tree = state.trees[0]
        if state.round == 0:
            return [Fresh(0, 1)]
        if state.round == 1:
            self.turn = list(tree.nodes[tree.roots[0]].action_ids)
            return [Branch(0, tree.roots[0], 1, at_token=2), Branch(0, tree.roots[0], 1, at_token=1)]
        return []


def test_two_segment_forks_of_one_turn_in_one_round_fork_where_each_was_planned(tokenizer):
    """Each ``at_token`` counts the node's action as the allocator saw it: the first fork's split
    moved the node's first tokens away, and the second forked that many tokens further on."""
    calls = itertools.count()
    policy = MockPolicy(tokenizer, lambda p: f"alpha beta gamma delta {next(calls)}")
    cfg = load_config(overrides=["rollout.max_turns=1", "env.kwargs={high: 1000, max_turns: 1}"])
    plan = TwoForksOfOneTurn()
    (tree,) = collect("agentrl/GuessNumber-v0", policy, cfg, [0], plan, Budget(3))
    assert not [n.error for n in tree.nodes.values() if n.error]
    heads = []
    for leaf in tree.leaves():
        turn = tree.turn_nodes(leaf.id)
        head = [t for n in turn[:-1] for t in n.action_ids]
        assert head == plan.turn[:len(head)]  # every fork continues the sampled turn's own tokens
        heads.append(len(head))
    # the original turn (split at both points), and one fork after 1 and one after 2 tokens
    assert sorted(heads) == [1, 2, 2]


def test_format_tree_prints_an_episode_deeper_than_pythons_recursion_limit():
    """``agentrl tree`` walked the tree recursively: a 3,000-turn episode raised RecursionError."""
    from agentrl.rollout import format_tree
    from agentrl.types import Node, RolloutTree

    tree, parent = RolloutTree(), None
    for i in range(3000):
        parent = tree.add(Node(action_ids=[1], action_text=f"a{i}"), parent).id
    lines = format_tree(tree).splitlines()
    assert len(lines) == 1 + 3000 and lines[-1].strip().startswith("[2999] ") and "'a2999'" in lines[-1]
    assert lines[1] == "  [0] v0 r=0 tok=1 'a0'"


def test_an_env_whose_opening_failed_to_render_is_handed_back_not_held_to_the_end(tokenizer, monkeypatch):
    """The opening prompt raised something other than a RolloutError (a chat template's
    ValueError): the episode failed as an engine error, but its env, reset and healthy, was
    never handed back; each episode made a new one, all held (sandboxes, child processes)
    until the run ended."""
    import warnings

    from agentrl.envs.guess_number import GuessNumberEnv
    from agentrl.rollout.episodes import EpisodePlayer

    made = []
    real_init = GuessNumberEnv.__init__

    def counting(self, *a, **k):
        made.append(self)
        real_init(self, *a, **k)

    def broken(self, obs, info):
        raise ValueError("chat template re-renders the base conversation; cannot take a delta")

    monkeypatch.setattr(GuessNumberEnv, "__init__", counting)
    monkeypatch.setattr(EpisodePlayer, "_opening", broken)
    cfg = load_config(overrides=["rollout.concurrency=1", "rollout.group_size=3"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        (tree,) = collect("agentrl/GuessNumber-v0", MockPolicy(tokenizer, ["1"]), cfg, [0])
    assert [n.error.startswith("engine error ValueError: chat template") for n in tree.nodes.values()] == [True] * 3
    assert len(made) == 1


def test_an_env_hung_in_reset_or_restore_is_killed_when_its_episode_times_out(tokenizer):
    """A reset or a branch's restore that hung past ``episode_timeout_s`` left its env held, not
    killed, until the run ended (a hung child process, a sandbox, for the rest of the batch)."""
    import asyncio
    import functools

    from agentrl.rollout.budget import BudgetMeter
    from agentrl.rollout.episodes import EpisodePlayer
    from agentrl.types import Node, RolloutTree

    class Hanging:
        def __init__(self):
            self.released = []

        async def acquire(self):
            return "env"

        async def call(self, env, method, *args):
            await asyncio.sleep(60)

        def release(self, env, healthy, hung=False):
            self.released.append((env, healthy, hung))

    cfg = load_config(overrides=["rollout.episode_timeout_s=0.2"])
    for how in ("reset", "restore"):
        envs = Hanging()
        player = EpisodePlayer(MockPolicy(tokenizer, ["1"]), cfg, envs, BudgetMeter())  # type: ignore[arg-type]
        tree = RolloutTree(meta={"seed": 0, "task": 0})
        root = tree.add(Node(action_ids=[1], open=True, snapshot="n0"))
        tree.snapshots["n0"] = type("Point", (), {"env": "snap"})()
        start = (functools.partial(player.start, tree, 0, 0) if how == "reset"
                 else functools.partial(player.resume, tree, 0, root.id, root.id, None, 1))
        asyncio.run(player.episode(start, tree, None, 0, anchor=None if how == "reset" else root.id))
        assert envs.released == [("env", False, True)], how
