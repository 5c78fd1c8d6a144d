"""One config serves ``agentrl rollout``, ``eval`` and ``train``: the rollout keys that
``agentrl train`` and ``agentrl sft`` do not read are named at start, with the key they read
instead, not ignored without a word."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from agentrl.train import trainer
from agentrl.train.cli import app
from agentrl.train.config import load_train_config
from agentrl.train.plan import held_out_overlaps, unread_rollout_keys

DRY = {"dry_run": True, "plan": {}, "phases": {}, "checkpoint": None, "metrics": None, "learning_curve": None}


def test_rollout_keys_train_does_not_read_are_named_with_the_keys_it_reads():
    cfg = load_train_config(overrides=["rollout.seed=500", "rollout.episodes=3", "rollout.out_dir=runs/r",
                                       "train.task_seed_start=7", "train.output.dir=runs/t"])
    said = unread_rollout_keys(cfg, "train")
    assert len(said) == 3
    seed, episodes, out = said
    assert seed.startswith("rollout.seed=500 ") and "train.task_seed_start=7" in seed
    assert "train.evaluation.seed_start=1000000" in seed
    assert episodes.startswith("rollout.episodes=3 ") and "train.tasks_per_step=4" in episodes
    assert out.startswith("rollout.out_dir=runs/r ") and "train.output.dir=runs/t" in out
    sft = unread_rollout_keys(cfg, "sft")
    assert "sft.seed_start=0" in sft[0] and "sft.episodes=0" in sft[1]


def test_a_config_that_leaves_them_out_gets_no_warning():
    cfg = load_train_config(overrides=["sampling.temperature=0.5", "train.task_seed_start=7"])
    assert unread_rollout_keys(cfg, "train") == []


@pytest.mark.parametrize("command", ["train", "sft"])
def test_the_commands_print_the_warning_before_the_run(tmp_path, monkeypatch, command):
    """The file is the one ``agentrl rollout`` reads too; the run itself is not wanted here."""
    monkeypatch.setattr(trainer, "train", lambda cfg, **kw: DRY)
    path = tmp_path / "all.yaml"
    path.write_text(yaml.safe_dump({"rollout": {"seed": 500, "episodes": 3}, "sft": {"episodes": 2}}))
    result = CliRunner().invoke(app, [command, "--config", str(path), "--no-progress"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # rich wraps long lines
    assert f"warning: rollout.seed=500 is not read by agentrl {command}" in text
    assert f"warning: rollout.episodes=3 is not read by agentrl {command}" in text


@pytest.mark.parametrize(("sets", "said"), [
    (["train.evaluation.seed_start=100", "train.steps=20", "train.tasks_per_step=8"],
     "16 of the 16 held-out task seeds (train.evaluation) are RL training tasks"),  # RL plays 0-159
    (["train.evaluation.task_seeds=[3, 500, 9]", "sft.episodes=5", "train.task_seed_start=10000"],
     "1 of the 3 held-out task seeds (train.evaluation) are SFT expert tasks"),  # SFT plays 0-4
    (["train.evaluation.seed_start=30", "train.evaluation.episodes=4", "train.task_seeds=[31, 33, 7]"],
     "2 of the 4 held-out task seeds (train.evaluation) are RL training tasks"),
])
def test_held_out_seeds_that_are_trained_on_are_named(sets, said):
    cfg = load_train_config(overrides=sets)
    [warning] = held_out_overlaps(cfg)
    assert warning.startswith(said), warning


@pytest.mark.parametrize("sets", [
    [],  # the defaults: RL from 0, held out from 1,000,000
    ["train.evaluation.seed_start=100", "train.evaluation.env_kwargs={high: 4}"],  # other tasks on those seeds
    ["train.evaluation.seed_start=100", "train.steps=0", "sft.episodes=0"],
    ["train.task_seeds=[1, 2, 3, 9]", "train.steps=1", "train.tasks_per_step=2", "train.evaluation.task_seeds=[9]"],
])
def test_disjoint_or_other_env_held_out_seeds_get_no_warning(sets):
    assert held_out_overlaps(load_train_config(overrides=sets)) == []
