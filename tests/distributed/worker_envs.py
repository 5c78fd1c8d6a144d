"""An env for the env-worker tests, imported by the workers (``env.imports``): GuessNumber whose
step calls ``sys.exit(3)`` on an action that says 'exit', as a CLI wrapped with argparse does."""

from __future__ import annotations

import sys
from typing import Any

from agentrl.env import register_env
from agentrl.envs.guess_number import GuessNumberEnv


class ExitingEnv(GuessNumberEnv):
    def step(self, action: Any) -> Any:
        if "exit" in str(action):
            sys.exit(3)
        return super().step(action)


register_env("agentrl-test/Exits-v0", entry_point=ExitingEnv)
