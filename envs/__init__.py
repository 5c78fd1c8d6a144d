"""Built-in environments. Importing this package registers them with gymnasium."""

from agentrl.env import register_env

from .guess_number import GuessNumberEnv

__all__ = ["GuessNumberEnv"]

register_env("agentrl/GuessNumber-v0", entry_point="agentrl.envs.guess_number:GuessNumberEnv")
register_env("agentrl/ALFWorld-v0", entry_point="agentrl.envs.alfworld.env:ALFWorldEnv")
register_env("agentrl/WebShop-v0", entry_point="agentrl.envs.webshop.env:WebShopEnv")
# The real suites, from the user's data folder (see each module's docstring).
register_env("agentrl/ALFWorldReal-v0", entry_point="agentrl.envs.alfworld.real_env:ALFWorldRealEnv")
register_env("agentrl/WebShopReal-v0", entry_point="agentrl.envs.webshop.real_env:WebShopRealEnv")
register_env("agentrl/TextWorld-v0", entry_point="agentrl.envs.textworld.env:TextWorldEnv")
register_env("agentrl/MathPython-v0", entry_point="agentrl.envs.tooltasks.math_python:MathPythonEnv")
register_env("agentrl/SearchQA-v0", entry_point="agentrl.envs.tooltasks.search_qa:SearchQAEnv")
register_env("agentrl/BashFix-v0", entry_point="agentrl.envs.tooltasks.bash_fix:BashFixEnv")
