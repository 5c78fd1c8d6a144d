"""Contract tests run against every registered env: gymnasium's checker, fuzzing,
and snapshot/restore. Envs whose optional extras are missing are reported as skips."""

from __future__ import annotations

import random

import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.env import list_envs, make_env
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
            assert isinstance(float(reward), float)
            assert isinstance(terminated, bool) and isinstance(truncated, bool)
            if terminated or truncated:
                break

    run()
    env.close()


def _trace(env, actions):
    out = []
    for a in actions:
        obs, r, term, trunc, info = env.step(a)
        out.append((obs, r, term, trunc, sorted(info.get("admissible_actions") or [])))
        if term or trunc:
            break
    return out


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_restored_env_continues_identically(env_id):
    env = _make(env_id).unwrapped
    _, info = env.reset(seed=7)
    rng = random.Random(0)
    for _ in range(3):  # walk a little before branching
        adm = info.get("admissible_actions") or ["look"]
        _, _, term, trunc, info = env.step(rng.choice(adm))
        if term or trunc:
            _, info = env.reset(seed=8)
    snap = env.snapshot()
    adm = info.get("admissible_actions") or ["look"]
    actions = [rng.choice(adm) for _ in range(5)]
    first = _trace(env, actions)
    env.restore(snap)
    second = _trace(env, actions)
    env.restore(snap)
    assert first == second == _trace(env, actions)
    env.close()
