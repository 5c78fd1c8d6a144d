"""The env server: make, step, close over HTTP; bad input answered, a crashing env ends its episode."""

from __future__ import annotations

import httpx
import pytest

import tests.fakes  # noqa: F401  registers agentrl/TestCrashing-v0
from agentrl.proxy import RunningServer
from agentrl.proxy.envserver import EnvServerConfig, create_env_app

TOKEN = "env-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def env_url():
    with RunningServer(create_env_app(EnvServerConfig(token=TOKEN, max_envs=3))) as server:
        yield server.url


def test_make_step_close_plays_the_env(env_url):
    made = httpx.post(f"{env_url}/envs", json={"env_id": "agentrl/GuessNumber-v0", "seed": 0,
                                               "kwargs": {"high": 4}}, headers=AUTH).json()
    assert "between 1 and 4" in made["observation"]
    # The reset info's privileged text (the secret) is for a distillation teacher, not the agent.
    assert "privileged" not in made["info"] and made["info"]["state_key"] == "turn 0: 1..4"
    assert "privileged" not in httpx.get(f"{env_url}/envs/{made['id']}", headers=AUTH).json()["info"]
    eid, total, steps = made["id"], 0.0, 0
    for guess in range(1, 5):  # one of 1..4 is the secret
        step = httpx.post(f"{env_url}/envs/{eid}/step", json={"action": str(guess)}, headers=AUTH).json()
        total, steps = total + step["reward"], steps + 1
        if step["terminated"]:
            break
    assert total == 1.0
    state = httpx.post(f"{env_url}/envs/{eid}/close", headers=AUTH).json()
    assert state["reward"] == 1.0 and state["terminated"] and state["steps"] == steps
    assert httpx.get(f"{env_url}/envs/{eid}", headers=AUTH).status_code == 404


def test_bad_input_is_answered_and_a_crash_ends_only_its_episode(env_url):
    assert httpx.post(f"{env_url}/envs", json={"env_id": "agentrl/GuessNumber-v0"}).status_code == 401
    r = httpx.post(f"{env_url}/envs", json={"env_id": "agentrl/GuesNumber-v0"}, headers=AUTH)
    assert r.status_code == 400 and "GuessNumber" in r.json()["error"]["message"]
    r = httpx.post(f"{env_url}/envs", json={"seed": 1}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "env_id"
    crash = httpx.post(f"{env_url}/envs", json={"env_id": "agentrl/TestCrashing-v0"}, headers=AUTH).json()
    r = httpx.post(f"{env_url}/envs/{crash['id']}/step", json={"action": 3}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "action"
    step = httpx.post(f"{env_url}/envs/{crash['id']}/step", json={"action": "go"}, headers=AUTH).json()
    assert step["truncated"] and "simulated env crash" in step["info"]["error"]
    assert step["observation"].startswith("error:")
    assert httpx.post(f"{env_url}/envs/{crash['id']}/step", json={"action": "go"},
                      headers=AUTH).status_code == 409
    assert httpx.post(f"{env_url}/envs/nope/step", json={"action": "x"}, headers=AUTH).status_code == 404
    assert httpx.get(f"{env_url}/health", headers=AUTH).json()["ok"]


@pytest.mark.parametrize("env_id, kwargs, says", [
    ("agentrl/MathPython-v0", {"sandbox": "nope"}, "unknown backend 'nope'"),  # ConfigError: was a 500
    ("agentrl/GuessNumber-v0", {"high": "many"}, "high"),
    ("agentrl/GuessNumber-v0", {"colour": "red"}, "colour"),
])
def test_a_setting_the_env_refuses_is_a_400_naming_the_kwargs(env_url, env_id, kwargs, says):
    r = httpx.post(f"{env_url}/envs", json={"env_id": env_id, "kwargs": kwargs}, headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "kwargs" and says in error["message"] and env_id in error["message"]
