"""``agentrl/TextWorld-v0``: real TextWorld games as a ``TextEnv``.

Each ``reset(seed=s)`` plays the game generated from ``s`` with the env's
``GameSpec`` (rooms, objects, quest length), ``s`` modulo 2**32 (TextWorld's
generator takes no larger seed, gymnasium any); ``reset()`` without a seed
plays a game from a seed the env's generator draws. Games are built on first
use and cached on disk (``games.game_file``), at most ``max_cached_games`` of
them (1,000 by default, about 400 MB), the least recently used dropped first.
``options={"game_file": path}`` plays a given ``.z8``/``.ulx`` game instead.

- Observation: the game's text feedback.
- ``info``: ``instruction`` (the quest objective), ``admissible_actions``
  (TextWorld's admissible commands), ``tools`` (empty), ``score``,
  ``max_score``, ``won``, ``lost``.
- Reward: the points gained this step, divided by the game's max score, so
  that a won game sums to 1.
- ``terminated`` when the game is won or lost; ``truncated`` after
  ``max_steps`` steps.
- Expert: TextWorld's winning policy from the current state (``policy_commands``),
  which equals the walkthrough when the agent has not strayed.
- Snapshots are the game file plus the action prefix (and the spec and seed
  the game was built from: a game the cache dropped is built again); ``restore``
  restarts the game and replays the prefix (about 1.3 ms per replayed step here). TextWorld's
  own ``env.copy()`` was slower (80-170 ms per copy), so it is not used.

Actions are cleaned before they reach the parser: control characters and
backslashes removed (dumb-frotz's escape; a leading one hung the game), whitespace
folded, at most 190 characters. An empty command is answered
without calling the game and still counts as a step (an action that is not text
is one, and the answer names its type: ``agentrl.envs._action``), and so is one that asks
for one of the interpreter's own verbs or TextWorld's debugging commands
(``meta_verb``): "save" and "script" wrote files into the process's working
directory (the transcript under a name taken from the command), "restore" read
a save back into another episode, "restart" put the game where TextWorld's
state tracking (the admissible actions, the oracle) no longer was, and
"print_state" showed the hidden world that only the oracle may see.

Needs the optional ``textworld`` package; making the env without it raises an
``EnvError`` that says what to install.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.env import TextEnv
from agentrl.errors import EnvError

from .._action import not_text
from .._settings import path_or_none, reset_options, whole
from .games import MAX_CACHED_GAMES, GameSpec, game_file, game_spec, require_textworld

__all__ = ["TextWorldEnv", "TextWorldSnapshot", "clean_command"]

_MAX_COMMAND = 190  # jericho truncates commands past 198 bytes, with a warning
# Besides control and non-ASCII characters, the backslash: dumb-frotz reads it as its own
# escape, and a command that starts with one loops forever on "unknown command".
_JUNK = re.compile(r"[^\x20-\x5b\x5d-\x7e]+")
_SPACES = re.compile(r"\s+")
# The Z-machine compares a word's first 9 letters only: "transcripts" is "transcript".
_DICT_LETTERS = 9
_META_VERBS = frozenset(v[:_DICT_LETTERS] for v in (
    "save", "restore", "restart", "quit", "q", "script", "transcript", "unscript",
    # TextWorld's commands for its own tooling (and every "tw-..." one): "print_state" prints
    # the hidden world
    "print_state", "enable", "disable", "restrict",
))
_WORD = re.compile(r"[\w-]+")
_CLAUSES = re.compile(r"[.,;]|\bthen\b")  # Inform runs "look. save", "look, save", "look then save"
_PROMPT = re.compile(r"\s*>[^\n]*$")  # the trailing "> ... -= Room =-0/3" status line
_BLANKS = re.compile(r"\n{3,}")


@dataclass(slots=True, frozen=True)
class TextWorldSnapshot:
    """A game and the commands played in it; ``restore`` replays them. ``spec`` and
    ``seed`` built the game (None for a game given by path): they build it again
    where the cache has dropped it."""

    game_file: str
    actions: tuple[str, ...]
    spec: GameSpec | None = None
    seed: int | None = None


def _clean_feedback(text: str | None) -> str:
    cleaned = _BLANKS.sub("\n\n", _PROMPT.sub("", text or "")).strip()
    return cleaned or "(The game printed nothing.)"


def clean_command(action: str) -> str:
    """What the TextWorld parser is given for ``action``."""
    text = _JUNK.sub(" ", action[: _MAX_COMMAND * 4])
    return _SPACES.sub(" ", text).strip()[:_MAX_COMMAND]


def meta_verb(command: str) -> str | None:
    """The interpreter or TextWorld verb (save, restart, print_state, ...) that ``command``
    would run, if any: the first word of any of its clauses, as the game's dictionary reads it."""
    for clause in _CLAUSES.split(command.lower()):
        words = _WORD.findall(clause)
        if words and (words[0][:_DICT_LETTERS] in _META_VERBS or words[0].startswith("tw-")):
            return words[0]
    return None


class TextWorldEnv(TextEnv):
    """Play generated TextWorld games; admissible commands and a privileged oracle included."""

    def __init__(
        self,
        nb_rooms: int = 3,
        nb_objects: int = 6,
        quest_length: int = 3,
        max_steps: int = 50,
        cache_dir: str | os.PathLike | None = None,
        max_cached_games: int = MAX_CACHED_GAMES,
        render_mode: str | None = None,
    ):
        super().__init__(render_mode=render_mode)
        self._tw = require_textworld()
        self.max_steps = whole("max_steps", max_steps, low=1)
        # whole() refuses what pydantic would coerce ("3", 3.0); GameSpec holds the ranges
        self.game_spec: GameSpec = game_spec(
            nb_rooms=whole("nb_rooms", nb_rooms), nb_objects=whole("nb_objects", nb_objects),
            quest_length=whole("quest_length", quest_length),
        )
        self.cache_dir = path_or_none("cache_dir", cache_dir)
        self.max_cached_games = whole("max_cached_games", max_cached_games, low=1)
        self._game: Any = None
        self._game_file = ""
        self._game_seed: int | None = None  # what built the game; None for a given file
        self._state: Any = None
        self._actions: list[str] = []
        self._done = False
        self._truncated = False  # done for want of steps, not by a win or loss

    # -- gymnasium API ---------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = reset_options(options, ("game_file",))
        if "game_file" in options:
            path, game_seed = str(options["game_file"]), None
        else:
            game_seed = seed % 2**32 if seed is not None else int(self.np_random.integers(2**31))
            path = self._build(self.game_spec, game_seed)
        self._start(path)
        self._game_seed = game_seed
        self._last_obs = _clean_feedback(self._state.get("feedback"))
        return self._last_obs, self._info()

    def step(self, action: str):
        if self._game is None:
            raise EnvError("call reset() before step()")
        if self._done:  # pays nothing and repeats how the episode ended
            return self._last_obs, 0.0, not self._truncated, self._truncated, self._info()
        why = not_text(action)
        command = "" if why else clean_command(action)
        self._actions.append(command)
        reward, terminated = 0.0, False
        if not command:
            obs = f"I beg your pardon? {why + ' ' if why else ''}Type a command, e.g. one of the admissible actions."
        elif verb := meta_verb(command):
            obs = f'"{verb}" is not available in this game. Type one of the admissible actions.'
        else:
            before = self._state.get("score") or 0
            self._state = self._engine_step(command)
            obs = _clean_feedback(self._state.get("feedback"))
            max_score = self._state.get("max_score") or 1
            reward = ((self._state.get("score") or 0) - before) / max_score
            terminated = bool(self._state.get("won") or self._state.get("lost"))
        truncated = not terminated and len(self._actions) >= self.max_steps
        self._done, self._truncated = terminated or truncated, truncated
        self._last_obs = obs
        info = self._info()
        if terminated:
            info["success"] = bool(self._state.get("won"))
        return obs, float(reward), terminated, truncated, info

    def close(self) -> None:
        if self._game is not None:
            self._game.close()
            self._game = None

    # -- branching -------------------------------------------------------------
    def snapshot(self) -> TextWorldSnapshot:
        if self._game is None:
            raise EnvError("call reset() before snapshot()")
        spec = self.game_spec if self._game_seed is not None else None
        return TextWorldSnapshot(self._game_file, tuple(self._actions), spec, self._game_seed)

    def restore(self, snapshot: TextWorldSnapshot) -> None:
        path = snapshot.game_file
        loaded = self._game is not None and path == self._game_file
        if not loaded and snapshot.spec is not None and snapshot.seed is not None:
            # in the snapshot's cache folder: marks the game used, or builds it again there
            path = str(game_file(snapshot.spec, snapshot.seed, Path(path).parent, self.max_cached_games))
        self._start(path)
        self._game_seed = snapshot.seed
        self._last_obs = _clean_feedback(self._state.get("feedback"))
        for command in snapshot.actions:
            self.step(command)

    # -- oracle ----------------------------------------------------------------
    def oracle_action(self) -> str:
        """The next command of TextWorld's winning policy from here.

        Privileged: TextWorld's solver knows the whole game (what lies in rooms
        and containers not yet seen), so it is an oracle and a teacher, and SFT
        clones it only with ``sft.expert: oracle``.
        """
        if self._state is None:
            raise EnvError("call reset() before oracle_action()")
        policy = self._state.get("policy_commands") or []
        if policy:
            return policy[0]
        walkthrough = self._state.get("extra.walkthrough") or []
        return walkthrough[len(self._actions)] if len(self._actions) < len(walkthrough) else "look"

    # -- internals -------------------------------------------------------------
    def _build(self, spec: GameSpec, seed: int) -> str:
        """The path of the cached game for ``(spec, seed)``, built if it is not there."""
        return str(game_file(spec, seed, self.cache_dir, self.max_cached_games))

    def _start(self, path: str) -> None:
        if self._game is not None and path == self._game_file:
            self._state = self._engine_reset()
        else:
            self.close()
            infos = self._tw.EnvInfos(
                admissible_commands=True,
                policy_commands=True,
                objective=True,
                score=True,
                max_score=True,
                won=True,
                lost=True,
                extras=["walkthrough"],
            )
            try:
                with warnings.catch_warnings():
                    # jericho does not know generated games; TextWorld tracks the score itself.
                    warnings.filterwarnings("ignore", message=".*not fully supported.*")
                    self._game = self._tw.start(path, request_infos=infos)
            except Exception as exc:
                raise EnvError(f"TextWorld could not load {path!r}: {exc}") from exc
            self._game_file = path
            self._state = self._engine_reset()
        self._actions = []
        self._done = self._truncated = False

    def _engine_reset(self) -> Any:
        try:
            return self._game.reset()
        except Exception as exc:
            raise EnvError(f"TextWorld reset failed for {self._game_file!r}: {exc}") from exc

    def _engine_step(self, command: str) -> Any:
        try:
            state, _, _ = self._game.step(command)
        except Exception as exc:
            raise EnvError(f"TextWorld step {command!r} failed: {exc}") from exc
        return state

    def _info(self) -> dict[str, Any]:
        state = self._state
        return {
            "instruction": state.get("objective") or "",
            "admissible_actions": []
            if self._done
            else list(state.get("admissible_commands") or []),
            "tools": [],
            "score": state.get("score", 0),
            "max_score": state.get("max_score", 0),
            "won": bool(state.get("won")),
            "lost": bool(state.get("lost")),
        }
