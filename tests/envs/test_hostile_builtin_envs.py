"""The built-in envs against what models and users send them: garbage actions, steps
after the episode ended, odd seeds and kwargs. The test of each defect failed before its
fix (the commit that adds it says what was wrong); the others keep the fix from refusing
too much.

Envs with optional extras (textworld) skip, saying so, without them.
"""

from __future__ import annotations

import pytest

from agentrl.envs.guess_number import GuessNumberEnv
from agentrl.errors import EnvError


def _run_until_done(env, actions):
    """Step ``actions`` (a callable giving the next one) until the episode ends; its last answer."""
    for _ in range(200):
        obs, reward, terminated, truncated, info = env.step(actions())
        if terminated or truncated:
            return obs, reward, terminated, truncated, info
    raise AssertionError("the episode did not end")


# -- GuessNumber -------------------------------------------------------------------------


def test_guess_number_answers_a_number_of_thousands_of_digits_as_an_invalid_guess():
    env = GuessNumberEnv()
    env.reset(seed=0)
    obs, reward, terminated, truncated, _ = env.step("9" * 5_000)  # int() refuses over 4,300 digits
    assert obs.startswith("Invalid guess") and reward == 0.0 and not terminated


def test_guess_number_reads_leading_zeros_as_the_number():
    env = GuessNumberEnv()
    env.reset(seed=0)
    obs, reward, terminated, _, _ = env.step("0" * 30 + str(env.secret))
    assert reward == 1.0 and terminated, obs


def test_guess_number_step_before_reset_is_an_env_error():
    with pytest.raises(EnvError, match="reset"):
        GuessNumberEnv().step("5")


# -- after the episode ended: every env ------------------------------------------------------


def _guess_number(max_steps):
    env = GuessNumberEnv(max_turns=max_steps)
    return env, (lambda: str(env.secret))


MAKERS = {
    "GuessNumber": lambda n, tmp: _guess_number(n),
}


@pytest.mark.parametrize("name", MAKERS)
def test_a_step_after_the_goal_is_reached_pays_nothing_and_stays_terminated(name, tmp_path):
    env, solve = MAKERS[name](50, tmp_path)
    env.reset(seed=0)
    _, reward, terminated, truncated, _ = _run_until_done(env, solve)
    assert terminated and not truncated and reward > 0
    for _ in range(2):
        _, reward, terminated, truncated, _ = env.step("look")
        assert (reward, terminated, truncated) == (0.0, True, False)
    env.close()


@pytest.mark.parametrize("name", MAKERS)
def test_a_step_after_truncation_pays_nothing_and_stays_truncated(name, tmp_path):
    env, solve = MAKERS[name](2, tmp_path)
    env.reset(seed=0)
    _, _, terminated, truncated, _ = _run_until_done(env, lambda: "junk")
    assert truncated and not terminated
    for _ in range(2):  # the action that would have won pays nothing now
        _, reward, terminated, truncated, _ = env.step(solve())
        assert (reward, terminated, truncated) == (0.0, False, True)
    env.close()
