"""From a hostile review of the `agentrl` commands as users drive them: bad input is an
`error: ...` naming the key, exit code 2, before any work is done."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from agentrl.cli import app as main_app
from agentrl.eval_cli import register

runner = CliRunner()
app = typer.Typer()
app.registered_commands += main_app.registered_commands
register(app)
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
