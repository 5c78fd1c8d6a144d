"""The env server under races a harness makes: a close beside a step, a slow close, a slow make."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from agentrl.env import TextEnv, register_env
from agentrl.proxy import RunningServer
from agentrl.proxy.envserver import EnvServerConfig, create_env_app

TOKEN = "env-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CLOSED: list[str] = []  # the ``name`` of every SlowEnv closed
STEPPING = threading.Event()  # set once a SlowEnv step has begun


class SlowEnv(TextEnv):
    """Sleeps ``make_s`` when made, ``step_s`` per step (reward 1, the episode ends), ``close_s`` when closed."""

    def __init__(self, name: str = "", make_s: float = 0.0, step_s: float = 0.0, close_s: float = 0.0):
        super().__init__()
        time.sleep(make_s)
        self.name, self.step_s, self.close_s = name, step_s, close_s

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return "Go.", {}

    def step(self, action: str):
        STEPPING.set()
        time.sleep(self.step_s)
        return "done", 1.0, True, False, {}

    def close(self) -> None:
        time.sleep(self.close_s)
        CLOSED.append(self.name)


register_env("review/Slow-v0", entry_point=SlowEnv)


def _make(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{url}/envs", json={"env_id": "review/Slow-v0", "kwargs": kwargs}, headers=AUTH, timeout=30)


def test_a_close_waits_for_the_step_in_flight_and_reports_its_reward():
    """A harness that exits (or is killed) with a step in flight: the runner's close must read the
    reward that step earns, not the state before it."""
    with RunningServer(create_env_app(EnvServerConfig(token=TOKEN))) as server:
        eid = _make(server.url, step_s=1.0).json()["id"]
        stepped: list[httpx.Response] = []
        t = threading.Thread(target=lambda: stepped.append(httpx.post(
            f"{server.url}/envs/{eid}/step", json={"action": "x"}, headers=AUTH, timeout=30)))
        t.start()
        assert STEPPING.wait(10)  # the step is running in the env
        state = httpx.post(f"{server.url}/envs/{eid}/close", headers=AUTH, timeout=30).json()
        t.join()
        assert state["steps"] == 1 and state["reward"] == 1.0 and state["terminated"]
        assert stepped[0].status_code == 200


def test_a_step_that_arrives_after_the_close_is_a_404():
    with RunningServer(create_env_app(EnvServerConfig(token=TOKEN))) as server:
        eid = _make(server.url, step_s=1.0).json()["id"]
        first = threading.Thread(target=lambda: httpx.post(
            f"{server.url}/envs/{eid}/step", json={"action": "x"}, headers=AUTH, timeout=30))
        first.start()
        time.sleep(0.3)  # step 1 runs and holds the env
        closing = threading.Thread(target=lambda: httpx.post(f"{server.url}/envs/{eid}/close", headers=AUTH,
                                                             timeout=30))
        closing.start()
        time.sleep(0.2)  # the close waits behind step 1; step 2 comes in behind it
        r = httpx.post(f"{server.url}/envs/{eid}/step", json={"action": "y"}, headers=AUTH, timeout=30)
        first.join()
        closing.join()
        assert r.status_code in (404, 409), r.text  # never a step of a closed env


def test_reaping_an_idle_env_whose_close_is_slow_does_not_stall_the_server():
    with RunningServer(create_env_app(EnvServerConfig(token=TOKEN, idle_s=0.05))) as server:
        assert _make(server.url, name="idle", close_s=3.0).status_code == 200
        time.sleep(0.2)
        t0 = time.monotonic()
        assert _make(server.url, name="next").status_code == 200  # reaps the idle one
        assert time.monotonic() - t0 < 2.5  # the slow close takes 3 s
        deadline = time.monotonic() + 10
        while "idle" not in CLOSED and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "idle" in CLOSED


def test_an_env_that_takes_too_long_to_make_is_closed_once_made():
    with RunningServer(create_env_app(EnvServerConfig(token=TOKEN, step_timeout_s=0.3))) as server:
        r = _make(server.url, name="late", make_s=1.0)
        assert r.status_code == 504
        deadline = time.monotonic() + 10
        while "late" not in CLOSED and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "late" in CLOSED  # not left open (a sandbox, a container) with no id to close it by


def test_max_envs_holds_for_makes_that_run_at_once():
    with RunningServer(create_env_app(EnvServerConfig(token=TOKEN, max_envs=2))) as server:
        codes: list[int] = []
        threads = [threading.Thread(target=lambda: codes.append(_make(server.url, make_s=0.5).status_code))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(codes) == [200, 200, 429, 429]
        assert len(server.app.state.envs) == 2


@pytest.fixture(autouse=True)
def _clear():
    CLOSED.clear()
    STEPPING.clear()


def test_an_envs_own_key_opens_that_env_alone():
    with RunningServer(create_env_app(EnvServerConfig(token=TOKEN))) as server:
        a, b = _make(server.url).json(), _make(server.url).json()
        own = {"Authorization": f"Bearer {a['key']}"}
        assert httpx.get(f"{server.url}/envs/{a['id']}", headers=own).json()["steps"] == 0
        assert httpx.post(f"{server.url}/envs/{a['id']}/step", json={"action": "x"}, headers=own).json()["reward"] == 1.0
        # another episode's env, the routes that make envs or list them, an env that is gone: refused alike
        assert httpx.get(f"{server.url}/envs/{b['id']}", headers=own).status_code == 401
        assert httpx.post(f"{server.url}/envs/{b['id']}/close", headers=own).status_code == 401
        assert httpx.post(f"{server.url}/envs", json={"env_id": "review/Slow-v0"}, headers=own).status_code == 401
        assert httpx.get(f"{server.url}/registry", headers=own).status_code == 401
        assert httpx.get(f"{server.url}/envs/nope", headers=own).status_code == 401
        assert httpx.post(f"{server.url}/envs/{a['id']}/close", headers=own).status_code == 403  # the runner's
        assert httpx.post(f"{server.url}/envs/{a['id']}/close", headers=AUTH).json()["reward"] == 1.0
        assert httpx.get(f"{server.url}/envs/{b['id']}", headers=AUTH).json()["steps"] == 0  # the token: any env


def test_a_close_that_hangs_in_the_env_still_answers_with_the_state():
    """The runner reads the reward from the close's answer: an env stuck in close() (a container that
    will not stop) must not cost the episode its reward."""
    with RunningServer(create_env_app(EnvServerConfig(token=TOKEN, step_timeout_s=0.5))) as server:
        eid = _make(server.url, name="stuck", close_s=3.0).json()["id"]
        httpx.post(f"{server.url}/envs/{eid}/step", json={"action": "x"}, headers=AUTH).raise_for_status()
        t0 = time.monotonic()
        state = httpx.post(f"{server.url}/envs/{eid}/close", headers=AUTH, timeout=30).json()
        assert time.monotonic() - t0 < 2.5  # the slow close takes 3 s
        assert state["reward"] == 1.0 and state["terminated"]
        assert httpx.get(f"{server.url}/envs/{eid}", headers=AUTH).status_code == 404


def test_an_envs_own_key_plays_and_reads_it_but_cannot_close_it():
    """The harness holds its env's key. Closing the env with it made the runner's close a 404, so
    the reward could not be read and the episode failed: credit leaves failed episodes out, so
    a model could learn to close an env it was losing. Closing takes the server's token."""
    with RunningServer(create_env_app(EnvServerConfig(token=TOKEN))) as server:
        made = _make(server.url).json()
        here, key = f"{server.url}/envs/{made['id']}", {"Authorization": f"Bearer {made['key']}"}
        assert httpx.get(here, headers=key).status_code == 200
        r = httpx.post(f"{here}/close", headers=key)
        assert r.status_code == 403 and "server's token" in r.json()["error"]["message"], r.text
        assert httpx.post(f"{here}/step", json={"action": "x"}, headers=key).json()["reward"] == 1.0
        state = httpx.post(f"{here}/close", headers=AUTH).json()
        assert state["reward"] == 1.0 and state["terminated"]
