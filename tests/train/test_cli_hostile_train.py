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


def test_a_row_lost_to_a_kill_after_its_checkpoint_is_logged_on_resume(tmp_path, monkeypatch):
    """A kill between a checkpoint's save and its row's append lost the step's row for good: the
    resume goes on from the checkpoint and never runs that step again."""
    from agentrl.train.metrics import MetricsLogger

    torch.set_num_threads(1)
    out = tmp_path / "run"
    log = MetricsLogger.log

    def killed_after_the_save(self, step, metrics):
        if step == 1 and "time/checkpoint_s" in metrics:  # the save of step 1 is on disk
            raise KeyboardInterrupt
        log(self, step, metrics)

    monkeypatch.setattr(MetricsLogger, "log", killed_after_the_save)
    with pytest.raises(KeyboardInterrupt):
        train(toy_config(out, "train.steps=2", *QUIET), progress=False)
    assert (out / "checkpoints" / "step-000001").is_dir() and [r["step"] for r in _rows(out)] == [0]
    monkeypatch.setattr(MetricsLogger, "log", log)
    train(toy_config(out, "train.steps=2", *QUIET), resume=True, progress=False)
    rows = _rows(out)
    assert [(r["step"], r["phase"]) for r in rows] == [(0, "start"), (1, "rl"), (2, "rl"), (2, "end")]
    assert rows[1]["recovered_from_checkpoint"] is True and {"rollout/reward", "time/step_s"} <= set(rows[1])
    train(toy_config(out, "train.steps=2", *QUIET), resume=True, progress=False)  # its row is there: not again
    assert sum(bool(r.get("recovered_from_checkpoint")) for r in _rows(out)) == 1


def test_an_unreadable_metrics_line_before_the_last_is_named(tmp_path):
    from agentrl.train.metrics import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "loss\n7\n{"step": 3}\n{"step": 4, "lo')
    with pytest.warns(RuntimeWarning) as seen:
        rows = read_metrics(path)
    assert rows == [{"step": 1}, {"step": 3}]
    assert sorted(str(w.message).rsplit(":", 2)[1] for w in seen) == ["2", "3"]  # not line 5, the torn last


def test_a_recovered_row_holds_the_values_its_line_would_have(tmp_path, monkeypatch):
    """The checkpoint kept its row as state.json writes (default=str): a numpy float32 (an env's or
    a rollout source's statistic) came back as the string '0.5', which no curve plots."""
    import numpy as np

    from agentrl.train.metrics import MetricsLogger
    from agentrl.train.trainer import Trainer

    torch.set_num_threads(1)
    out = tmp_path / "run"
    log, one_step = MetricsLogger.log, Trainer._one_step
    monkeypatch.setattr(Trainer, "_one_step", lambda self, bars: {**one_step(self, bars), "x/f32": np.float32(0.5)})

    def killed_after_the_save(self, step, metrics):
        if step == 1 and "time/checkpoint_s" in metrics:
            raise KeyboardInterrupt
        log(self, step, metrics)

    monkeypatch.setattr(MetricsLogger, "log", killed_after_the_save)
    with pytest.raises(KeyboardInterrupt):
        train(toy_config(out, "train.steps=2", *QUIET), progress=False)
    monkeypatch.setattr(MetricsLogger, "log", log)
    train(toy_config(out, "train.steps=2", *QUIET), resume=True, progress=False)
    [row] = [r for r in _rows(out) if r.get("recovered_from_checkpoint")]
    assert row["x/f32"] == 0.5


def test_ctrl_c_names_the_checkpoint_a_resume_continues_from(tmp_path, monkeypatch):
    """Ctrl-C ended `agentrl train` with no word on what was kept; now it names the newest
    checkpoint and how to go on from it, with exit code 130 (128 + SIGINT)."""
    from agentrl.train.metrics import MetricsLogger

    torch.set_num_threads(1)
    out = tmp_path / "run"
    log = MetricsLogger.log

    def interrupted_in_step_2(self, step, metrics):
        if step == 2:
            raise KeyboardInterrupt
        log(self, step, metrics)

    monkeypatch.setattr(MetricsLogger, "log", interrupted_in_step_2)
    args = ["train", "--no-progress", "--out", str(out), "--steps", "3", "--set", "policy.model=tiny-random",
            "--set", "train.evaluation.episodes=0", "--set", "train.checkpointing.every=1",
            "--set", "rollout.group_size=2", "--set", "train.tasks_per_step=1", "--set", "train.output.plot=false"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 130, (res.output, res.exception)
    # step 2's checkpoint is saved before its row is logged
    assert (f"interrupted: the newest checkpoint is {out / 'checkpoints' / 'step-000002'}; the same command "
            "with --resume (and without --overwrite) continues from it") in res.output
    monkeypatch.setattr(MetricsLogger, "log", log)
    res = CliRunner().invoke(app, [*args, "--resume"])
    assert res.exit_code == 0, (res.output, res.exception)
    assert (out / "checkpoints" / "step-000003").is_dir()
