"""Built-in environments. Importing this package registers them with gymnasium."""

from agentrl.env import register_env

from .guess_number import GuessNumberEnv

__all__ = ["GuessNumberEnv"]

register_env("agentrl/GuessNumber-v0", entry_point="agentrl.envs.guess_number:GuessNumberEnv")
