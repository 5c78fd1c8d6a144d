"""Envs for the env-worker tests, imported by the workers (``env.imports``):

- ``agentrl-test/Exits-v0``: GuessNumber whose step calls ``sys.exit(3)`` on an action that says
  'exit', as a CLI wrapped with argparse does;
- ``agentrl-test/MarksClose-v0``: GuessNumber that appends a line to the file ``mark`` names when
  it is closed (a sandbox's container removed, say);
- ``agentrl-test/Hangs-v0``: GuessNumber whose step sleeps 60 s on an action that says 'hang'
  (a tool that never returns), holding one of its worker's threads; it first appends a line to
  the file ``mark`` names.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from agentrl.env import register_env
from agentrl.envs.guess_number import GuessNumberEnv


class ExitingEnv(GuessNumberEnv):
    def step(self, action: Any) -> Any:
        if "exit" in str(action):
            sys.exit(3)
        return super().step(action)


class MarksCloseEnv(GuessNumberEnv):
    def __init__(self, mark: str, **kwargs: Any):
        super().__init__(**kwargs)
        self.mark = mark

    def close(self) -> None:
        with open(self.mark, "a") as f:
            f.write("closed\n")
        super().close()


class HangingEnv(GuessNumberEnv):
    def __init__(self, mark: str = "", **kwargs: Any):
        super().__init__(**kwargs)
        self.mark = mark

    def step(self, action: Any) -> Any:
        if "hang" in str(action):
            if self.mark:  # the test sees the hang has begun
                with open(self.mark, "a") as f:
                    f.write("hang\n")
            time.sleep(60)
        return super().step(action)


register_env("agentrl-test/Exits-v0", entry_point=ExitingEnv)
register_env("agentrl-test/MarksClose-v0", entry_point=MarksCloseEnv)
register_env("agentrl-test/Hangs-v0", entry_point=HangingEnv)
