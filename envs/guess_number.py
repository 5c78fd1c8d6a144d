"""``agentrl/GuessNumber-v0``: find a secret integer from "higher"/"lower" hints.

The smallest built-in env: it runs everything end to end in milliseconds and has
a scripted expert (bisection) that always wins within ceil(log2(high)) + 1 turns.

``info["state_key"]`` names the state a guess is made in (guesses used, the
interval still possible) for GiGPO's anchor-state groups: two episodes of
one task whose guesses left the same interval after the same number of turns
are in the same state, whatever the guesses were.

The reset info's ``privileged`` text names the secret, for a teacher that
may know it (``train.distill.privileged``); the agent never sees it.

Reward: 1.0 on the turn the number is found, else 0.0. The episode is truncated
after ``max_turns`` turns. An action that holds no integer in range is answered
with an error observation and uses up the turn, and so is an action that is not
text (``agentrl.envs._action``: the observation names its type). A step after the episode ended
pays nothing and repeats how it ended.
"""

from __future__ import annotations

import re
from typing import Any

from agentrl.env import TextEnv
from agentrl.errors import EnvError

from ._action import not_text
from ._settings import reset_options, whole

_INT = re.compile(r"-?\d+")
MAX_HIGH = 1_000_000  # info["admissible_actions"] lists every number still possible


class GuessNumberEnv(TextEnv):
    """Guess a secret integer in ``[1, high]`` within ``max_turns`` turns."""

    def __init__(self, high: int = 32, max_turns: int = 8, render_mode: str | None = None):
        super().__init__(render_mode=render_mode)
        high, max_turns = whole("high", high, low=1), whole("max_turns", max_turns, low=1)
        if high > MAX_HIGH:
            raise EnvError(f"high must be at most {MAX_HIGH:,}, not {high:,}: "
                           "info['admissible_actions'] lists every number still possible")
        self.high = high
        self.max_turns = max_turns
        self.secret = 0  # none before reset
        self.low_bound, self.high_bound = 1, high
        self.turn = 0
        self.ended: tuple[bool, bool] | None = None  # (terminated, truncated) once over

    def _info(self) -> dict[str, Any]:
        return {
            "instruction": self.instruction,
            "admissible_actions": [] if self.ended  # no action is taken after the end
            else [str(i) for i in range(self.low_bound, self.high_bound + 1)],
            "tools": [],
            # What the next guess can depend on: the interval left and the guesses used.
            "state_key": f"turn {self.turn}: {self.low_bound}..{self.high_bound}",
        }

    @property
    def instruction(self) -> str:
        return (
            f"I am thinking of a whole number between 1 and {self.high}. "
            f"Guess it: answer with one number only. You have {self.max_turns} guesses."
        )

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        reset_options(options, ())
        self.secret = int(self.np_random.integers(1, self.high + 1))
        self.low_bound, self.high_bound = 1, self.high
        self.turn = 0
        self.ended = None
        self._last_obs = self.instruction
        # For a distillation teacher only (train.distill.privileged); never shown to the agent.
        return self._last_obs, {**self._info(), "privileged": f"The secret number is {self.secret}."}

    def step(self, action: str):
        if not self.secret:
            raise EnvError("call reset() before step()")
        if self.ended:
            self._last_obs = "The episode is over. Call reset() to start a new one."
            return self._last_obs, 0.0, *self.ended, self._info()
        self.turn += 1
        why = not_text(action)
        guess = None if why else _guess(action)
        reward, terminated = 0.0, False
        if guess is None or not 1 <= guess <= self.high:
            obs = f"Invalid guess. {why + ' ' if why else ''}Answer with one whole number between 1 and {self.high}."
        elif guess == self.secret:
            obs, reward, terminated = f"Correct! The number was {self.secret}.", 1.0, True
        elif guess < self.secret:
            self.low_bound = max(self.low_bound, guess + 1)
            obs = f"{guess} is too low. Guess higher."
        else:
            self.high_bound = min(self.high_bound, guess - 1)
            obs = f"{guess} is too high. Guess lower."
        truncated = not terminated and self.turn >= self.max_turns
        if truncated:
            obs += f" Out of guesses; the number was {self.secret}."
        if terminated or truncated:
            self.ended = (terminated, truncated)
        self._last_obs = obs
        return obs, reward, terminated, truncated, self._info()

    def expert_action(self) -> str:
        return str((self.low_bound + self.high_bound) // 2)


def _guess(action: str) -> int | None:
    """The first whole number in ``action``, or None."""
    match = _INT.search(action[:10_000])
    # Past 20 digits (leading zeros aside) a number is out of range, and int() refuses 4,300.
    return int(match.group()) if match and len(match.group().lstrip("-0")) <= 20 else None
