"""Fakes shared by tests: scripted envs that misbehave on purpose."""

from __future__ import annotations

from typing import Any

from agentrl.env import TextEnv, register_env


class CrashingEnv(TextEnv):
    """Raises inside ``step`` on the turn given by ``crash_on``."""

    def __init__(self, crash_on: int = 1):
        super().__init__()
        self.crash_on = crash_on
        self.turn = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.turn = 0
        return "Say anything.", {"instruction": "Say anything.", "tools": []}

    def step(self, action: str):
        self.turn += 1
        if self.turn >= self.crash_on:
            raise RuntimeError("simulated env crash")
        return "Go on.", 0.0, False, False, {}


class FloodEnv(TextEnv):
    """Answers every action with an observation of ``obs_chars`` characters."""

    def __init__(self, obs_chars: int = 20_000):
        super().__init__()
        self.obs_chars = obs_chars

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return "Start.", {"instruction": "Start.", "tools": []}

    def step(self, action: str):
        return "word " * (self.obs_chars // 5), 0.0, False, False, {}


register_env("agentrl/TestCrashing-v0", entry_point=CrashingEnv)
register_env("agentrl/TestFlood-v0", entry_point=FloodEnv)
