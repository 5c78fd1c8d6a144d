"""From a hostile review of the `agentrl` commands as users drive them: bad input is an
`error: ...` naming the key, exit code 2, before any work is done."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from agentrl.cli import app as main_app
from agentrl.eval_cli import register
from agentrl.train.cli import register as register_train
from agentrl.viewer.cli import register as register_viewer

runner = CliRunner()
app = typer.Typer()
app.registered_commands += main_app.registered_commands
register(app)
register_train(app)
register_viewer(app)
MOCK = ["--backend", "mock", "--set", "policy.mock_responses=['16']", "--no-progress"]


def _text(res) -> str:
    return "".join(res.output.split())  # rich wraps long lines, paths too


@pytest.mark.parametrize("command", [["rollout", "--env", "agentrl/GuessNumber-v0", "--episodes", "2"],
                                     ["eval", "--env", "agentrl/GuessNumber-v0", "--episodes", "2"]])
def test_an_env_keyword_the_env_does_not_take_is_an_error_not_a_failed_run(tmp_path, command):
    """It ran every episode, each failed making its env (TypeError), and exited 0."""
    out = tmp_path / "run"
    res = runner.invoke(app, [*command, *MOCK, "--out", str(out), "--set", "env.kwargs.bogus=1"])
    assert res.exit_code == 2, (res.output, res.exception)
    assert "error:env.kwargs:agentrl/GuessNumber-v0takesnokeyword'bogus';ittakeshigh,max_turns" in _text(res)
    assert not out.exists()


def test_an_env_that_takes_any_keyword_is_not_refused(tmp_path):
    from agentrl.env import check_env_kwargs, register_env
    from agentrl.envs.guess_number import GuessNumberEnv

    class Open(GuessNumberEnv):
        def __init__(self, **kwargs):
            super().__init__(high=kwargs.get("high", 32))

    register_env("hostile/Open-v0", Open)
    check_env_kwargs("hostile/Open-v0", {"anything": 1})
    # gymnasium.make's own keyword (a TimeLimit around the env) is no constructor's, and is taken
    check_env_kwargs("agentrl/GuessNumber-v0", {"max_episode_steps": 3, "high": 8})
    from agentrl.env import make_env

    assert make_env("agentrl/GuessNumber-v0", max_episode_steps=3).spec.max_episode_steps == 3


@pytest.mark.parametrize(("command", "key"), [
    (["rollout", "--env", "agentrl/GuessNumber-v0", "--episodes", "2"], "rollout.out_dir"),
    (["eval", "--env", "agentrl/GuessNumber-v0", "--episodes", "2"], "--out")])
@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_an_output_folder_that_cannot_be_made_is_an_error_before_the_episodes(tmp_path, command, key, where):
    """It ran every episode, then died in write_run with a FileExistsError traceback (exit 1)."""
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    out = afile if where == "file" else afile / "run"
    res = runner.invoke(app, [*command, *MOCK, "--out", str(out)])
    assert res.exit_code == 2, (res.output, res.exception)
    assert f"error:{key}={out}" in _text(res)
    assert "loading model" not in res.output  # refused before the policy loads
    assert afile.read_text() == "keep me"


@pytest.mark.parametrize(("text", "where"), [
    ("train:\n  steps: 0\ntrain:\n  tasks_per_step: 3\n", "'train' given twice (lines 1 and 3)"),
    ("train:\n  steps: 0\n  steps: 5\n", "'steps' given twice (lines 2 and 3)"),
    ("env: {id: a, id: b}\n", "'id' given twice (lines 1 and 1)")])
def test_a_config_key_given_twice_is_an_error(tmp_path, text, where):
    """YAML keeps the last: a second ``train:`` section replaced the whole first one, and the
    run trained 20 steps where the file said 0."""
    from agentrl.config import load_config
    from agentrl.errors import ConfigError
    from agentrl.train.config import TrainRunConfig

    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(where)):
        load_config(path, schema=TrainRunConfig)
    res = runner.invoke(main_app, ["rollout", "--config", str(path), *MOCK, "--out", str(tmp_path / "run")])
    assert res.exit_code == 2 and where.replace(" ", "") in _text(res), res.output


def test_an_override_whose_value_gives_a_key_twice_is_an_error_naming_it():
    """It was taken as the raw string, which the schema then refused without saying why."""
    from agentrl.config import load_config
    from agentrl.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape("override 'env.kwargs={high: 8, high: 9}': 'high' given twice")):
        load_config(None, ["env.kwargs={high: 8, high: 9}"])
    assert load_config(None, ["env.kwargs={high: 8}"]).env.kwargs == {"high": 8}
    assert load_config(None, ["env.id=a: b: c"]).env.id == "a: b: c"  # other YAML it cannot read stays text


def test_a_key_that_overrides_a_yaml_merge_is_not_given_twice(tmp_path):
    from agentrl.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("sampling: &s {temperature: 0.5, max_new_tokens: 4}\nrollout:\n  episodes: 1\n"
                    "x-other: {<<: *s, temperature: 0.7}\n")
    cfg = load_config(path, ignore=("x-other",))
    assert cfg.sampling.temperature == 0.5 and cfg._ignored["x-other"] == {"temperature": 0.7, "max_new_tokens": 4}


@pytest.mark.parametrize(("command", "key"), [
    (["rollout", "--env", "agentrl/GuessNumber-v0", "--episodes", "1"], "rollout.out_dir"),
    (["eval", "--env", "agentrl/GuessNumber-v0", "--episodes", "1"], "--out"),
    (["train", "--steps", "1", "--set", "policy.model=tiny-random", "--no-progress"], "train.output.dir")])
def test_an_empty_output_folder_is_an_error_not_the_working_directory(tmp_path, monkeypatch, command, key):
    """``--out ""`` (an unset shell variable) wrote the run into the working directory, where
    ``train --overwrite`` removes checkpoints/, tensorboard/ and trees/."""
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, [*command, *(MOCK if command[0] != "train" else []), "--out", ""])
    assert res.exit_code == 2, (res.output, res.exception)
    assert key in _text(res) and "error:" in res.output
    assert list(tmp_path.iterdir()) == []


def _torn_run(tmp_path):
    """A rollout run of two trees whose second line was cut short by a kill mid-write."""
    out = tmp_path / "run"
    res = runner.invoke(app, ["rollout", "--env", "agentrl/GuessNumber-v0", "--episodes", "2", *MOCK,
                              "--out", str(out)])
    assert res.exit_code == 0, res.output
    lines = (out / "trajectories.jsonl").read_text().splitlines()
    (out / "trajectories.jsonl").write_text(lines[0] + "\n" + lines[1][:50])
    return out


def test_view_tree_and_report_say_which_lines_of_a_torn_trees_file_they_skipped(tmp_path):
    """The tree of a torn line was left out silently: 'view' counted 1 tree, 'tree --index 1'
    said out of range, and report.md read as if the run held one tree."""
    out = _torn_run(tmp_path)
    res = runner.invoke(app, ["view", str(out), "--static", str(tmp_path / "v.html"), "--no-tokens"])
    assert res.exit_code == 0, res.output
    assert "skipped 1 unreadable line: trajectories.jsonl:2" in res.output
    res = runner.invoke(app, ["tree", str(out), "--index", "1"])
    assert res.exit_code == 2 and "skipped 1 unreadable line: trajectories.jsonl:2" in res.output
    res = runner.invoke(app, ["report", str(out)])
    assert res.exit_code == 0, res.output
    assert "skipped 1 unreadable line: trajectories.jsonl:2" in (out / "report" / "report.md").read_text()


def test_report_into_a_file_is_an_error_not_a_traceback(tmp_path):
    out = _torn_run(tmp_path)
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    res = runner.invoke(app, ["report", str(out), "--out", str(afile)])
    assert res.exit_code == 2, (res.output, res.exception)
    assert f"error: cannot make the report folder {afile}" in res.output
    assert afile.read_text() == "keep me"


@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_view_static_onto_a_path_it_cannot_write_is_an_error_not_a_traceback(tmp_path, where):
    out = _torn_run(tmp_path)
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    page = afile / "v.html" if where == "under_a_file" else tmp_path
    res = runner.invoke(app, ["view", str(out), "--static", str(page), "--no-tokens"])
    assert res.exit_code == 2, (res.output, res.exception)
    assert f"error: cannot write {page}" in res.output
    assert afile.read_text() == "keep me"
