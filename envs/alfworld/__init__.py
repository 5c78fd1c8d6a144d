"""ALFWorld-style household tasks (``agentrl/ALFWorld-v0``) and a bridge to the real engine.

- ``env``: the ``TextEnv`` (``ALFWorldEnv``).
- ``scene``: procedural rooms and tasks from ``(split, seed)``.
- ``world``: the rules, admissible commands and feedback text.
- ``expert``: the observation-consistent expert (acts on what was seen; SFT's default).
- ``oracle``: the privileged planner (reads the hidden state; an oracle and a teacher).
- ``pddl_export``: our scenes as ALFWorld PDDL problems.
- ``real_engine``: plays them in the real alfworld PDDL engine (optional extra).
- ``real_data``: the real games on disk (ALFWorld's layout, splits, families),
  and ``export_games``, which writes our scenes in that layout.
- ``real_env``: ``agentrl/ALFWorldReal-v0``, the real games (``ALFWorldRealEnv``).
"""

from .env import ALFWorldEnv, expert_trajectory
from .expert import Notes, expert_from_history, location_prior, next_command, parse_goal
from .oracle import oracle_command
from .real_data import FAMILY_LABELS, RealGame, export_games, list_games
from .real_env import ALFWorldRealEnv
from .scene import SPLITS, Scene, Task, generate_scene
from .world import World

__all__ = [
    "FAMILY_LABELS",
    "SPLITS",
    "ALFWorldEnv",
    "ALFWorldRealEnv",
    "Scene",
    "Task",
    "Notes",
    "RealGame",
    "World",
    "expert_from_history",
    "export_games",
    "expert_trajectory",
    "generate_scene",
    "list_games",
    "location_prior",
    "next_command",
    "oracle_command",
    "parse_goal",
]
