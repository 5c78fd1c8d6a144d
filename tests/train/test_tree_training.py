"""Tree rollouts from the engine train end to end, with tree credit (and tree packing)."""

from __future__ import annotations

import pytest
import torch

from agentrl.credit import assign
from agentrl.env import TextEnv, register_env
from agentrl.train.config import load_train_config
from agentrl.train.trainer import Trainer, _Bars


class LetterTurnsEnv(TextEnv):
    """Three turns; each reply holding the letter "e" earns 0.5, so returns differ across branches."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.turn = 0
        text = f"Task {seed}: reply with words that have the letter e."
        return text, {"instruction": text, "tools": []}

    def step(self, action):
        self.turn += 1
        ok = "e" in action.lower()
        return ("Yes." if ok else "No."), 0.5 * ok, self.turn >= 3, False, {}


register_env("agentrl/TestLetterTurns-v0", entry_point=LetterTurnsEnv)

BASE = [
    "policy.model=tiny-random", "env.id=agentrl/TestLetterTurns-v0", "rollout.max_turns=3",
    "rollout.group_size=4", "rollout.max_context_tokens=256", "sampling.max_new_tokens=3",
    "sampling.temperature=1.0", "train.tasks_per_step=2", "train.credit=tree",
    "train.minibatch_size=16", "train.micro_batch_tokens=2048", "train.eval_episodes=0",
    "train.tensorboard=false", "train.export_hf=false", "train.plot=false", "train.lr=1e-3",
]


def tree_trainer(tmp_path, *overrides: str) -> Trainer:
    cfg = load_train_config(None, BASE + [f"train.out_dir={tmp_path}", *overrides])
    return Trainer(cfg, progress=False)


@pytest.mark.parametrize("allocator", ["segment_tree", "entropy_branch"])
def test_engine_trees_with_tree_credit_change_the_weights(tmp_path, allocator):
    torch.set_num_threads(1)
    options = ("rollout.allocator_options={depth: 2, width: 2}" if allocator == "segment_tree"
               else "rollout.allocator_options={threshold: -100.0, k: 2}")
    tr = tree_trainer(tmp_path, f"rollout.allocator={allocator}", options)
    before = {k: v.clone() for k, v in tr.net.state_dict().items()}
    bars = _Bars(tr.console, False)
    trees, roll = tr.rollout(0, bars)
    assert roll["rollout/failed"] == 0 and roll["rollout/episodes"] == 8
    # Branched: some node has two children, so episodes share action tokens.
    assert any(len(n.children) > 1 for t in trees for n in t.nodes.values())
    items = assign(trees, "tree")
    advs = [a for ep, adv in items for a, m in zip(adv, ep.loss_mask, strict=True) if m]
    assert any(a != 0.0 for a in advs), "tree credit gave every action token 0"
    stats = tr.learn(trees, 0, bars)
    assert stats["train/episodes"] > 0 and stats["train/optimizer_steps"] == 1
    assert torch.isfinite(torch.tensor(stats["loss/total"]))
    assert stats["mismatch/max_abs_dlogprob"] < 1e-3  # same weights sampled and scored the tokens
    changed = [k for k, v in tr.net.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "no weight changed after a step with nonzero advantages"


def test_two_steps_of_tree_training_run_through_trainer_run(tmp_path):
    torch.set_num_threads(1)
    tr = tree_trainer(tmp_path, "rollout.allocator=segment_tree",
                      "rollout.allocator_options={depth: 2, width: 2}", "train.steps=2")
    out = tr.run()
    assert tr.step == 2 and tr.policy.version == 2
    assert out["checkpoint"]


class ForkInsideFirstTurn:
    """One episode per task, then two more continuations forked after the first action token."""

    name, needs_snapshots, top_logprobs = "fork_inside", True, 0

    def plan(self, state):
        from agentrl.rollout import Branch, Fresh

        if state.round == 0:
            return [Fresh(task, 1) for task in range(len(state.trees))]
        if state.round == 1:
            return [Branch(task, tree.roots[0], 2, at_token=1) for task, tree in enumerate(state.trees)]
        return []


def test_segment_forks_inside_a_turn_train(tmp_path):
    """A partial node's tokens belong to each continuation's turn; learning still runs."""
    from agentrl.rollout import Budget, collect

    torch.set_num_threads(1)
    tr = tree_trainer(tmp_path)
    trees = collect(tr.cfg.env.id, tr.policy, tr.cfg, [0, 1], ForkInsideFirstTurn(), Budget(6))
    assert all(any(n.partial for n in t.nodes.values()) for t in trees)
    assert all(len(t.leaves()) == 3 for t in trees)
    before = {k: v.clone() for k, v in tr.net.state_dict().items()}
    stats = tr.learn(trees, 0, _Bars(tr.console, False))
    assert torch.isfinite(torch.tensor(stats["loss/total"]))
    assert stats["train/episodes"] > 0  # fixed seeds: the branches' returns differ
    assert any(not torch.equal(v, before[k]) for k, v in tr.net.state_dict().items())
