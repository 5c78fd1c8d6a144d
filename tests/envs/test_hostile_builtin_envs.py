"""The built-in envs against what models and users send them: garbage actions, steps
after the episode ended, odd seeds and kwargs. The test of each defect failed before its
fix (the commit that adds it says what was wrong); the others keep the fix from refusing
too much.

Envs with optional extras (textworld) skip, saying so, without them.
"""

from __future__ import annotations

from agentrl.envs.guess_number import GuessNumberEnv

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
