"""Fakes shared by tests: scripted envs that misbehave on purpose."""

from __future__ import annotations

import threading
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


RELEASE = threading.Event()  # hung env steps wait on it; set when a test ends


class MixedEnv(TextEnv):
    """Seed % 4: 0 and 3 win on turn 3; 1 raises on turn 2; 2 hangs on turn 2."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.kind, self.turn = (seed or 0) % 4, 0
        return f"Task {seed}: say three things.", {"instruction": "say three things"}

    def step(self, action: str):
        self.turn += 1
        if self.turn == 2 and self.kind == 1:
            raise RuntimeError("simulated env crash")
        if self.turn == 2 and self.kind == 2:
            RELEASE.wait(60)
        done = self.turn == 3
        return f"heard {len(action)} chars", float(done), done, False, {"success": done}


class NoSnapshotEnv(TextEnv):
    """Deterministic, but cannot snapshot: branches must replay the action prefix."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.said: list[str] = []
        return "Count with me.", {"instruction": "count"}

    def step(self, action: str):
        self.said.append(action)
        done = len(self.said) == 3
        return f"{len(self.said)}: {action}", 0.0, done, False, {}

    def snapshot(self) -> Any:
        raise NotImplementedError("no snapshots here")


class SpawnThenHangEnv(TextEnv):
    """Its first step starts a child process (``sleep``; its pid written to ``pid_file``),
    then hangs: an env whose engine process outlives it unless its process group is killed."""

    def __init__(self, pid_file: str = ""):
        super().__init__()
        self.pid_file = pid_file

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return "Say anything.", {"instruction": "Say anything.", "tools": []}

    def step(self, action: str):
        import subprocess
        import time
        from pathlib import Path

        child = subprocess.Popen(["sleep", "600"])
        Path(self.pid_file).write_text(str(child.pid))
        time.sleep(600)
        return "never", 0.0, True, False, {}


class SlowStartEnv(TextEnv):
    """Takes ``start_s`` seconds to construct (an env that loads a game or an index)."""

    def __init__(self, start_s: float = 3.0):
        import time

        super().__init__()
        time.sleep(start_s)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return "Say anything.", {"instruction": "Say anything.", "tools": []}

    def step(self, action: str):
        return "Done.", 1.0, True, False, {"success": True}


register_env("agentrl/TestMixed-v0", entry_point=MixedEnv)
register_env("agentrl/TestSlowStart-v0", entry_point=SlowStartEnv)
register_env("agentrl/TestSpawnThenHang-v0", entry_point=SpawnThenHangEnv)
register_env("agentrl/TestNoSnapshot-v0", entry_point=NoSnapshotEnv)


class ClashingInfoEnv(TextEnv):
    """Its ``info`` reuses the names of the engine's own annotations of a turn
    (``top1``, ``expert_action``, ``open``); it has an expert, and ends on turn 2."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.turn = 0
        return "Say two things.", {"instruction": "say two things"}

    def expert_action(self) -> str:
        return f"expert move {self.turn}"

    def step(self, action: str):
        self.turn += 1
        info = {"top1": "the env's", "expert_action": "the env's", "open": True}
        return "Go on.", 0.0, self.turn == 2, False, info


register_env("agentrl/TestClashingInfo-v0", entry_point=ClashingInfoEnv)
