"""User envs that break the contract inside rollouts: each fails only its episode, with a
reason that names the env, and the run's files stay readable (strict JSON)."""

from __future__ import annotations

import json
import math
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from agentrl.config import Config
from agentrl.env import TextEnv, answer_problem, jsonable, register_env
from agentrl.policy import MockPolicy
from agentrl.rollout import collect, summarize, write_run

_OK_STEP = ("Go on.", 0.0, False, False, {})


def _cyclic() -> dict[str, Any]:
    d: dict[str, Any] = {}
    d["self"] = d
    return d


# What the env returns, by name: (reset's answer, step's answer).
ANSWERS: dict[str, tuple[Any, Any]] = {
    "reset_none": (None, _OK_STEP),
    "reset_three": (("Hi.", {}, 1), _OK_STEP),
    "reset_obs_int": ((42, {}), _OK_STEP),
    "reset_info_none": (("Hi.", None), _OK_STEP),
    "reset_surrogate": (("bad \ud800 text", {}), _OK_STEP),
    "step_four": (("Hi.", {}), ("o", 0.0, False, {})),
    "step_none": (("Hi.", {}), None),
    "step_obs_bytes": (("Hi.", {}), (b"o", 0.0, False, False, {})),
    "step_obs_dict": (("Hi.", {}), ({"a": 1}, 0.0, False, False, {})),
    "step_surrogate": (("Hi.", {}), ("bad \udcff end", 0.0, False, False, {})),
    "reward_nan": (("Hi.", {}), ("o", math.nan, True, False, {})),
    "reward_inf": (("Hi.", {}), ("o", -math.inf, True, False, {})),
    "reward_str": (("Hi.", {}), ("o", "1", True, False, {})),
    "reward_array": (("Hi.", {}), ("o", np.array([1.0, 2.0]), True, False, {})),
    "flag_str": (("Hi.", {}), ("o", 1.0, "False", False, {})),
    "info_list": (("Hi.", {}), ("o", 0.0, False, False, [1])),
    "actions_str": (("Hi.", {"admissible_actions": "go north"}), _OK_STEP),
    "tool_messages_str": (("Hi.", {}), ("o", 0.0, False, False, {"tool_messages": ["x"]})),
    "success_str": (("Hi.", {}), ("o", 0.0, True, False, {"success": "false"})),
}

# Answers gymnasium allows: they must still play.
FINE: dict[str, tuple[Any, Any]] = {
    "numpy": (("Hi.", {}), ("o", np.float32(1.0), np.bool_(True), np.bool_(False), {})),
    "int_flags_bool_reward": (("Hi.", {}), ("o", True, 1, 0, {})),
    "both_flags": (("Hi.", {}), ("o", 1.0, True, True, {})),
    "list_answer": (["Hi.", {}], ["o", 1, True, False, {"success": np.bool_(True)}]),
    "odd_info": (("Hi.", {}), ("o", 1.0, True, False, {
        "nan": math.nan, "inf": [math.inf], "set": {3}, (1, 2): "tuple key", "arr": np.arange(3),
        "i64": np.int64(2), "obj": object(), "cycle": _cyclic(), "bad": "x\udcffy"})),
    "info_lock": (("Hi.", {}), ("o", 1.0, True, False, {"lock": threading.Lock()})),  # no pickle
    # the reset's state key and instruction go into the tree's meta: JSON-safe there too
    "reset_odd_meta": (("Hi.", {"state_key": (np.int64(3), math.nan), "instruction": np.int64(7)}),
                       ("o", 1.0, True, False, {})),
}


class AnswerEnv(TextEnv):
    """Answers reset and step as ``ANSWERS[name]`` or ``FINE[name]`` says."""

    def __init__(self, name: str = "reset_none"):
        super().__init__()
        self.answers = ANSWERS.get(name) or FINE[name]

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return self.answers[0]

    def step(self, action: str):
        return self.answers[1]


class ExpertAnswerEnv(AnswerEnv):
    """``AnswerEnv`` with a scripted expert, for SFT's expert episodes."""

    def expert_action(self) -> str:
        return "go"


register_env("agentrl/TestAnswer-v0", entry_point=AnswerEnv)
register_env("agentrl/TestAnswerExpert-v0", entry_point=ExpertAnswerEnv)


def _strict_json(line: str) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(line, parse_constant=refuse)


def _run(tokenizer: Any, tmp_path: Path, env_id: str, kwargs: dict[str, Any], **rollout: Any):
    cfg = Config.model_validate({"env": {"id": env_id, "kwargs": kwargs},
                                 "rollout": {"max_turns": 2, "episode_timeout_s": 30, **rollout}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an env's fault reported as an engine bug warns
        trees = collect(env_id, MockPolicy(tokenizer, ["hi"]), cfg, seeds=[0, 1])
    summary = summarize(trees, wall_s=1.0)
    write_run(tmp_path, trees, summary)
    lines = (tmp_path / "trajectories.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2 and all(_strict_json(line) for line in lines)
    _strict_json((tmp_path / "summary.json").read_text())
    return trees, summary


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_an_answer_that_breaks_the_contract_fails_its_episode_naming_the_env(name, tokenizer, tmp_path):
    trees, summary = _run(tokenizer, tmp_path, "agentrl/TestAnswer-v0", {"name": name},
                          show_admissible=True)
    method = name.split("_")[0] if name.startswith(("reset", "actions")) else "step"
    method = "reset" if method == "actions" else method
    errors = [ep.error for t in trees for ep in t.episodes()]
    assert summary["failed_episodes"] == 2
    assert all(e and e.startswith(f"env.{method} returned ") for e in errors), errors
    assert math.isfinite(summary["mean_reward"])


@pytest.mark.parametrize("name", sorted(FINE))
def test_answers_gymnasium_allows_still_play(name, tokenizer, tmp_path):
    trees, summary = _run(tokenizer, tmp_path, "agentrl/TestAnswer-v0", {"name": name})
    assert summary["failed_episodes"] == 0, summary["failure_reasons"]
    assert summary["success_rate"] == 1.0
    if name == "odd_info":
        info = trees[0].nodes[0].info
        assert info["nan"] == "nan" and info["inf"] == ["inf"] and info["(1, 2)"] == "tuple key"
        assert info["i64"] == 2 and info["bad"] == "x\\udcffy"
    if name == "reset_odd_meta":  # as an info's value would be written (agentrl.env.jsonable)
        assert trees[0].meta["state_key"] == [3, "nan"] and trees[0].meta["instruction"] == 7


def test_answer_problem_names_what_is_wrong():
    assert answer_problem("step", ("o", 0.5, False, False, {})) is None
    assert answer_problem("reset", ("o", {})) is None
    assert answer_problem("step", ("o", 0.0, False, {})) == (
        "env.step returned 4 values, not gymnasium's five-tuple "
        "(observation, reward, terminated, truncated, info)")
    assert answer_problem("step", ("o", math.nan, True, False, {})) == (
        "env.step returned a reward of nan: rewards are finite")
    assert "decode bytes first" in answer_problem("reset", (b"o", {}))


def test_jsonable_keeps_a_large_array_whole():
    """A numpy array was written as its str, which numpy cuts to '[0 0 0 ... 0 0 0]' past 1,000
    elements: two different large state keys became one string, one state for GiGPO's groups."""
    a, b = np.zeros(2000, dtype=np.int64), np.zeros(2000, dtype=np.int64)
    b[1000] = 1
    assert jsonable(a) != jsonable(b) and jsonable(b)[1000] == 1 and len(jsonable(a)) == 2000
    assert jsonable({"grid": np.array([[1.5, np.nan]])}) == {"grid": [[1.5, "nan"]]}


def test_jsonable_is_strict_json():
    out = jsonable({"a": (1, math.nan), 2: {"b": np.float32(0.5)}, "c": np.bool_(False)})
    assert out == {"a": [1, "nan"], "2": {"b": 0.5}, "c": False}
    assert _strict_json(json.dumps(out)) == out


RELEASE_CLOSE = threading.Event()  # a hung close() waits on it; set when its test ends


class MisbehavingEnv(TextEnv):
    """Plays two turns; ``how`` says what goes wrong: ``close_hangs``, ``step_exits`` or ``init_exits``."""

    def __init__(self, how: str = "close_hangs"):
        super().__init__()
        self.how, self.turn = how, 0
        if how == "init_exits":
            sys.exit(3)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.turn = 0
        return "Say two things.", {}

    def step(self, action: str):
        self.turn += 1
        if self.how == "step_exits":
            sys.exit(2)  # argparse in an env, or a library that exits
        return "Go on.", 1.0, self.turn == 2, False, {}

    def close(self) -> None:
        if self.how == "close_hangs":
            RELEASE_CLOSE.wait(120)


register_env("agentrl/TestMisbehaving-v0", entry_point=MisbehavingEnv)


def test_an_env_whose_close_hangs_does_not_hang_the_run(tokenizer, monkeypatch):
    from agentrl.rollout import executors

    monkeypatch.setattr(executors, "_CLOSE_WAIT_S", 1.0)
    cfg = Config.model_validate({"rollout": {"max_turns": 2, "episode_timeout_s": 30}})
    t0 = time.monotonic()
    try:
        with pytest.warns(RuntimeWarning, match="close\\(\\) call\\(s\\) still running"):
            trees = collect("agentrl/TestMisbehaving-v0", MockPolicy(tokenizer, ["hi"]), cfg, seeds=[0, 1])
    finally:
        RELEASE_CLOSE.set()
    assert time.monotonic() - t0 < 30
    assert summarize(trees, 1.0)["success_rate"] == 1.0


@pytest.mark.parametrize("executor", ["thread", "inline"])
def test_an_env_that_calls_sys_exit_fails_only_its_episode(executor, tokenizer):
    cfg = Config.model_validate({"env": {"kwargs": {"how": "step_exits"}},
                                 "rollout": {"max_turns": 2, "env_executor": executor}})
    trees = collect("agentrl/TestMisbehaving-v0", MockPolicy(tokenizer, ["hi"]), cfg, seeds=[0, 1])
    assert [ep.error for t in trees for ep in t.episodes()] == [
        "env.step raised EnvError: the env called sys.exit(2)"] * 2


def test_an_env_whose_constructor_calls_sys_exit_fails_its_episodes(tokenizer):
    cfg = Config.model_validate({"env": {"kwargs": {"how": "init_exits"}}, "rollout": {"max_turns": 2}})
    trees = collect("agentrl/TestMisbehaving-v0", MockPolicy(tokenizer, ["hi"]), cfg, seeds=[0])
    assert [ep.error for t in trees for ep in t.episodes()] == [
        "making the env raised EnvError: the env called sys.exit(3)"]


@pytest.fixture
def env_server():
    from agentrl.proxy import RunningServer
    from agentrl.proxy.envserver import EnvServerConfig, create_env_app

    with RunningServer(create_env_app(EnvServerConfig(token="t"))) as server:
        yield server.url


def _make(url: str, env_id: str, kwargs: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/envs", json={"env_id": env_id, "kwargs": kwargs}, headers=_AUTH, timeout=30)


_AUTH = {"Authorization": "Bearer t"}


@pytest.mark.parametrize("name", ["reward_nan", "reward_str", "step_surrogate", "step_obs_bytes", "step_four"])
def test_the_env_server_ends_the_episode_of_a_step_answer_that_breaks_the_contract(name, env_server):
    made = _make(env_server, "agentrl/TestAnswer-v0", {"name": name})
    assert made.status_code == 200
    url = f"{env_server}/envs/{made.json()['id']}"
    step = httpx.post(f"{url}/step", json={"action": "hi"}, headers=_AUTH, timeout=30)
    assert step.status_code == 200, step.text
    body = step.json()
    assert body["truncated"] and body["info"]["error"].startswith("env.step returned ")
    assert httpx.get(url, headers=_AUTH, timeout=30).status_code == 200  # the state still reads


@pytest.mark.parametrize("name", ["reset_surrogate", "reset_none"])
def test_the_env_server_refuses_a_reset_answer_that_breaks_the_contract(name, env_server):
    made = _make(env_server, "agentrl/TestAnswer-v0", {"name": name})
    assert made.status_code == 400 and "reset failed: env.reset returned " in made.text
    assert httpx.get(f"{env_server}/health", headers=_AUTH).json()["envs"] == 0


def test_the_env_server_writes_odd_info_as_json_and_survives_an_env_that_exits(env_server):
    made = _make(env_server, "agentrl/TestAnswer-v0", {"name": "odd_info"}).json()
    step = httpx.post(f"{env_server}/envs/{made['id']}/step", json={"action": "hi"}, headers=_AUTH, timeout=30)
    assert step.status_code == 200 and step.json()["info"]["nan"] == "nan"
    made = _make(env_server, "agentrl/TestMisbehaving-v0", {"how": "step_exits"}).json()
    step = httpx.post(f"{env_server}/envs/{made['id']}/step", json={"action": "hi"}, headers=_AUTH, timeout=30)
    assert step.json()["info"]["error"] == "RuntimeError: the env called sys.exit(2)"
    assert httpx.get(f"{env_server}/health", headers=_AUTH, timeout=10).status_code == 200


@pytest.mark.parametrize("name", ["reset_obs_int", "reset_info_none", "step_obs_bytes"])
def test_an_sft_expert_episode_checks_the_answers_as_a_rollout_does(name, tokenizer):
    """SFT's expert episodes read reset's answer unchecked: an int observation failed deep in the
    chat template's rendering, with no word of the env."""
    from agentrl.errors import EnvError
    from agentrl.train.sft import expert_tree

    cfg = Config.model_validate({"env": {"id": "agentrl/TestAnswerExpert-v0", "kwargs": {"name": name}},
                                 "rollout": {"max_turns": 2}})
    with pytest.raises(EnvError, match=r"env\.(reset|step) returned"):
        expert_tree(cfg.env.id, tokenizer, cfg, seed=0)


def test_an_answer_that_cannot_leave_the_env_process_is_named_as_such(tokenizer):
    """A lock in info cannot be pickled: the episode failed as 'env.step raised TypeError', blaming
    the env's step, which returned fine (the thread executor plays it)."""
    cfg = Config.model_validate({"env": {"kwargs": {"name": "info_lock"}},
                                 "rollout": {"max_turns": 2, "env_executor": "process", "episode_timeout_s": 60}})
    trees = collect("agentrl/TestAnswer-v0", MockPolicy(tokenizer, ["hi"]), cfg, seeds=[0])
    [error] = [ep.error for t in trees for ep in t.episodes()]
    assert "env.step returned an answer that cannot travel from the env's process" in error, error
    assert "TypeError" in error and "raised TypeError" not in error
