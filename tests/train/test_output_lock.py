"""One training run at a time in an output folder (``agentrl.train.output_lock``)."""

from __future__ import annotations

import os

import pytest

from agentrl.errors import ConfigError
from agentrl.train.output_lock import LOCK_FILE, output_lock


def test_a_held_folder_refuses_a_second_holder_naming_the_key_and_the_holder(tmp_path):
    out = tmp_path / "run"
    with output_lock(out):
        assert f"pid {os.getpid()} on " in (out / LOCK_FILE).read_text()
        with pytest.raises(ConfigError, match=rf"train\.output\.dir={out} is in use by another run \(pid {os.getpid()} "):
            with output_lock(out):
                pass
        with output_lock(tmp_path / "other"):  # another folder is free
            pass
    with output_lock(out):  # released on the way out, an error's way too
        with pytest.raises(ZeroDivisionError):
            with output_lock(tmp_path / "third"):
                raise ZeroDivisionError
    with output_lock(tmp_path / "third"):
        pass


def test_train_refuses_a_held_folder_before_deleting_anything_and_a_dry_run_takes_no_lock(tmp_path):
    from agentrl.train.trainer import train
    from tests.train.test_trainer import toy_config

    out = tmp_path / "run"
    (out / "checkpoints" / "step-000001").mkdir(parents=True)
    (out / "checkpoints" / "step-000001" / "state.pt").write_bytes(b"a live run's")
    with output_lock(out):
        with pytest.raises(ConfigError, match="in use by another run"):
            train(toy_config(out, "train.steps=1"), overwrite=True, progress=False)
        assert (out / "checkpoints" / "step-000001" / "state.pt").exists()
        dry = train(toy_config(out, "train.steps=0", "sft.episodes=0"), progress=False)
        assert dry["dry_run"] is True


def test_an_output_dir_that_is_a_file_is_refused_naming_the_key(tmp_path):
    path = tmp_path / "run"
    path.write_text("not a folder")
    with pytest.raises(ConfigError, match=rf"train\.output\.dir={path} is a file, not a folder"):
        with output_lock(path):
            pass
    assert path.read_text() == "not a folder"


def test_resume_with_nothing_to_resume_says_the_run_starts_from_the_beginning(tmp_path):
    import io

    from rich.console import Console

    from agentrl.train.trainer import train
    from tests.train.test_trainer import toy_config

    buf = io.StringIO()
    summary = train(toy_config(tmp_path / "run", "train.steps=1", "train.evaluation.episodes=0"), resume=True,
                    progress=False, console=Console(file=buf, width=300))
    assert "--resume: no checkpoint in" in buf.getvalue() and "starts from the beginning" in buf.getvalue()
    assert summary["checkpoint"].endswith("step-000001")


def test_a_child_forked_without_exec_does_not_keep_the_folder_locked(tmp_path):
    """The lock belongs to the open file; a forked child would share it past the run's end."""
    out = tmp_path / "run"
    read, write = os.pipe()
    with output_lock(out):
        pid = os.fork()
        if pid == 0:  # the child: outlives the run a moment, holding whatever it inherited
            os.close(read)
            os.write(write, b"x")
            os.close(write)
            import time

            time.sleep(3)
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"x"  # the child is alive
        with output_lock(out):  # and the run's lock went with the run
            pass
    finally:
        os.close(read)
        os.waitpid(pid, 0)


def test_a_filesystem_without_locks_runs_unlocked_with_a_warning(tmp_path, monkeypatch):
    import errno

    import agentrl.train.output_lock as lock

    def no_locks(fd, op):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))  # Lustre without -o flock

    monkeypatch.setattr(lock.fcntl, "flock", no_locks)
    with pytest.warns(RuntimeWarning, match=r"does not lock files \(ENOSYS\)"):
        with output_lock(tmp_path / "run"):
            ran = True
    assert ran


def test_an_output_dir_that_cannot_be_made_is_refused_naming_the_key(tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "x")
    with pytest.raises(ConfigError, match=r"train\.output\.dir=.*dangling: cannot make the folder"):
        with output_lock(tmp_path / "dangling"):
            pass


def test_a_run_that_fails_before_writing_leaves_no_folder_and_a_used_folder_stays(tmp_path):
    out = tmp_path / "typo"
    with pytest.raises(ZeroDivisionError):
        with output_lock(out):  # a config or env error before anything is written
            raise ZeroDivisionError
    assert not out.exists()
    with output_lock(out):
        (out / "metrics.jsonl").write_text("{}\n")
    assert (out / "metrics.jsonl").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    with output_lock(kept):
        pass
    assert kept.is_dir()  # a folder the user made stays, even empty


def test_a_lock_won_on_a_file_its_last_holder_unlinked_is_taken_again_on_the_file_there_now(tmp_path, monkeypatch):
    """A run that made the folder and failed unlinks its lock file while it holds it. A run that
    opened that file just before then locks a file no one else can open: a third run would lock
    the new one, and both would write into the folder. The lock is checked to be the path's."""
    import fcntl

    import agentrl.train.output_lock as lock

    out = tmp_path / "run"
    real, calls = fcntl.flock, []

    def flock_then_the_holder_leaves(fd, op):
        real(fd, op)
        calls.append(op)
        if len(calls) == 1:  # the earlier holder's way out: unlink, and remove the folder it made
            (out / LOCK_FILE).unlink()
            out.rmdir()

    monkeypatch.setattr(lock.fcntl, "flock", flock_then_the_holder_leaves)
    with output_lock(out):
        monkeypatch.setattr(lock.fcntl, "flock", real)
        assert len(calls) == 2  # locked twice: the unlinked file, then the one there now
        fd = os.open(out / LOCK_FILE, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):  # a third run cannot lock the path
                real(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
