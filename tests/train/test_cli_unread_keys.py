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
from agentrl.train.plan import unread_rollout_keys

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
