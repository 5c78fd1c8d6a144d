"""Tree rollouts from the engine train end to end, with tree credit (and tree packing)."""

from __future__ import annotations

import pytest
import torch

from agentrl.credit import assign
from agentrl.env import TextEnv, register_env
from agentrl.train.config import load_train_config
from agentrl.train.metrics import ProgressBars
from agentrl.train.trainer import Trainer


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
    "train.minibatch_size=16", "train.micro_batch_tokens=2048", "train.evaluation.episodes=0",
    "train.output.tensorboard=false", "train.checkpointing.export_hf=false", "train.output.plot=false", "train.optimizer.lr=1e-3",
]


def tree_trainer(tmp_path, *overrides: str) -> Trainer:
    cfg = load_train_config(None, BASE + [f"train.output.dir={tmp_path}", *overrides])
    return Trainer(cfg, progress=False)


@pytest.mark.parametrize("allocator", ["segment_tree", "entropy_branch"])
def test_engine_trees_with_tree_credit_change_the_weights(tmp_path, allocator):
    torch.set_num_threads(1)
    options = "depth: 2, width: 2" if allocator == "segment_tree" else "threshold: -100.0, k: 2"
    tr = tree_trainer(tmp_path, f"rollout.allocator={{name: {allocator}, {options}}}")
    before = {k: v.clone() for k, v in tr.learner.net.state_dict().items()}
    bars = ProgressBars(tr.console, False)
    trees, roll = tr.rollout(0, bars)
    assert roll["rollout/failed"] == 0 and roll["rollout/episodes"] == 8
    # Branched: some node has two children, so episodes share action tokens.
    assert any(len(n.children) > 1 for t in trees for n in t.nodes.values())
    items = assign(trees, "tree")
    advs = [a for ep, adv in items for a, m in zip(adv, ep.loss_mask, strict=True) if m]
    assert any(a != 0.0 for a in advs), "tree credit gave every action token 0"
    stats = tr.learner.learn(trees, 0, bars.start)
    assert stats["train/episodes"] > 0 and stats["train/optimizer_steps"] == 1
    assert torch.isfinite(torch.tensor(stats["loss/total"]))
    assert stats["mismatch/max_abs_dlogprob"] < 1e-3  # same weights sampled and scored the tokens
    changed = [k for k, v in tr.learner.net.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "no weight changed after a step with nonzero advantages"


def test_two_steps_of_tree_training_run_through_trainer_run(tmp_path):
    torch.set_num_threads(1)
    tr = tree_trainer(tmp_path, "rollout.allocator={name: segment_tree, depth: 2, width: 2}", "train.steps=2")
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
    before = {k: v.clone() for k, v in tr.learner.net.state_dict().items()}
    stats = tr.learner.learn(trees, 0, ProgressBars(tr.console, False).start)
    assert torch.isfinite(torch.tensor(stats["loss/total"]))
    assert stats["train/episodes"] > 0  # fixed seeds: the branches' returns differ
    assert any(not torch.equal(v, before[k]) for k, v in tr.learner.net.state_dict().items())


# --------------------------------------------------------------------------- tree packing


def _grads(net) -> dict[str, torch.Tensor]:
    out = {k: p.grad.clone() for k, p in net.named_parameters() if p.grad is not None}
    net.zero_grad(set_to_none=True)
    return out


def _both_layouts(tr: Trainer, samples, fields=("advantages", "old", "behaviour", "versions")):
    """Loss stats, gradients and tokens run of one minibatch in episode rows, then in tree rows."""
    from agentrl.train.batch import minibatch_step
    from agentrl.train.loss import StepLoss

    lr = tr.learner
    args = (lr.net, samples, list(range(len(samples))), StepLoss(tr.cfg.train.loss, tr.policy.version))
    kw = {"fields": fields, "per_token": True, "max_tokens": tr.cfg.train.micro_batch_tokens,
          "pad_id": lr.pad_id, "temperature": lr.temperature}
    lr.net.zero_grad(set_to_none=True)
    ep_stats, ep_tokens = minibatch_step(*args, **kw)
    ep_grads = _grads(lr.net)
    tree_stats, tree_tokens = minibatch_step(*args, **kw, tree=True)
    return ep_stats, ep_grads, ep_tokens, tree_stats, _grads(tr.learner.net), tree_tokens


def _assert_same_update(ep_stats, ep_grads, tree_stats, tree_grads):
    assert tree_stats["loss/total"] == pytest.approx(ep_stats["loss/total"], rel=1e-4, abs=1e-6)
    assert ep_grads.keys() == tree_grads.keys() and ep_grads
    for k, g in ep_grads.items():
        torch.testing.assert_close(tree_grads[k], g, rtol=1e-3, atol=1e-6, msg=k)


def test_tree_packing_gives_the_episode_packed_loss_and_gradients(tmp_path):
    """Turn-level branches: shared prompt and shared first turns, each run once, same update."""
    import copy
    import math

    from agentrl.train.batch import samples_from_credit, score_old

    torch.set_num_threads(1)
    tr = tree_trainer(tmp_path, "rollout.allocator={name: segment_tree, depth: 2, width: 2}")
    trees, _ = tr.rollout(0, ProgressBars(tr.console, False))
    samples = samples_from_credit(assign(trees, "tree"))
    assert len(samples) == 8
    tree_scored = copy.deepcopy(samples)
    ep_tokens = score_old(tr.learner.net, samples, 2048, tr.learner.pad_id, tr.learner.temperature)
    tree_tokens = score_old(tr.learner.net, tree_scored, 2048, tr.learner.pad_id, tr.learner.temperature, tree=True)
    for a, b in zip(samples, tree_scored, strict=True):
        assert b.old == pytest.approx(a.old, abs=1e-5)
    assert tree_tokens < 0.6 * ep_tokens  # the two trees' prompts and first turns ran once
    # Old logprobs off the current ones (a function of the prefix, so equal on shared tokens):
    # ratios leave the clip range and the clipped branch of PPO is compared too.
    for s in samples:
        s.old = [o + (0.4 * math.sin(sum(s.input_ids[:t + 1]) + t) if m else 0.0)
                 for t, (o, m) in enumerate(zip(s.old, s.mask, strict=True))]
    ep_stats, ep_grads, ep_run, tree_stats, tree_grads, tree_run = _both_layouts(tr, samples)
    assert ep_stats["ppo/clip_frac_low"] + ep_stats["ppo/clip_frac_high"] > 0
    _assert_same_update(ep_stats, ep_grads, tree_stats, tree_grads)
    assert tree_run < 0.6 * ep_run


def test_tree_packing_sums_advantages_on_a_forked_turns_shared_tokens(tmp_path):
    """A fork inside a turn: its first token belongs to three episodes with different advantages.

    At ratio 1 (the first pass) the PPO loss is linear in A, so one token with
    the summed advantage gives the same loss and gradient as its three copies.
    """
    from agentrl.rollout import Budget, collect
    from agentrl.train.batch import samples_from_credit, score_old

    torch.set_num_threads(1)
    tr = tree_trainer(tmp_path)
    trees = collect(tr.cfg.env.id, tr.policy, tr.cfg, [0, 1], ForkInsideFirstTurn(), Budget(6))
    samples = samples_from_credit(assign(trees, "tree"))
    assert len(samples) == 6
    # Episode-level advantages of both signs (tree credit's would sum to about 0 over the
    # fork's three continuations, which could hide a mean-instead-of-sum mistake).
    for j, s in enumerate(samples):
        s.advantages = [(0.5, -1.0, 2.0)[j % 3] * m for m in s.mask]
    score_old(tr.learner.net, samples, 2048, tr.learner.pad_id, tr.learner.temperature)
    ep_stats, ep_grads, _, tree_stats, tree_grads, _ = _both_layouts(tr, samples)
    _assert_same_update(ep_stats, ep_grads, tree_stats, tree_grads)


def test_tree_packing_is_exact_when_a_shared_token_has_advantages_of_both_signs_and_the_clip_binds(tmp_path):
    """A forked turn's shared tokens belong to episodes with A = 0.5, -1 and 2, and ratios leave the clip range.

    PPO-clip is per episode: loss(r, 0.5) + loss(r, -1) + loss(r, 2) is not loss(r, 1.5) once the
    clip binds (r > 1 + clip_high clips the A > 0 copies only). A tree node carries the sum of
    its members' positive advantages and, apart, of their negative ones, and the clip applies to
    each sum, so the loss and gradients are episode packing's (before: one summed advantage,
    40% off in the gradient).
    """
    import math

    from agentrl.rollout import Budget, collect
    from agentrl.train.batch import samples_from_credit, score_old

    torch.set_num_threads(1)
    tr = tree_trainer(tmp_path)
    trees = collect(tr.cfg.env.id, tr.policy, tr.cfg, [0, 1], ForkInsideFirstTurn(), Budget(6))
    samples = samples_from_credit(assign(trees, "tree"))
    assert len(samples) == 6
    for j, s in enumerate(samples):
        s.advantages = [(0.5, -1.0, 2.0)[j % 3] * m for m in s.mask]
    score_old(tr.learner.net, samples, 2048, tr.learner.pad_id, tr.learner.temperature)
    for s in samples:  # a function of the prefix, so equal on shared tokens: some ratios leave the range
        s.old = [o + (0.4 * math.sin(sum(s.input_ids[:t + 1]) + t) if m else 0.0)
                 for t, (o, m) in enumerate(zip(s.old, s.mask, strict=True))]
    ep_stats, ep_grads, _, tree_stats, tree_grads, _ = _both_layouts(tr, samples)
    assert ep_stats["ppo/clip_frac_low"] + ep_stats["ppo/clip_frac_high"] > 0
    _assert_same_update(ep_stats, ep_grads, tree_stats, tree_grads)


def test_tree_packing_drops_stale_tokens_from_the_minibatch_mean_like_episode_packing(tmp_path):
    """max_token_staleness drops about a third of the action tokens (a version that is a function of the
    prefix, so equal on shared tokens): the token-mean divides by the minibatch's kept episode
    tokens in both layouts."""
    from agentrl.rollout import Budget, collect
    from agentrl.train.batch import samples_from_credit, score_old

    torch.set_num_threads(1)
    tr = tree_trainer(tmp_path, "train.loss={max_token_staleness: 0}")
    trees = collect(tr.cfg.env.id, tr.policy, tr.cfg, [0, 1], ForkInsideFirstTurn(), Budget(6))
    samples = samples_from_credit(assign(trees, "tree"))
    for j, s in enumerate(samples):
        s.advantages = [(0.5, -1.0, 2.0)[j % 3] * m for m in s.mask]
        s.versions = [(int(sum(s.input_ids[:t + 1]) % 3 != 0) if m else -1) for t, m in enumerate(s.mask)]
    tr.policy.version = 1
    score_old(tr.learner.net, samples, 2048, tr.learner.pad_id, tr.learner.temperature)
    ep_stats, ep_grads, _, tree_stats, tree_grads, _ = _both_layouts(tr, samples)
    assert 0.3 < 1 - ep_stats["mask/kept_frac"] < 0.5
    _assert_same_update(ep_stats, ep_grads, tree_stats, tree_grads)


def test_tree_groups_split_at_the_token_limit_and_keep_shared_prefixes_together():
    from agentrl.train.rows import tree_groups

    seqs = [[1, 2, 3, 4], [9, 9], [1, 2, 3, 5], [1, 2, 7]]
    # Sorted: [1,2,3,4] (4 nodes), [1,2,3,5] (+1), [1,2,7] (+1) -> 6 nodes; [9,9] (+2) -> 8.
    assert tree_groups(seqs, 8) == [[0, 2, 3, 1]]
    assert tree_groups(seqs, 6) == [[0, 2, 3], [1]]
    # At 5: [1,2,3,4] + [1,2,3,5] = 5 nodes; [1,2,7] alone would add 1 more, so it opens a group.
    assert tree_groups(seqs, 5) == [[0, 2], [3, 1]]
    with pytest.raises(ValueError, match="max_tokens=3"):
        tree_groups(seqs, 3)


def test_tree_packing_refuses_losses_it_cannot_weight(tmp_path):
    from agentrl.errors import ConfigError

    with pytest.raises(ConfigError, match="token-mean"):
        tree_trainer(tmp_path, "train.tree_packing=true", "train.loss={agg: seq-mean-token-mean}")
    with pytest.raises(ConfigError, match="kl_coef=0"):
        tree_trainer(tmp_path, "train.tree_packing=true", "train.loss={kl_coef: 0.1}")


def test_tree_packing_refuses_m2po_when_the_config_loads(tmp_path):
    """M2PO's mask drops single episode tokens, which a shared node cannot follow: refused once,
    by the config, before any model loads."""
    from agentrl.errors import ConfigError

    with pytest.raises(ConfigError, match="m2po_tau"):
        tree_trainer(tmp_path, "train.tree_packing=true", "train.loss={m2po_tau: 0.04}")


def test_a_tree_packed_step_runs_through_the_trainer(tmp_path):
    torch.set_num_threads(1)
    tr = tree_trainer(tmp_path, "rollout.allocator={name: segment_tree, depth: 2, width: 2}", "train.tree_packing=true")
    before = {k: v.clone() for k, v in tr.learner.net.state_dict().items()}
    bars = ProgressBars(tr.console, False)
    trees, _ = tr.rollout(0, bars)
    stats = tr.learner.learn(trees, 0, bars.start)
    assert stats["mismatch/max_abs_dlogprob"] < 1e-3  # tree-scored old logprobs match the sampler's
    assert torch.isfinite(torch.tensor(stats["loss/total"]))
    assert any(not torch.equal(v, before[k]) for k, v in tr.learner.net.state_dict().items())
