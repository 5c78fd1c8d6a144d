"""``agentrl/TextWorld-v0``: real TextWorld games, generated from a seed and cached.

Importing this package does not need ``textworld``; making the env does
(``pip install 'agentrl[textworld]'``).
"""

from .env import TextWorldEnv, TextWorldSnapshot, clean_command
from .games import GameSpec, default_cache_dir, game_file, require_textworld

__all__ = [
    "GameSpec",
    "TextWorldEnv",
    "TextWorldSnapshot",
    "clean_command",
    "default_cache_dir",
    "game_file",
    "require_textworld",
]
