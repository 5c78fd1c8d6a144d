"""EnvWorker's own rules, in this process (no Ray): close never runs under a running call."""

from __future__ import annotations

import threading

from agentrl.distributed.env_workers import EnvWorker


def test_close_during_a_running_step_waits_for_it_to_return():
    worker = EnvWorker("agentrl/GuessNumber-v0", {}, [])
    worker.call("h", True, "reset", (), {"seed": 0})
    env = worker._envs["h"]
    closed, entered, release = [], threading.Event(), threading.Event()
    env.close = lambda: closed.append(True)  # noqa: SLF001 - watch when close runs
    step = env.unwrapped.step

    def slow_step(action: str):  # a step the episode gave up on (its timeout) that is still running
        entered.set()
        release.wait(30)
        return step(action)

    env.unwrapped.step = slow_step
    t = threading.Thread(target=worker.call, args=("h", False, "step", ("7",), {}))
    t.start()
    assert entered.wait(30)
    worker.close("h")  # the engine closes the env of the failed episode
    assert closed == [] and worker.hosted() == 1  # not under the running step
    release.set()
    t.join(30)
    assert closed == [True] and worker.hosted() == 0  # closed once the step returned
    worker.close("h")  # closing again is a no-op
    assert closed == [True]


def test_close_of_an_idle_env_is_immediate():
    worker = EnvWorker("agentrl/GuessNumber-v0", {}, [])
    worker.call("a", True, "reset", (), {"seed": 1})
    assert worker.hosted() == 1 and worker.made_envs() == 1
    worker.close("a")
    assert worker.hosted() == 0


def test_close_while_the_env_is_being_made_closes_it_once_made(monkeypatch):
    """An episode that times out during a slow env start-up (a sandbox booting) closes a handle
    that holds no env yet: the env is closed as soon as its first call returns, not leaked."""
    from agentrl.distributed import env_workers

    entered, release, closed = threading.Event(), threading.Event(), []
    make = env_workers.make_env

    def slow_make(*args, **kwargs):
        entered.set()
        release.wait(30)
        env = make(*args, **kwargs)
        env.close = lambda: closed.append(True)
        return env

    monkeypatch.setattr(env_workers, "make_env", slow_make)
    worker = EnvWorker("agentrl/GuessNumber-v0", {}, [])
    t = threading.Thread(target=worker.call, args=("h", True, "reset", (), {"seed": 0}))
    t.start()
    assert entered.wait(30)
    worker.close("h")
    release.set()
    t.join(30)
    assert closed == [True] and worker.hosted() == 0


def test_an_env_still_being_made_when_the_pool_shuts_down_is_closed_once_made(monkeypatch):
    """A pool shutdown has each worker close its envs before the kill (which skips env.close).
    An env still starting then (a sandbox booting) was stored after close_all had run, and the
    kill left it unclosed: a docker sandbox's container outlived the run."""
    from agentrl.distributed import env_workers

    entered, release, closed = threading.Event(), threading.Event(), []
    make = env_workers.make_env

    def slow_make(*args, **kwargs):
        entered.set()
        release.wait(30)
        env = make(*args, **kwargs)
        env.close = lambda: closed.append(True)
        return env

    monkeypatch.setattr(env_workers, "make_env", slow_make)
    worker = EnvWorker("agentrl/GuessNumber-v0", {}, [])
    t = threading.Thread(target=worker.call, args=("h", True, "reset", (), {"seed": 0}))
    t.start()
    assert entered.wait(30)
    assert worker.close_all() == 0  # nothing made yet
    release.set()
    t.join(30)
    assert closed == [True] and worker.hosted() == 0
