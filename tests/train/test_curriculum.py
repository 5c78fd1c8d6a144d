"""Curricula (``agentrl.train.curriculum``): the env level of each RL step and of SFT's experts."""

from __future__ import annotations

import json

import pytest
import torch

from agentrl.errors import ConfigError
from agentrl.policy import MockPolicy
from agentrl.train import train
from agentrl.train.config import load_train_config
from agentrl.train.curriculum import CurriculumStage, SFTLevel, check_held_out, stage_at
from agentrl.train.rollouts import step_rollouts
from agentrl.train.sft import expert_trees, sft_level_seeds

ALF = ["env.id=agentrl/ALFWorld-v0", "env.kwargs={max_steps: 30}", "rollout.max_turns=30",
       "rollout.max_context_tokens=4096", "train.micro_batch_tokens=4096", "rollout.group_size=2",
       "train.tasks_per_step=2", "sampling.max_new_tokens=8"]
LOOK, HEAT = "look_at_obj_in_light", "pick_heat_then_place_in_recep"


def _no_bar(total, label):
    return lambda *a, **k: None


def test_stage_at_follows_each_stage_s_steps_and_the_last_runs_to_the_end():
    stages = [CurriculumStage(steps=2), CurriculumStage(steps=3), CurriculumStage()]
    assert [stage_at(stages, k)[0] for k in range(8)] == [0, 0, 1, 1, 1, 2, 2, 2]
    bounded = [CurriculumStage(steps=1), CurriculumStage(steps=1)]
    assert [stage_at(bounded, k)[0] for k in range(4)] == [0, 1, 1, 1]  # past the stages: the last
    assert stage_at([], 3) is None


def test_only_the_last_stage_may_leave_steps_out():
    with pytest.raises(ConfigError, match=r"curriculum\.0\.steps"):
        load_train_config(None, ["train.steps=5", "train.curriculum=[{env_kwargs: {}}, {steps: 2}]"])


def test_stages_that_leave_no_step_to_the_last_fail_naming_the_key():
    with pytest.raises(ConfigError, match=r"curriculum.*4 steps.*train.steps=4"):
        load_train_config(None, ["train.steps=4", "train.curriculum=[{steps: 4}, {env_kwargs: {}}]"])
    with pytest.raises(ConfigError, match=r"curriculum\.0\.bogus"):
        load_train_config(None, ["train.curriculum=[{bogus: 1}]"])


def test_each_step_rolls_out_at_its_stage_s_level(tokenizer):
    cfg = load_train_config(None, ALF + [
        "train.steps=3",
        f"train.curriculum=[{{name: look, steps: 1, env_kwargs: {{families: [{LOOK}]}}}}, "
        f"{{name: heat, env_kwargs: {{families: [{HEAT}]}}, max_turns: 2}}]"])
    policy = MockPolicy(tokenizer, ["look"] * 200)
    seen = []
    for step in range(3):
        trees, stats = step_rollouts(cfg, step, policy, _no_bar)
        families = {n.info["task_type"] for t in trees for n in t.nodes.values()}
        turns = max(len(ep.nodes) for t in trees for ep in t.episodes())
        seen.append((stats["data/curriculum_stage"], families, turns))
    assert seen == [(0, {LOOK}, 30), (1, {HEAT}, 2), (1, {HEAT}, 2)]
    assert cfg.env.kwargs == {"max_steps": 30} and cfg.rollout.max_turns == 30  # the run's own config stays


def test_a_misspelt_level_key_fails_when_the_run_starts_naming_its_stage():
    from agentrl.train.trainer import Trainer

    cfg = load_train_config(None, ALF + ["train.curriculum=[{steps: 1}, {env_kwargs: {max_recepacles: 4}}]"])
    with pytest.raises(ConfigError, match=r"train\.curriculum\.1\.env_kwargs: .*'max_recepacles'.*max_receptacles"):
        Trainer(cfg, policy=object())
    cfg = load_train_config(None, ALF + ["sft.levels=[{episodes: 1}, {episodes: 1, env_kwargs: {familes: []}}]"])
    with pytest.raises(ConfigError, match=r"sft\.levels\.1\.env_kwargs"):
        Trainer(cfg, policy=object())


def test_training_data_from_the_split_the_evaluation_holds_out_is_refused_naming_the_key():
    from agentrl.train.trainer import Trainer

    held = ["train.evaluation.env_kwargs={split: valid_unseen}"]
    for sets, key in [(["env.kwargs={split: valid_unseen}"], r"env\.kwargs\.split"),
                      (["train.curriculum=[{steps: 1}, {env_kwargs: {split: valid_unseen}}]"],
                       r"train\.curriculum\.1\.env_kwargs\.split"),
                      (["sft.levels=[{episodes: 1, env_kwargs: {split: valid_unseen}}]"], r"sft\.levels\.0\.env_kwargs\.split")]:
        cfg = load_train_config(None, ALF + held + sets)
        with pytest.raises(ConfigError, match=key + r": .*'valid_unseen' out for evaluation"):
            Trainer(cfg, policy=object())
    # another split, or an evaluation that names no split (other seeds of the same split), passes
    stages = {"train.curriculum": [CurriculumStage(steps=1, env_kwargs={"split": "valid_seen"})]}
    check_held_out({}, {"split": "valid_unseen"}, stages, "agentrl/ALFWorld-v0", [])
    check_held_out({}, {}, {"train.curriculum": [CurriculumStage(env_kwargs={"split": "valid_unseen"})]})


def test_the_held_out_check_knows_the_env_s_default_split_and_its_other_names():
    # the env's default split is train: evaluating on train while training with no split set trains on it
    with pytest.raises(ConfigError, match=r"env\.kwargs\.split: .*'train' out"):
        check_held_out({}, {"split": "train"}, {}, "agentrl/ALFWorld-v0", [])
    # the real ALFWorld's eval_out_of_distribution is valid_unseen under another name
    real = "agentrl/ALFWorldReal-v0"
    with pytest.raises(ConfigError, match=r"sft\.levels\.0\.env_kwargs\.split"):
        check_held_out({}, {"split": "valid_unseen"},
                       {"sft.levels": [SFTLevel(episodes=1, env_kwargs={"split": "eval_out_of_distribution"})]}, real, [])
    with pytest.raises(ConfigError, match=r"env\.kwargs\.split"):
        check_held_out({"split": "valid_seen"}, {"split": "eval_in_distribution"}, {}, real, [])
    check_held_out({"split": "valid_seen"}, {"split": "eval_out_of_distribution"}, {}, real, [])
    # an unhashable split is compared as it is, not a TypeError from the alias lookup
    with pytest.raises(ConfigError, match=r"env\.kwargs\.split"):
        check_held_out({"split": ["valid_seen"]}, {"split": ["valid_seen"]}, {}, real, [])
    check_held_out({"split": ["train"]}, {"split": ["valid_seen"]}, {}, real, [])


def test_stage_turn_caps_that_a_harness_or_turnopd_would_ignore_are_refused():
    with pytest.raises(ConfigError, match="harness plays its episodes to the end"):
        load_train_config(None, ["train.harness=python agent.py", "train.curriculum=[{max_turns: 3}]"])
    with pytest.raises(ConfigError, match="depth_coverage"):
        load_train_config(None, ["train.distill={teacher: tiny-random, depth_coverage: 0.9}", "rollout.max_turns=4",
                                 "train.curriculum=[{steps: 1, max_turns: 2}, {max_turns: 8}]"])


def test_sft_levels_play_each_level_on_consecutive_seeds(tokenizer):
    cfg = load_train_config(None, ALF + [
        "sft.seed_start=10", "sft.max_turns=30",
        f"sft.levels=[{{episodes: 2, env_kwargs: {{families: [{LOOK}]}}}}, "
        f"{{episodes: 3, env_kwargs: {{families: [{HEAT}]}}}}]"])
    pairs = sft_level_seeds(cfg)
    assert [seeds for _, seeds in pairs] == [[10, 11], [12, 13, 14]]
    for (level_cfg, seeds), family in zip(pairs, [LOOK, HEAT], strict=True):
        trees = expert_trees(cfg.env.id, tokenizer, level_cfg, seeds)
        assert len(trees) == len(seeds)  # the expert wins every one
        assert {n.info["task_type"] for t in trees for n in t.nodes.values()} == {family}
    with pytest.raises(ConfigError, match="levels"):
        load_train_config(None, ["sft.episodes=4", "sft.levels=[{episodes: 2}]"])
    capped = load_train_config(None, ALF + ["sft.max_turns=30", "sft.levels=[{episodes: 2, max_turns: 2}]"])
    ((level_cfg, seeds),) = sft_level_seeds(capped)  # the level's cap before sft.max_turns
    assert all(len(t.nodes) == 2 for t in expert_trees(cfg.env.id, tokenizer, level_cfg, seeds, only_successful=False))


def test_the_sft_command_learns_from_every_level(tmp_path):
    from typer.testing import CliRunner

    from agentrl.train.cli import app

    torch.set_num_threads(1)
    args = ["sft", "--no-progress", "--out", str(tmp_path)]
    for item in ["policy.model=tiny-random", "env.id=agentrl/GuessNumber-v0", "env.kwargs={high: 4, max_turns: 3}",
                 "rollout.max_turns=3", "rollout.max_context_tokens=256", "sampling.max_new_tokens=3",
                 "train.micro_batch_tokens=1024", "train.evaluation.episodes=0", "train.output.tensorboard=false",
                 "train.output.plot=false", "sft.epochs=1", "sft.nll_episodes=4",
                 "sft.levels=[{episodes: 3}, {episodes: 2, env_kwargs: {high: 16, max_turns: 5}, max_turns: 5}]"]:
        args += ["--set", item]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    sft = next(json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"sft"' in x)
    assert sft["sft/tasks"] == 5 and sft["sft/episodes"] == 5


def test_a_training_run_logs_its_stages_and_saves_each_stage_s_trees(tmp_path):
    """GuessNumber(1..4), then (1..8): the saved trees say which range each step played."""
    torch.set_num_threads(1)
    out = tmp_path / "run"
    cfg = load_train_config(None, [
        "policy.model=tiny-random", "env.id=agentrl/GuessNumber-v0", "env.kwargs={high: 4, max_turns: 2}",
        "rollout.max_turns=2", "rollout.group_size=2", "rollout.max_context_tokens=256",
        "sampling.max_new_tokens=3", "train.tasks_per_step=2", "train.steps=3",
        "train.micro_batch_tokens=1024", "train.evaluation.episodes=0", "train.output.tensorboard=false",
        "train.output.plot=false", "train.checkpointing.export_hf=false", f"train.output.dir={out}",
        "train.curriculum=[{steps: 1}, {name: wider, env_kwargs: {high: 8}}]"])
    train(cfg, progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["data/curriculum_stage"] for r in rows if r.get("phase") == "rl"] == [0, 1, 1]
    from agentrl.types import read_trees

    for step, high in [(1, 4), (2, 8), (3, 8)]:
        trees = read_trees(out / "trees" / f"step-{step:06d}.jsonl")
        assert all(f"between 1 and {high}." in t.meta["instruction"] for t in trees)


def test_a_stage_s_env_workers_are_retired_at_the_next_stage_s_first_step_and_only_then(monkeypatch):
    """With ray env workers, step k's rollouts retire the pool of the stage before exactly when k
    starts a new stage; never where the evaluation plays the finished stage's env kwargs."""
    from agentrl.distributed import env_workers
    from agentrl.train.rollouts import retire_finished_stage

    retired = []
    monkeypatch.setattr(env_workers, "retire_env_worker_pool", lambda cfg: retired.append(cfg.env.kwargs) or True)
    base = ["env.id=agentrl/GuessNumber-v0", "env.kwargs={max_turns: 4}", "train.steps=5",
            "train.curriculum=[{env_kwargs: {max_turns: 2}, steps: 2}, {env_kwargs: {max_turns: 3}, steps: 1}, {}]"]
    cfg = load_train_config(None, [*base, "rollout.env_executor=ray", "distributed.ray=auto",
                                   "train.evaluation.episodes=4", "train.evaluation.env_kwargs={max_turns: 8}"])
    assert [retire_finished_stage(cfg, k) for k in range(1, 5)] == [False, True, True, False]
    assert retired == [{"max_turns": 2}, {"max_turns": 3}]
    same_as_eval = load_train_config(None, [*base, "rollout.env_executor=ray", "distributed.ray=auto",
                                            "train.evaluation.episodes=4",
                                            "train.evaluation.env_kwargs={max_turns: 2}"])
    assert not retire_finished_stage(same_as_eval, 2) and retire_finished_stage(same_as_eval, 3)
    assert retired[-1] == {"max_turns": 3}
    by_seeds = load_train_config(None, [*base, "rollout.env_executor=ray", "distributed.ray=auto",
                                        "train.evaluation.episodes=0", "train.evaluation.task_seeds=[7, 8]",
                                        "train.evaluation.env_kwargs={max_turns: 2}"])
    assert not retire_finished_stage(by_seeds, 2)  # evaluated on its seeds list: the same kwargs
    same_kwargs = load_train_config(None, ["env.id=agentrl/GuessNumber-v0", "env.kwargs={max_turns: 4}",
                                           "train.steps=4", "rollout.env_executor=ray", "distributed.ray=auto",
                                           "train.curriculum=[{max_turns: 2, steps: 2}, {}]"])
    assert not retire_finished_stage(same_kwargs, 2)  # both stages play one pool
    in_threads = load_train_config(None, base)  # no env workers: nothing to retire
    assert not any(retire_finished_stage(in_threads, k) for k in range(1, 5)) and len(retired) == 3
