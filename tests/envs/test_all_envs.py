"""Contract tests run against every registered env: gymnasium's checker, fuzzing,
and snapshot/restore. Envs whose optional extras are missing are reported as skips."""

from __future__ import annotations

import json
import math
import random

import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.env import answer_problem, list_envs, make_env
from agentrl.errors import EnvError

ENV_IDS = [e for e in list_envs() if not e.startswith("agentrl/Test")]

JUNK = st.one_of(
    st.text(max_size=200),
    st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
    st.sampled_from(
        [
            "",
            " ",
            "\x00",
            "search[]",
            "click[]",
            "go to",
            "x" * 100_000,
            "<tool_call>{</tool_call>",
            "take  from ",
            "99999999999999999999",
        ]
    ),
)


def _make(env_id):
    try:
        return make_env(env_id)
    except (EnvError, ImportError) as e:  # an optional extra is not installed
        pytest.skip(f"{env_id} cannot be made here: {e}")


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_gymnasium_env_checker_passes(env_id):
    env = _make(env_id)
    check_env(env.unwrapped, skip_render_check=True)
    env.close()


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_reset_info_carries_instruction_and_tools(env_id):
    env = _make(env_id)
    obs, info = env.reset(seed=1)
    assert isinstance(obs, str) and obs
    assert isinstance(info["instruction"], str) and info["instruction"]
    assert isinstance(info["tools"], list)
    env.close()


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_step_answers_any_text_with_an_observation(env_id):
    env = _make(env_id)

    @settings(deadline=None, max_examples=40, suppress_health_check=list(HealthCheck))
    @given(actions=st.lists(JUNK, min_size=1, max_size=4))
    def run(actions):
        env.reset(seed=0)
        for a in actions:
            obs, reward, terminated, truncated, info = env.step(a)
            assert isinstance(obs, str)
            assert isinstance(reward, float) and math.isfinite(reward)
            assert isinstance(terminated, bool) and isinstance(truncated, bool)
            if terminated or truncated:
                break

    run()
    env.close()


def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


# Per tool: calls before the branch point, and calls after it whose results
# depend on what the first ones left behind (interpreter variables, files).
TOOL_SCRIPTS = {
    "python": (
        [_call("python", code="import random\nx = 41\nrandom.seed(x)")],
        [_call("python", code="x += 1\nprint(x, random.random())"), _call("python", code="x")],
    ),
    "bash": (
        [_call("bash", command="echo 41 > n.txt")],
        [
            _call("bash", command="echo $(( $(cat n.txt) + 1 )) >> n.txt; cat n.txt"),
            _call("edit_file", path="n.txt", search="42", replace="43"),
            _call("read_file", path="n.txt"),
        ],
    ),
    "search": (
        [_call("search", query="born in", k=2)],
        [_call("search", query="company founded", k=3), _call("search", query="river", k=1)],
    ),
}


def _trace(env, actions):
    out = []
    for a in actions:
        obs, r, term, trunc, info = env.step(a)
        assert "error" not in info, info["error"]
        out.append(
            (obs, r, term, trunc, sorted(info.get("admissible_actions") or []),
             [c["name"] for c in info.get("tool_calls") or []])
        )  # fmt: skip
        if term or trunc:
            break
    return out


def _branch_script(env, info, rng):
    """(actions before the branch point, actions after it) for this env."""
    tools = [t["name"] for t in info.get("tools") or []]
    script = next((TOOL_SCRIPTS[t] for t in tools if t in TOOL_SCRIPTS), None)
    if script is not None:
        before, after = script
        return before, [*after, "Answer: 0"]
    assert info.get("admissible_actions"), "an env without tools must list admissible actions"
    before = [rng.choice(info["admissible_actions"]) for _ in range(3)]
    return before, None


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_restored_env_continues_identically(env_id):
    env = _make(env_id).unwrapped
    _, info = env.reset(seed=7)
    rng = random.Random(0)
    before, after = _branch_script(env, info, rng)
    for action in before:  # walk a little before branching
        _, _, term, trunc, info = env.step(action)
        assert "error" not in info, info["error"]
        if term or trunc:
            _, info = env.reset(seed=8)
    snap = env.snapshot()
    if after is None:
        after = [rng.choice(info["admissible_actions"]) for _ in range(5)]
    first = _trace(env, after)
    env.restore(snap)
    second = _trace(env, after)
    env.restore(snap)
    assert first == second == _trace(env, after)
    if env_id in ("agentrl/MathPython-v0", "agentrl/BashFix-v0", "agentrl/SearchQA-v0"):
        assert all(calls for *_, calls in first[:-1])  # the tool calls really ran
    env.close()


# What a caller's bug, not a model, sends: each env answers it as an invalid action
# whose observation names the type (the wording of agentrl.tools.parse), and the
# episode goes on. GuessNumber-v0 raised a TypeError; the others answered as if the
# action were "" (bytes were decoded by some and refused by others).
NOT_TEXT = [None, b"look", bytearray(b"5"), 5, 2.5, ["look"], {"name": "look"}]


@pytest.mark.parametrize("action", NOT_TEXT, ids=lambda a: type(a).__name__)
@pytest.mark.parametrize("env_id", ENV_IDS)
def test_a_non_text_action_is_answered_with_an_observation_naming_its_type(env_id, action):
    env = _make(env_id)
    env.reset(seed=0)
    answer = env.step(action)
    assert answer_problem("step", answer) is None
    obs, reward, terminated, truncated, _ = answer
    assert f"he action must be text, got {type(action).__name__}" in obs  # "The"/"the"
    assert (reward, terminated, truncated) == (0.0, False, False)
    env.close()
