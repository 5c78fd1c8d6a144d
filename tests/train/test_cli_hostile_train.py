"""From a hostile review of `agentrl train` as users drive it: resumes after a changed config or
with evaluation off, and env keywords the env does not take."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from agentrl.errors import ConfigError
from agentrl.train.cli import app
from agentrl.train.trainer import train
from tests.train.test_trainer import toy_config

QUIET = ["train.evaluation.episodes=0", "train.output.plot=false", "train.checkpointing.every=1",
         "rollout.group_size=2", "train.tasks_per_step=1"]


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_resume_with_evaluation_off_keeps_the_sft_row_and_logs_no_second_start(tmp_path):
    """Evaluation off records no phase: the resume took the run for a fresh one, emptied
    metrics.jsonl (the SFT row, not redone, was lost) and logged another step-0 start row."""
    torch.set_num_threads(1)
    out = tmp_path / "run"
    sft = ["env.id=agentrl/GuessNumber-v0", "sft.episodes=2", "sft.epochs=1", "sampling.max_new_tokens=4"]
    train(toy_config(out, "train.steps=0", *sft, *QUIET), progress=False)
    train(toy_config(out, "train.steps=2", *sft, *QUIET), resume=True, progress=False)
    phases = [(r["step"], r["phase"]) for r in _rows(out)]
    assert phases == [(0, "start"), (0, "sft"), (0, "end"), (1, "rl"), (2, "rl"), (2, "end")]


def test_a_resume_with_another_config_says_which_keys_changed(tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "run"
    train(toy_config(out, "train.steps=1", *QUIET), progress=False)
    console = Console(record=True, width=300)
    train(toy_config(out, "train.steps=2", "env.id=agentrl/GuessNumber-v0", "rollout.max_turns=2", *QUIET),
          resume=True, progress=False, console=console)
    text = console.export_text()
    assert "env.id: 'agentrl/TestLetter-v0' -> 'agentrl/GuessNumber-v0'" in text, text
    assert "rollout.max_turns: 1 -> 2" in text and "train.steps: 1 -> 2" in text


def test_a_resume_with_another_trainable_setting_names_the_key(tmp_path):
    """It was a ValueError and a traceback: 'checkpoint does not fit the model: unknown [...]'."""
    torch.set_num_threads(1)
    out = tmp_path / "run"
    train(toy_config(out, "train.steps=1", *QUIET), progress=False)
    with pytest.raises(ConfigError, match=r"train\.trainable: the checkpoint trained 'full', this run 'lora'"):
        train(toy_config(out, "train.steps=2", "train.trainable=lora", *QUIET), resume=True, progress=False)


@pytest.mark.parametrize("key", ["env.kwargs", "train.evaluation.env_kwargs"])
def test_an_env_keyword_the_env_does_not_take_is_a_config_error_before_the_run(tmp_path, key):
    """Every episode failed making its env (a TypeError each), and the run went on to its end."""
    out = tmp_path / "run"
    args = ["train", "--no-progress", "--out", str(out), "--steps", "1", "--set", "policy.model=tiny-random",
            "--set", f"{key}.bogus=1", "--set", "train.evaluation.episodes=1"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, (res.output, res.exception)
    assert f"error: {key}: agentrl/GuessNumber-v0 takes no keyword 'bogus'" in " ".join(res.output.split())
    assert not out.exists()


@pytest.mark.parametrize("damage", ["state.json", "trainable.safetensors"])
def test_a_resume_from_a_damaged_checkpoint_names_it_and_what_to_do(tmp_path, damage):
    """It was a FileNotFoundError (or safetensors') traceback."""
    torch.set_num_threads(1)
    out = tmp_path / "run"
    train(toy_config(out, "train.steps=2", *QUIET), progress=False)
    newest = out / "checkpoints" / "step-000002"
    if damage == "state.json":
        (newest / damage).unlink()
    else:
        (newest / damage).write_bytes((newest / damage).read_bytes()[:100])
    with pytest.raises(ConfigError, match=r"cannot resume from .*step-000002: .*remove that folder to resume "
                                          r"from the checkpoint before it \(step-000001\)"):
        train(toy_config(out, "train.steps=3", *QUIET), resume=True, progress=False)
