"""The saved trees carry what the update trained on: the loss's advantages, the teacher and student log-probs.

Each test runs one real step (tiny model, GuessNumber), records what
``loss.row_loss`` was handed, and reads the trees the run wrote to disk.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import agentrl.train.batch as batch_module
from agentrl.credit import assign
from agentrl.train.config import load_train_config
from agentrl.train.trainer import Trainer
from agentrl.types import read_trees
from agentrl.viewer import CreditSpec, tree_payload

GUESS = ["policy.model=tiny-random", "env.id=agentrl/GuessNumber-v0",
         "env.kwargs={high: 4, max_turns: 3}", "rollout.max_turns=3", "rollout.max_context_tokens=256",
         "sampling.max_new_tokens=3", "sampling.temperature=1.0", "train.micro_batch_tokens=2048",
         "train.evaluation.episodes=0", "train.output.tensorboard=false", "train.output.plot=false", "train.checkpointing.export_hf=false",
         "train.tasks_per_step=2", "train.steps=1", "train.minibatch_size=8"]


def run_steps(tmp_path, monkeypatch, *overrides: str, steps: int = 1) -> tuple[dict, dict, dict]:
    """``steps`` training steps; ({step: the trees as saved on disk}, {(step, tree, leaf): advantages
    the loss read on the episode's action tokens}, {"rows": the tree rows the loss read}, tree packing)."""
    torch.set_num_threads(1)
    tr = Trainer(load_train_config(None, GUESS + [f"train.output.dir={tmp_path}", f"train.steps={steps}",
                                                  *overrides]), progress=False)
    where: dict[int, tuple[int, int, int]] = {}  # id(leaf node) -> (step, tree index, leaf id)
    learn = tr.learner.learn

    def learn_and_map(trees: list, step: int, start_bar: Any) -> dict:
        where.update({id(n): (step + 1, k, n.id) for k, t in enumerate(trees) for n in t.nodes.values()})
        return learn(trees, step, start_bar)

    tr.learner.learn = learn_and_map
    seen: dict[tuple[int, int, int], list[float]] = {}
    tree_rows: list[tuple[list[tuple[int, int, int]], Any, torch.Tensor]] = []
    row_loss = batch_module.row_loss

    def spy(logprobs: torch.Tensor, entropies: torch.Tensor, row: Any, spec: Any) -> Any:
        samples = row.minibatch.samples
        adv = row.values["advantages"].detach().cpu()
        if adv.dim() == 3:  # a tree row: per node, the members' positive and negative sums
            leaves = [where[id(samples[i].episode.nodes[-1])] for i in row.seq_index]
            tree_rows.append((leaves, row, adv[0]))
        else:
            for i, values in zip(row.seq_index, row.per_sample(adv), strict=True):
                ep = samples[i].episode
                seen[where[id(ep.nodes[-1])]] = [a for a, m in zip(values, ep.loss_mask, strict=True) if m]
        return row_loss(logprobs, entropies, row, spec)

    monkeypatch.setattr(batch_module, "row_loss", spy)
    tr.run()
    saved = {k: read_trees(tmp_path / "trees" / f"step-{k:06d}.jsonl") for k in range(1, steps + 1)}
    return saved, seen, {"rows": tree_rows}


def run_one_step(tmp_path, monkeypatch, *overrides: str) -> tuple[list, dict, dict]:
    """``run_steps`` for one step, keyed without it: (trees, {(tree, leaf): advantages}, tree rows)."""
    saved, seen, rows = run_steps(tmp_path, monkeypatch, *overrides)
    return saved[1], {key[1:]: v for key, v in seen.items()}, rows


def test_saved_advantages_are_the_ones_the_loss_used_with_the_teacher_signal(tmp_path, monkeypatch):
    trees, seen, _ = run_one_step(tmp_path, monkeypatch, "rollout.group_size=4",
                                  "train.distill={teacher: expert, weight: 0.5}")
    assert len(trees) == 2 and seen
    for k, tree in enumerate(trees):
        saved = tree.meta["token_values"]
        assert set(saved) == {str(leaf.id) for leaf in tree.leaves()}
        for leaf, vals in saved.items():
            assert vals["advantages"] == pytest.approx(seen[(k, int(leaf))], abs=1e-4)
        # The advantage is GRPO's plus 0.5 * (log pi_teacher - log pi_student) on every action token.
        for ep, a_rl in assign([tree], "grpo"):
            vals = saved[str(ep.nodes[-1].id)]
            rl = [a for a, m in zip(a_rl, ep.loss_mask, strict=True) if m]
            ratio = [t - s for t, s in zip(vals["teacher_logprobs"], vals["student_logprobs"], strict=True)]
            assert len(ratio) == len(rl) == sum(ep.loss_mask)
            assert vals["advantages"] == pytest.approx([a + 0.5 * r for a, r in zip(rl, ratio, strict=True)],
                                                       abs=1e-3)
        # The page shows them as saved, with the teacher-student log-ratio.
        p = tree_payload(tree, CreditSpec("grpo"))
        assert p["credit"]["saved"] and p["credit"]["note"].startswith("saved: the values the update used")
        assert p["has_teacher"] and p["teacher_note"].startswith("saved")
        assert all(e["trained"] is True for e in p["episodes"])
        leaf = tree.leaves()[0].id
        path = tree.path(leaf)
        assert p["tokens"][str(path[0].id)]["teacher"][str(leaf)] == pytest.approx(
            saved[str(leaf)]["teacher_logprobs"][:len(path[0].action_ids)])


def test_episodes_left_out_of_the_update_are_marked_with_their_reason(tmp_path, monkeypatch):
    # MC-GRPO on groups of 3: each group's median episode (the pivot) carries no gradient.
    trees, seen, _ = run_one_step(tmp_path, monkeypatch, "rollout.group_size=3", "train.credit=mc_grpo",
                                  "train.skip_zero_advantage=false")
    for k, tree in enumerate(trees):
        saved = tree.meta["token_values"]
        left = {leaf for leaf, v in saved.items() if v.get("trained") is False}
        assert len(left) == 1 and "pivot" in saved[left.pop()]["reason"]
        for leaf, vals in saved.items():
            assert ((k, int(leaf)) in seen) == ("advantages" in vals)  # saved exactly when the loss read it
            if "advantages" in vals:
                assert vals["advantages"] == pytest.approx(seen[(k, int(leaf))], abs=1e-4)
                assert "teacher_logprobs" not in vals  # no distillation
        p = tree_payload(tree, CreditSpec("mc_grpo"))
        untrained = [e for e in p["episodes"] if e["trained"] is False]
        assert len(untrained) == 1 and "pivot" in untrained[0]["untrained_reason"]
        assert not p["has_teacher"] and p["teacher_note"].startswith("none saved")


def test_skip_zero_advantage_leaves_are_marked_not_trained(tmp_path, monkeypatch):
    trees, seen, _ = run_one_step(tmp_path, monkeypatch, "rollout.group_size=4")  # grpo, skip_zero_advantage
    # The random model rarely wins: a group of four equal rewards has all-zero advantages.
    assert any(len({leaf.reward for leaf in t.leaves()}) == 1 for t in trees)
    for k, tree in enumerate(trees):
        saved = tree.meta["token_values"]
        same = len({leaf.reward for leaf in tree.leaves()}) == 1  # every advantage 0: skipped
        for leaf in tree.leaves():
            vals = saved[str(leaf.id)]
            if same:
                assert vals == {"trained": False, "reason": "every advantage 0 (train.skip_zero_advantage)"}
                assert (k, leaf.id) not in seen
            else:
                assert vals["advantages"] == pytest.approx(seen[(k, leaf.id)], abs=1e-4)


def test_tree_packing_sums_the_saved_per_episode_advantages(tmp_path, monkeypatch):
    trees, seen, rows = run_one_step(
        tmp_path, monkeypatch, "rollout.group_size=4", "train.credit=tree", "train.tree_packing=true",
        "rollout.allocator={name: segment_tree, depth: 2, width: 2, segment_turns: 1}",
        "train.distill={teacher: expert, weight: 0.5}")
    assert rows["rows"] and not seen  # every minibatch ran as prefix trees
    assert any(len(n.children) > 1 for t in trees for n in t.nodes.values())  # shared action tokens
    checked = 0
    for leaves, row, node_sums in rows["rows"]:
        want = torch.zeros_like(node_sums)
        for (_, k, leaf), nodes, mask in zip(leaves, row.trie.index, row.sample_masks, strict=True):
            saved = iter(trees[k].meta["token_values"][str(leaf)]["advantages"])
            for node, m in zip(nodes, mask.tolist(), strict=True):
                if m:
                    a = next(saved)
                    want[node, 0 if a > 0 else 1] += a
            assert next(saved, None) is None
            checked += 1
        assert torch.allclose(node_sums, want, atol=1e-3), (node_sums - want).abs().max()
    assert checked == sum(len(t.leaves()) for t in trees)


def test_asynchronous_steps_save_the_values_of_their_own_update(tmp_path, monkeypatch):
    # Step 2's trees come from the producer's queue (sampled before step 1's update); they are
    # written after step 2's update, with its values.
    saved, seen, _ = run_steps(tmp_path, monkeypatch, "rollout.group_size=4", "train.distill={teacher: expert}",
                               "train.asynchronous={max_batch_staleness: 1}", steps=2)
    for step, trees in saved.items():
        for k, tree in enumerate(trees):
            for leaf, vals in tree.meta["token_values"].items():
                assert vals["advantages"] == pytest.approx(seen[(step, k, int(leaf))], abs=1e-4)
                assert len(vals["teacher_logprobs"]) == len(vals["advantages"])
    assert {step for step, _, _ in seen} == {1, 2}


def test_a_failed_update_still_saves_its_steps_trees(tmp_path):
    """The trees are written after the update, so that they carry its values; an update that
    raises must not take its step's trees with it (nothing is lost)."""
    torch.set_num_threads(1)
    tr = Trainer(load_train_config(None, GUESS + [f"train.output.dir={tmp_path}"]), progress=False)

    def broken(trees: list, step: int, start_bar: Any) -> dict:
        raise RuntimeError("update failed")

    tr.learner.learn = broken
    with pytest.raises(RuntimeError, match="update failed"):
        tr.run()
    trees = read_trees(tmp_path / "trees" / "step-000001.jsonl")
    assert len(trees) == 2 and all("token_values" not in t.meta for t in trees)


def test_tokens_the_staleness_bound_drops_are_saved_as_not_trained(tmp_path, monkeypatch):
    # Step 2 trains on trees the producer started before step 1's update (one version old), so
    # with max_token_staleness 0 the loss counts none of their version-0 tokens; a later turn
    # may have been sampled after the sync (version 1). Each saved value follows its token's version.
    saved, _, _ = run_steps(tmp_path, monkeypatch, "rollout.group_size=4", "train.asynchronous={max_batch_staleness: 1}",
                            "train.loss.max_token_staleness=0", "train.skip_zero_advantage=false", steps=2)
    seen = {1: [], 2: []}  # (the version that sampled the token, its saved advantage)
    for step, trees in saved.items():
        for tree in trees:
            for leaf, vals in tree.meta["token_values"].items():
                versions = [n.version for n in tree.path(int(leaf)) for _ in n.action_ids]
                if vals.get("trained") is False:  # all of it too stale: said once, for the episode
                    assert "max_token_staleness" in vals["reason"] and all(v < step - 1 for v in versions)
                    seen[step] += [(v, None) for v in versions]
                    continue
                assert len(versions) == len(vals["advantages"])
                seen[step] += list(zip(versions, vals["advantages"], strict=True))
    assert seen[1] and all(v == 0 and a is not None for v, a in seen[1])
    assert all((a is None) == (v < 1) for v, a in seen[2]), seen[2]
    assert any(a is None for _, a in seen[2])  # the first turns at least were sampled before the sync
