"""Out-of-process envs (``rollout.env_executor: process``) when their parent dies hard."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agentrl.env import TextEnv, register_env
from agentrl.rollout.env_process import ProcessEnv

# The "trainer": hosts a process env whose step starts a child and hangs, then waits to be killed.
_TRAINER = """
import sys, threading
import tests.fakes
from agentrl.rollout.env_process import ProcessEnv
env = ProcessEnv("agentrl/TestSpawnThenHang-v0", pid_file=sys.argv[1])
env.reset(seed=0)
print(env._proc.pid, flush=True)
env.step("go")
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its reaper is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(map(_running, pids)):
            return True
        time.sleep(0.1)
    return False


def test_a_process_env_and_its_children_die_with_a_killed_parent(tmp_path):
    """SIGKILL (the OOM killer, a preempted job) runs no cleanup in the parent: the env's process,
    hung in a step, and the process its env started must not live on as orphans."""
    pid_file = tmp_path / "grandchild.pid"
    root = Path(__file__).resolve().parents[2]
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(pid_file)], cwd=root,
                               stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids.append(int(trainer.stdout.readline()))  # the env's process
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids.append(int(pid_file.read_text()))  # the process the env's step started
        trainer.kill()
        trainer.wait()
        assert _gone_within(pids, 10), [p for p in pids if _running(p)]
    finally:
        trainer.kill()
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)  # the test's own leftovers when it fails


class LeavesAChild(TextEnv):
    """Starts a helper process at reset (a game server, a browser) that its ``close`` forgets."""

    def __init__(self, pid_file: str = ""):
        super().__init__()
        self.pid_file = pid_file

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.helper = subprocess.Popen(["sleep", "600"])
        Path(self.pid_file).write_text(str(self.helper.pid))
        return "Say anything.", {}

    def step(self, action: str):
        return "Done.", 1.0, True, False, {}


register_env("agentrl/TestLeavesAChild-v0", entry_point=LeavesAChild)


def test_closing_a_process_env_ends_what_its_env_started(tmp_path):
    """The env's process group goes with a ``close`` that the env answered, as with one it did not."""
    pid_file = tmp_path / "helper.pid"
    env = ProcessEnv("agentrl/TestLeavesAChild-v0", pid_file=str(pid_file))
    try:
        env.reset(seed=0)
        helper = int(pid_file.read_text())
        assert _running(helper)
        env.close()
        assert _gone_within([helper], 5)
    finally:
        env.kill()
        if pid_file.exists() and _running(pid := int(pid_file.read_text())):
            os.kill(pid, signal.SIGKILL)


class DiesLeavingAChild(LeavesAChild):
    """Its step starts a background process the shell's way (it inherits open files), then dies."""

    def step(self, action: str):
        os.system(f"sleep 600 & echo $! > {self.pid_file}")
        os._exit(3)


register_env("agentrl/TestDiesLeavingAChild-v0", entry_point=DiesLeavingAChild)


def test_a_call_on_a_child_that_died_returns_though_its_pipe_is_held_open(tmp_path):
    """A process the env started may hold the child's end of the pipe: the call answers with the
    child's death at once (it waited for that process instead), and that process is ended."""
    pid_file = tmp_path / "helper.pid"
    env = ProcessEnv("agentrl/TestDiesLeavingAChild-v0", pid_file=str(pid_file))
    try:
        env.reset(seed=0)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"died \(exit code 3\)"):
            env.step("go")
        assert time.monotonic() - t0 < 5
        assert _gone_within([int(pid_file.read_text())], 5)
    finally:
        env.kill()
        if pid_file.exists() and _running(pid := int(pid_file.read_text())):
            os.kill(pid, signal.SIGKILL)


class GameError(Exception):
    """An env's own error whose constructor takes more than its message: it pickles, but does
    not unpickle (pickle calls ``GameError(message)``)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class RaisesItsOwnError(LeavesAChild):
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        TextEnv.reset(self, seed=seed)
        return "Say anything.", {}

    def step(self, action: str):
        raise GameError(7, "the board is full")


register_env("agentrl/TestRaisesItsOwnError-v0", entry_point=RaisesItsOwnError)


def test_an_env_error_that_does_not_unpickle_is_named_with_its_message():
    """It surfaced as a TypeError from unpickling, which named neither the env's error nor its message."""
    env = ProcessEnv("agentrl/TestRaisesItsOwnError-v0")
    try:
        env.reset(seed=0)
        with pytest.raises(Exception, match="GameError: the board is full"):
            env.step("go")
        assert env.reset(seed=0)[0] == "Say anything."  # the pipe is still in step
    finally:
        env.close()


def test_an_idle_process_env_that_died_is_replaced_not_handed_to_the_next_episode(tokenizer):
    """A child killed between episodes (the OOM killer) failed the next episode it was lent to."""
    import asyncio

    from agentrl.config import load_config
    from agentrl.policy import MockPolicy
    from agentrl.rollout import Engine

    cfg = load_config(overrides=["rollout.env_executor=process", "rollout.concurrency=1",
                                 "rollout.max_turns=2", "env.kwargs={high: 1000, max_turns: 2}"])
    killed: list[int] = []

    def kill_the_idle_env(tree):
        if not killed:
            (env,) = engine.envs._idle
            killed.append(env._proc.pid)
            os.kill(env._proc.pid, signal.SIGKILL)
            time.sleep(0.2)

    engine = Engine(MockPolicy(tokenizer, ["1"]), cfg, "agentrl/GuessNumber-v0", kill_the_idle_env)
    try:
        trees = asyncio.run(engine.run([0, 1]))
    finally:
        engine.close()
    assert killed and [ep.error for t in trees for ep in t.episodes()] == [None, None]
