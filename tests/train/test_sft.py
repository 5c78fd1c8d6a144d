"""SFT: expert trajectories are token-exact rollouts, and cloning them lowers NLL and wins more."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from agentrl.policy import MockPolicy
from agentrl.rollout import collect
from agentrl.train.cli import app
from agentrl.train.config import load_train_config
from agentrl.train.sft import expert_tree, expert_trees

GUESS = ["env.id=agentrl/GuessNumber-v0", "env.kwargs={high: 4, max_turns: 3}", "rollout.max_turns=3",
         "rollout.max_context_tokens=256", "sampling.max_new_tokens=3"]


def test_expert_episode_is_the_rollout_a_policy_playing_its_actions_would_make(tokenizer):
    cfg = load_train_config(None, GUESS + ["env.kwargs={high: 32, max_turns: 8}", "rollout.max_turns=8",
                                           "rollout.show_admissible=true", "rollout.max_context_tokens=2048"])
    tree = expert_tree(cfg.env.id, tokenizer, cfg, seed=5)
    expert = next(tree.episodes())
    actions = [n.action_text for n in expert.nodes]
    assert tree.meta["expert_success"] and len(actions) >= 2
    assert actions[0] == "16"  # bisection of [1, 32]
    played = collect(cfg.env.id, MockPolicy(tokenizer, actions), cfg, [5])
    rollout = next(played[0].episodes())
    assert rollout.input_ids == expert.input_ids
    assert rollout.loss_mask == expert.loss_mask
    assert rollout.turn_spans == expert.turn_spans


def test_alfworld_expert_trees_mask_only_the_expert_commands(tokenizer):
    cfg = load_train_config(None, ["env.id=agentrl/ALFWorld-v0", "rollout.max_turns=30",
                                   "rollout.max_context_tokens=4096", "sft.max_turns=30"])
    trees = expert_trees(cfg.env.id, tokenizer, cfg, [0, 1, 2], only_successful=False)
    assert all(t.meta["expert_success"] for t in trees)
    for tree in trees:
        ep = next(tree.episodes())
        for node, (start, end) in zip(ep.nodes, ep.turn_spans, strict=True):
            assert ep.input_ids[start:end] == tokenizer.encode(node.action_text) + [tokenizer.eos_token_id]
            assert set(ep.loss_mask[start:end]) == {1}
        assert sum(ep.loss_mask) == sum(e - s for s, e in ep.turn_spans)  # nothing else trains
        assert ep.nodes[-1].terminated and ep.nodes[-1].reward == 1.0


def test_sft_command_clones_the_expert(tmp_path):
    """``agentrl sft`` on GuessNumber(1..4): expert NLL falls, greedy held-out wins go up from 0."""
    torch.set_num_threads(1)
    args = ["sft", "--no-progress", "--out", str(tmp_path), "--episodes", "32"]
    for item in GUESS + ["policy.model=tiny-random", "sampling.temperature=0", "train.eval_episodes=16",
                         "train.micro_batch_tokens=2048", "train.tensorboard=false", "train.plot=false",
                         "sft.epochs=8", "sft.lr=5e-3", "sft.minibatch_size=8"]:
        args += ["--set", item]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in rows if r["phase"] == "start")
    sft = next(r for r in rows if r["phase"] == "sft")
    assert sft["sft/episodes"] == 32 and sft["sft/optimizer_steps"] == 8 * 4
    print(f"sft: expert NLL {sft['sft/nll_before']:.2f} -> {sft['sft/nll_after']:.2f}, "
          f"greedy held-out success {start['eval/success']:.3f} -> {sft['eval/success']:.3f}")
    # Over train.seed 0-4: NLL 0.36-0.53 after, success 0.625 each. At lr 1e-2 for 6 epochs one
    # seed of five did not converge (NLL 1.54, success 0).
    assert sft["sft/nll_before"] > 8.0 and sft["sft/nll_after"] < 1.0
    assert start["eval/success"] == 0.0 and sft["eval/success"] >= 0.3
    assert "after_sft" in res.output and "after RL" not in res.output  # SFT only: no RL row
    assert (tmp_path / "checkpoints" / "step-000000" / "hf" / "config.json").exists()


def test_the_alfworld_example_trains_alfworld_through_the_train_command(tmp_path):
    """``agentrl train --config examples/alfworld.yaml`` runs as written, shrunk to the tiny model:
    SFT on the ALFWorld expert, one RL step on ALFWorld-v0 with LoRA, an evaluation."""
    torch.set_num_threads(1)
    config = Path(__file__).resolve().parents[2] / "examples" / "alfworld.yaml"
    args = ["train", "--config", str(config), "--no-progress", "--out", str(tmp_path), "--steps", "1"]
    for item in ["policy.model=tiny-random", "sft.episodes=2", "sft.epochs=1", "rollout.group_size=2",
                 "sampling.max_new_tokens=2",
                 "train.tasks_per_step=1", "train.eval_episodes=1", "train.eval_every=1",
                 "train.tensorboard=false", "train.plot=false", "train.export_hf=false",
                 "train.skip_zero_advantage=false"]:
        args += ["--set", item]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, (res.output, res.exception)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    sft = next(r for r in rows if r["phase"] == "sft")
    [step] = [r for r in rows if r["phase"] == "rl"]
    assert sft["sft/episodes"] == 2 and sft["sft/nll_after"] < sft["sft/nll_before"]
    assert step["rollout/episodes"] == 2 and step["rollout/failed"] == 0 and step["rollout/env_steps"] > 0
    assert step["policy/version"] == 2  # the SFT'd weights, then one RL update
    assert any("eval/success" in r for r in rows if r["phase"] in ("rl", "end"))
