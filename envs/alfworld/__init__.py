"""ALFWorld-style household tasks (``agentrl/ALFWorld-v0``) and a bridge to the real engine.

- ``env``: the ``TextEnv`` (``ALFWorldEnv``).
- ``scene``: procedural rooms and tasks from ``(split, seed)``.
- ``world``: the rules, admissible commands and feedback text.
- ``expert``: the hand-coded expert.
- ``pddl_export``: our scenes as ALFWorld PDDL problems.
- ``real_engine``: plays them in the real alfworld PDDL engine (optional extra).
"""

from .env import ALFWorldEnv, expert_trajectory
from .expert import expert_command
from .scene import SPLITS, Scene, Task, generate_scene
from .world import World

__all__ = [
    "SPLITS",
    "ALFWorldEnv",
    "Scene",
    "Task",
    "World",
    "expert_command",
    "expert_trajectory",
    "generate_scene",
]
