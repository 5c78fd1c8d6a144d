"""From a hostile review of the ``agentrl`` commands: flags that contradict each other, and
flags one command silently overrode."""

from __future__ import annotations

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
