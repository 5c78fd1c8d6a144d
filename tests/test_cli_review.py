"""From a hostile review of the ``agentrl`` commands: flags that contradict each other, and
flags one command silently overrode."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from agentrl.train.cli import register as register_train

runner = CliRunner()
app = typer.Typer()


@app.callback()
def _main() -> None:
    """A host app for the train commands."""


register_train(app)


def test_resume_and_overwrite_together_are_an_error_before_anything_loads(tmp_path):
    """--resume won and --overwrite was ignored without a word: the user who asked to start
    over continued the old run (or, with no checkpoint yet, started one)."""
    out = tmp_path / "run"
    res = runner.invoke(app, ["train", "--resume", "--overwrite", "--steps", "0", "--out", str(out),
                              "--set", "policy.model=tiny-random", "--set", "policy.backend=hf", "--no-progress"])
    assert res.exit_code == 2, res.output
    said = "--resume continues the run in the output folder and --overwrite starts it over"
    assert "".join(said.split()) in "".join(res.output.split())  # rich wraps lines
    assert not out.exists()


def _main_app() -> typer.Typer:
    from agentrl.cli import app as main_app
    from agentrl.eval_cli import register

    host = typer.Typer()
    host.registered_commands += main_app.registered_commands
    register(host)
    return host


@pytest.mark.parametrize(("command", "key"), [
    (["rollout", "--env", "agentrl/GuessNumber-v0", "--episodes", "2"], "rollout.out_dir"),
    (["eval", "--env", "agentrl/GuessNumber-v0", "--episodes", "2"], "--out")])
def test_a_second_run_into_a_folder_in_use_is_an_error_before_its_episodes(tmp_path, command, key):
    """Two evals of two checkpoints left at the default --out (runs/eval) both ran; both wrote
    trajectories through the same .trajectories.jsonl.tmp, and the last summary.json won."""
    from agentrl.train.output_lock import output_lock

    out = tmp_path / "ev"
    with output_lock(out, "another"):  # a run already writing there
        res = runner.invoke(_main_app(), [*command, "--backend", "mock", "--no-progress", "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert f"{key}={out}isinusebyanotherrun" in "".join(res.output.split())
    assert "loading model" not in res.output and not (out / "summary.json").exists()
    res = runner.invoke(_main_app(), [*command, "--backend", "mock", "--no-progress", "--out", str(out)])
    assert res.exit_code == 0, res.output  # the lock is released with the run that held it
    assert (out / "summary.json").exists()


@pytest.mark.parametrize("width", ["0", "-5"])
def test_tree_refuses_a_width_that_shows_nothing(tmp_path, width):
    """--width 0 showed each action whole but its last character, then '…' (text[:-1]); a
    negative one cut from the end."""
    out = tmp_path / "run"
    res = runner.invoke(_main_app(), ["rollout", "--env", "agentrl/GuessNumber-v0", "--episodes", "1",
                                      "--backend", "mock", "--no-progress", "--out", str(out)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(_main_app(), ["tree", str(out), "--width", width])
    assert res.exit_code == 2 and "Invalid value for '--width'" in res.output, res.output


def test_sft_refuses_rl_steps_it_would_run_and_then_leave_out_of_its_report(tmp_path):
    """``agentrl sft --set train.steps=3`` ran 3 RL steps after SFT (the user's --set came after
    the command's own train.steps=0), then dropped the 'after RL' row from its report."""
    res = runner.invoke(app, ["sft", "--episodes", "2", "--set", "train.steps=3", "--out", str(tmp_path / "run"),
                              "--set", f"policy.model={tmp_path / 'no-model'}", "--no-progress"])
    assert res.exit_code == 2, res.output
    assert "agentrlsftrunsnoRLsteps(train.steps=3wasset)" in "".join(res.output.split()), res.output
