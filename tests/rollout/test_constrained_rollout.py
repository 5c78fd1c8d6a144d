"""``rollout.constrain: admissible``: each turn spells an admissible action, and records its list."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.config import load_config
from agentrl.env import TextEnv, register_env
from agentrl.errors import ConfigError
from agentrl.policy import HFPolicy, MockPolicy
from agentrl.policy.constrain import episode_allowed
from agentrl.rollout import Budget, Engine, run_episodes
from agentrl.rollout.allocators import Branch, Fresh
from agentrl.types import read_trees, write_trees

ALFWORLD = ["env.id=agentrl/ALFWorld-v0", "rollout.max_turns=3", "rollout.max_context_tokens=1024",
            "sampling.max_new_tokens=24", "sampling.temperature=1.0", "rollout.seed=2"]


class Forks:
    """Fresh episodes, then a turn branch and a segment fork (inside the second turn) of task 0."""

    name, needs_snapshots, top_logprobs = "forks", True, 0

    def plan(self, state):
        if state.round == 0:
            return [Fresh(t, 1) for t in range(2)]
        if state.round == 1:
            tree = state.trees[0]
            first = tree.nodes[tree.roots[0]]
            second = tree.nodes[first.children[0]]
            return [Branch(0, first.id, 2), Branch(0, second.id, 2, at_token=1)]
        return []


def _constrained_rollouts(tokenizer, tiny_model, *overrides):
    """Constrained ALFWorld trees from the tiny model (with segment forks), and their whole turns."""
    cfg = load_config(overrides=[*ALFWORLD, "rollout.constrain=admissible", *overrides])
    engine = Engine(HFPolicy(tiny_model, tokenizer), cfg, "agentrl/ALFWorld-v0")
    try:
        trees = asyncio.run(engine.run([0, 1], Forks(), Budget(6)))
    finally:
        engine.close()
    return trees, [n for t in trees for n in t.nodes.values() if not n.partial]


def test_constrained_turns_spell_admissible_actions_and_keep_them_through_a_save(tokenizer, tiny_model, tmp_path):
    trees, turns = _constrained_rollouts(tokenizer, tiny_model)
    assert turns and not any(n.error for n in turns)
    for n in turns:
        assert n.admissible, "every ALFWorld turn has a list"
        assert n.action_text in n.admissible  # a random model, and no "Nothing happens."
        assert n.info["invalid_action"] is False
    assert any(n.partial for t in trees for n in t.nodes.values()), "segment forks continued a reply"
    for t in trees:  # the trainer rebuilds every constrained token's mask
        for ep in t.episodes():
            allowed = episode_allowed(tokenizer, ep)
            assert sorted(allowed) == [i for i, m in enumerate(ep.loss_mask) if m]
            assert all(ep.input_ids[i] in ids for i, ids in allowed.items())
    write_trees(tmp_path / "t.jsonl", trees)
    back = read_trees(tmp_path / "t.jsonl")
    assert [t.to_dict() for t in back] == [t.to_dict() for t in trees]
    assert [n.admissible for n in back[0].nodes.values()] == [n.admissible for n in trees[0].nodes.values()]



def test_a_stop_string_inside_an_admissible_action_does_not_cut_it(tokenizer, tiny_model):
    """sampling.stop applies to free turns only: " " would end "go to cabinet 1" after "go"."""
    _, turns = _constrained_rollouts(tokenizer, tiny_model, "sampling.stop=[' ']")
    assert turns and not any(n.error for n in turns)
    assert any(" " in n.action_text for n in turns)
    for n in turns:
        assert n.action_text in n.admissible and n.finish_reason == "stop"
        assert n.info["invalid_action"] is False


def test_without_constrain_turns_sample_freely_and_record_no_list(tokenizer, tiny_model):
    cfg = load_config(overrides=[*ALFWORLD, "rollout.episodes=1", "rollout.max_turns=2"])
    trees = run_episodes("agentrl/ALFWorld-v0", HFPolicy(tiny_model, tokenizer), cfg)
    assert all(n.admissible is None for n in trees[0].nodes.values())


class ListedEveryOtherTurn(TextEnv):
    """Lists two admissible actions on even turns, none on odd ones."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.turn = 0
        return "Start.", {"instruction": "Start.", "admissible_actions": ["look", "wait here"]}

    def step(self, action):
        self.turn += 1
        listed = ["look", "wait here"] if self.turn % 2 == 0 else []
        return "Go on.", 0.0, False, False, {"admissible_actions": listed}


register_env("agentrl/TestListedEveryOtherTurn-v0", entry_point=ListedEveryOtherTurn)


def test_turns_without_a_list_sample_freely_under_constrain(tokenizer, tiny_model):
    cfg = load_config(overrides=["rollout.constrain=admissible", "rollout.episodes=2", "rollout.max_turns=3",
                                 "sampling.max_new_tokens=4", "sampling.temperature=1.0"])
    trees = run_episodes("agentrl/TestListedEveryOtherTurn-v0", HFPolicy(tiny_model, tokenizer), cfg)
    for tree in trees:
        nodes = list(tree.nodes.values())
        assert [n.admissible for n in nodes] == [["look", "wait here"], None, ["look", "wait here"]]
        assert nodes[0].action_text in ("look", "wait here") and nodes[2].action_text in ("look", "wait here")


def test_a_backend_that_cannot_constrain_is_refused(tokenizer):
    with pytest.raises(ValueError, match="rollout.constrain=admissible needs policy.backend hf or vllm"):
        load_config(overrides=["rollout.constrain=admissible", "policy.backend=openai"])
    cfg = load_config(overrides=["rollout.constrain=admissible", "rollout.episodes=1"])
    with pytest.raises(ConfigError, match="rollout.constrain=admissible: the MockPolicy backend"):
        run_episodes("agentrl/ALFWorld-v0", MockPolicy(tokenizer, ["look"]), cfg)
