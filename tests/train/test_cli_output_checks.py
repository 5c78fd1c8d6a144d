"""Every command that writes checks its output folder before any model loads or episode runs:
a folder it cannot write into was found only when the run's results were written, after all
its episodes (``agentrl.train.output_lock``)."""

from __future__ import annotations

import os
import traceback
import types
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from agentrl.cli import rollout as rollout_command
from agentrl.errors import ConfigError
from agentrl.eval_cli import register as register_eval
from agentrl.train import output_lock as lock_module
from agentrl.train.cli import register as register_train
from agentrl.train.output_lock import LOCK_FILE, output_lock


def _as_nobody(work: Path, fn) -> str:
    """``fn()``'s ``ConfigError`` message ('' if none) in a child forked as user nobody, with
    ``work`` as its working folder (root writes anywhere; as another user it is the real case)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(read)
            os.chdir(work)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            try:
                fn()
            except ConfigError as e:
                os.write(write, str(e).encode())
        except BaseException:  # said, to fail the test with it
            os.write(write, traceback.format_exc().encode())
            code = 1
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        said = f.read().decode()
    assert os.waitpid(pid, 0)[1] == 0, said
    return said


def test_a_folder_of_another_user_with_its_lock_file_is_refused_before_the_run(tmp_path):
    """Another user's finished run: the lock file opens read-only (flock takes it), so the run
    went on, and only writing its results failed."""
    out = tmp_path / "theirs"
    out.mkdir()
    (out / LOCK_FILE).write_text("")
    (out / "summary.json").write_text("{}\n")

    def run() -> None:
        with output_lock(Path("theirs"), "rollout.out_dir"):
            pass

    if os.geteuid() == 0:
        tmp_path.chmod(0o755)  # the child looks "theirs" up in it
        said = _as_nobody(tmp_path, run)
    else:
        out.chmod(0o555)
        try:
            with pytest.raises(ConfigError) as e:
                run()
            said = str(e.value)
        finally:
            out.chmod(0o755)
    assert said.startswith("rollout.out_dir=theirs: cannot write into the folder: Permission denied"), said
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE, "summary.json"]  # no probe left behind


def test_a_folder_under_one_this_user_cannot_enter_is_a_config_error_not_a_traceback(tmp_path):
    (tmp_path / "private").mkdir(mode=0o700)

    def run() -> None:
        with output_lock(Path("private/run"), "train.output.dir"):
            pass

    if os.geteuid() != 0:
        pytest.skip("the folder is this user's own: it enters it")
    tmp_path.chmod(0o755)
    said = _as_nobody(tmp_path, run)
    assert said == "train.output.dir=private/run: cannot look the folder up: Permission denied", said


def test_a_writable_folder_keeps_nothing_of_the_check(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    with output_lock(out):
        assert [p.name for p in out.iterdir()] == [LOCK_FILE]


def _unwritable(monkeypatch) -> None:
    """Every folder refuses a new file, as another user's does."""
    def refuse(**kw):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(lock_module, "tempfile", types.SimpleNamespace(mkstemp=refuse))


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("rollout")(rollout_command)
    register_eval(app)
    register_train(app)
    return app


@pytest.mark.parametrize(("argv", "key"), [
    (["rollout", "--backend", "mock", "--episodes", "1", "--out", "{out}"], "rollout.out_dir"),
    (["eval", "--env", "agentrl/GuessNumber-v0", "--backend", "mock", "--episodes", "1", "--out", "{out}"], "--out"),
    (["train", "--out", "{out}", "--steps", "1", "--set", "policy.model=tiny-random"], "train.output.dir"),
])
def test_each_command_refuses_an_unwritable_output_folder_before_any_model_loads(tmp_path, monkeypatch, argv, key):
    import agentrl.policy.for_run as for_run
    import agentrl.train.trainer as trainer

    def no_model(*a, **kw):
        raise AssertionError("a model loaded")

    monkeypatch.setattr(for_run, "open_policy", no_model)
    monkeypatch.setattr(trainer, "Trainer", no_model)
    _unwritable(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    result = CliRunner().invoke(_app(), [a.format(out=out) for a in argv] + ["--no-progress"])
    text = "".join(result.output.split())  # rich wraps long lines, a path at a slash too
    assert result.exit_code == 2, (result.output, result.exception)
    assert "".join(f"{key}={out}: cannot write into the folder: Permission denied".split()) in text


@pytest.mark.parametrize(("argv", "key"), [
    (["rollout", "--backend", "mock", "--episodes", "1", "--out", "private/run"], "rollout.out_dir"),
    (["eval", "--env", "agentrl/GuessNumber-v0", "--backend", "mock", "--episodes", "1", "--out", "private/run"],
     "--out"),
])
def test_an_output_folder_this_user_cannot_look_up_is_an_error_not_a_traceback(tmp_path, monkeypatch, argv, key):
    """``--out`` under another user's private folder: rollout and eval raised PermissionError."""
    if os.geteuid() != 0:
        pytest.skip("needs a folder this user cannot enter: run as root, the child drops to nobody")
    (tmp_path / "private").mkdir(mode=0o700)
    (tmp_path / "afile").write_text("")
    tmp_path.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    app = _app()
    said = CliRunner().invoke(app, [*argv[:-1], "afile", "--no-progress"])  # imports what the command reads
    assert said.exit_code == 2, said.output

    def run() -> None:
        result = CliRunner().invoke(app, [*argv, "--no-progress"])
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        raise ConfigError(" ".join(result.output.split()))

    said = _as_nobody(tmp_path, run)
    assert f"error: {key}=private/run: cannot look the folder up: Permission denied" in said, said
