"""``agentrl/ALFWorldReal-v0``: the real ALFWorld text games, from the user's data folder.

The games are ALFWorld's own (``real_data``: ``json_2.1.1/<split>/...``), played
by the engine ALFWorld's text env uses: textworld's ``PddlEnv`` with
``AlfredDemangler`` and ``AlfredInfos`` (``real_engine.make_engine``), each
game loaded from its ``game.tw-pddl``. The optional extra ``alfworld`` must be
installed, and the data must be on disk: without either, constructing the env
raises ``EnvError`` saying what to install or where the data should be. Nothing
is fetched.

Text. Observations are the engine's feedback, unchanged: the reset text starts
"-= Welcome to TextWorld, ALFRED! =-" and ends with "Your task is to: ...".
Actions go to the engine as given (it strips surrounding whitespace and needs
an exact admissible command; anything else is "Nothing happens." and uses up
the step), so a success here is a success in ALFWorld. An action that is not
text goes to the engine as "" and its answer adds that it must be text, naming
its type (``agentrl.envs._action``).
``info["admissible_actions"]`` is the engine's sorted list.

Episodes. ``reset(seed=i)`` plays game ``i % num_tasks`` of the split (sorted
by path); ``options={"game": i}`` picks by index, ``{"game": path}`` by file.
The reward is 1.0 on the step the game is won (``terminated``); after
``max_steps`` steps (50, as ALFWorld's evaluations) the episode is truncated.
``info["task_type"]`` is the family from the game's path (``real_data``), as
the papers count it; ``info["game"]`` names the game.

Branching. ``snapshot()`` records the game and the commands that changed its
state; ``restore()`` reloads the game and replays them (fast-downward keeps the
state in C, so it cannot be copied). ``info["state_key"]`` hashes the engine's
facts, so equal keys mean the same state whatever the path: GiGPO's anchor.

Experts. ALFWorld's experts read the engine's facts, so here they are oracles
(``oracle_action``; ``docs/architecture.md``, Principles: demonstrations must
be learnable), never SFT data by default:

- ``oracle="handcoded"`` (default): ALFWorld's ``HandCodedTWAgent``, driven as
  its ``AlfredExpert`` wrapper drives it (it reads ``traj_data.json`` and the
  facts, and answers "look" when its command is not admissible). It produced the
  ``walkthrough`` stored in each ``game.tw-pddl`` by ``alfworld-generate``.
  One deviation: alfworld 0.4.2's expert lets go of what it holds when the
  last command contains "put", but the 0.4 grammar says "move O to R"; it is
  told "put O in/on R" for those, or it never wins ``pick_two_obj_and_place``.
- ``oracle="planner"``: fast-downward's plan from the current state (the
  wrapper's ``planner`` expert), computed when asked.
- ``oracle=None``: no oracle, and no per-step cost for one.

``info["privileged"]`` at reset holds the game's stored walkthrough, for a
distillation teacher only. There is no observation-consistent expert here
(``expert_action`` raises): ours (``expert``) knows only our scenes' types.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.env import TextEnv
from agentrl.errors import EnvError

from .._action import not_text
from .._settings import names, path_or_none, reset_options, whole
from .real_data import (
    FAMILIES,
    FAMILY_LABELS,
    SPLIT_ALIASES,
    RealGame,
    data_root,
    family_of,
    list_games,
)
from .real_engine import _modules, engine_call, make_engine

__all__ = ["ALFWorldRealEnv", "RealSnapshot"]

_TASK_PREFIX = "Your task is to: "
_MOVE = re.compile(r"move (.+?) to (.+)")
_ORACLES = ("handcoded", "planner", None)


@dataclass(frozen=True, slots=True)
class RealSnapshot:
    """A point of an episode: the game and the state-changing commands that led there."""

    game: Path
    commands: tuple[str, ...]
    steps: int
    done: bool
    won: bool
    last_obs: str
    oracle: Any = None  # (the handcoded expert's memory, its next command), deep copies, when tracked


class ALFWorldRealEnv(TextEnv):
    """The real ALFWorld games of one split; see the module docstring."""

    split_aliases = SPLIT_ALIASES  # other names of the same splits (the trainer's held-out check reads them)

    family_labels = FAMILY_LABELS  # the papers' column names, in their order (agentrl eval reads it)

    def __init__(
        self,
        split: str = "train",
        data_dir: str | os.PathLike[str] | None = None,
        max_steps: int = 50,
        families: list[str] | tuple[str, ...] | None = None,
        oracle: str | None = "handcoded",
        render_mode: str | None = None,
    ):
        super().__init__(render_mode=render_mode)
        max_steps = whole("max_steps", max_steps, low=1)
        data_dir = path_or_none("data_dir", data_dir)
        if oracle not in _ORACLES:
            raise EnvError(f"oracle must be 'handcoded', 'planner' or None, not {oracle!r}")
        if families is not None:
            families = names("families", families, FAMILIES)
        _modules()  # the extra is missing: EnvError naming it
        self.root = data_root(data_dir)
        games = list_games(self.root, split)
        if families is not None:
            games = tuple(g for g in games if g.family in families)
            if not games:
                raise EnvError(f"split {split!r} under {self.root} holds no game of {list(families)}")
        self.split, self.games = games[0].split, games
        self.max_steps, self.oracle = max_steps, oracle
        self._engine: Any = None
        self._loaded: Path | None = None
        self._game: RealGame | None = None
        self._state: Any = None
        self._commands: list[str] = []
        self._steps, self._done, self._won = 0, False, False
        self._expert: Any = None
        self._plan = "look"
        self._expert_error: str | None = None
        self._instruction = ""
        self._walkthrough: tuple[str, ...] = ()

    # -- what the split holds ----------------------------------------------------
    @property
    def num_tasks(self) -> int:
        """Games in the split (seeds ``0 .. num_tasks - 1`` play each once)."""
        return len(self.games)

    def task_family(self, seed: int) -> str:
        """The family of the game ``reset(seed=seed)`` plays, without loading it."""
        return self.games[int(seed) % len(self.games)].family

    @property
    def game(self) -> RealGame:
        if self._game is None:
            raise EnvError("call reset() before using the ALFWorld env")
        return self._game

    # -- the engine --------------------------------------------------------------
    def _load(self, path: Path) -> None:
        if self._engine is None:
            textworld = _modules()[0]
            infos = textworld.EnvInfos(won=True, admissible_commands=True, facts=self.oracle == "handcoded")
            self._engine = make_engine(infos)
        if self._loaded != path:
            self._loaded = None
            try:
                data = json.loads(path.read_text())
                with engine_call():  # the parsed file: textworld's own load leaves it open
                    self._engine.load(data)
                plan = data.get("walkthrough")
            except Exception as e:  # a broken game file: map it to our error tree
                raise EnvError(f"the ALFWorld engine could not load {path}: {type(e).__name__}: {e}") from e
            self._walkthrough = tuple(map(str, plan)) if isinstance(plan, list) else ()
            self._loaded = path

    def _engine_reset(self) -> Any:
        with engine_call():
            return self._engine.reset()

    def _engine_step(self, command: str) -> Any:
        with engine_call():
            state, _, _ = self._engine.step(command)
        return state

    def _pick(self, seed: int | None, options: dict[str, Any] | None) -> RealGame:
        choice = reset_options(options, ("game",)).get("game")
        if choice is None:
            index = int(seed) if seed is not None else int(self.np_random.integers(0, len(self.games)))
            return self.games[index % len(self.games)]
        if isinstance(choice, RealGame):
            return choice
        if isinstance(choice, bool):  # an int, which played game 1
            raise EnvError(f"options['game'] must be a game index, a path or a RealGame, not {choice!r}")
        if isinstance(choice, int):
            if not 0 <= choice < len(self.games):
                raise EnvError(f"options['game']={choice} is out of range: split {self.split!r} has "
                               f"{len(self.games)} games")
            return self.games[choice]
        path = Path(choice)
        for g in self.games:
            if g.path == path or g.path.parent == path:
                return g
        family = family_of(path.parent.parent.name if path.name == "game.tw-pddl" else path.parent.name)
        if family is None or not path.is_file():
            raise EnvError(f"options['game']={choice!r} is no game of split {self.split!r} and no game.tw-pddl "
                           "file under a task dir named after its family")
        return RealGame(path, self.split, family, path.parent.parent.name, path.parent.name)

    # -- gymnasium API -----------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        game = self._pick(seed, options)
        self._load(game.path)
        self._game = game
        self._state = self._engine_reset()
        self._commands, self._steps, self._done, self._won = [], 0, False, False
        self._last_obs = self._state.feedback
        self._start_expert()
        info = self._info()
        plan = self._walkthrough
        if plan:  # for a distillation teacher only (train.distill.privileged); never in a prompt
            info["privileged"] = "The expert's plan: " + "; ".join(plan)
        return self._last_obs, info

    def step(self, action: str):
        if self._state is None:
            raise EnvError("call reset() before step()")
        if self._done:
            obs = "The episode is over. Call reset() to start a new one."
            return obs, 0.0, self._won, not self._won, self._info()
        why = not_text(action)
        command = "" if why else action
        valid = command.strip() in self._state["admissible_commands"]
        self._state = self._engine_step(command)
        if valid:
            self._commands.append(command.strip())
        self._steps += 1
        self._won = bool(self._state["won"])
        truncated = not self._won and self._steps >= self.max_steps
        self._done = self._won or truncated
        self._last_obs = f"{self._state.feedback} {why}" if why else self._state.feedback
        self._feed_expert(command, valid)
        info = self._info()
        info["invalid_action"] = not valid  # not admissible: the engine answers "Nothing happens."
        return self._last_obs, 1.0 if self._won else 0.0, self._won, truncated, info

    def _info(self) -> dict[str, Any]:
        s, game = self._state, self.game
        return {
            "instruction": self._instruction,
            "admissible_actions": [] if self._done else list(s["admissible_commands"]),
            "tools": [],
            "won": self._won,
            "success": self._won,
            "task_type": game.family,
            "game": game.name,
            "state_key": self._state_key(),
        }

    @property
    def instruction(self) -> str:
        return self._instruction

    def _state_key(self) -> str:
        """A short hash of the game and the engine's true facts: equal keys mean the same state.
        (The engine also keeps the negations its actions asserted, "not_atlocation(...)",
        which depend on the path: they are left out.)"""
        facts = sorted(f for f in map(str, self._state["_facts"]) if not f.startswith("not_"))
        return hashlib.blake2b(repr((self.game.name, facts)).encode(), digest_size=8).hexdigest()

    # -- branching ---------------------------------------------------------------
    def snapshot(self) -> RealSnapshot:
        if self._state is None:
            raise EnvError("call reset() before snapshot()")
        oracle = copy.deepcopy((self._expert, self._plan)) if self._expert is not None else None
        return RealSnapshot(self.game.path, tuple(self._commands), self._steps, self._done, self._won,
                            self._last_obs, oracle)

    def restore(self, snapshot: RealSnapshot) -> None:
        """Reload the snapshot's game and replay its commands; the snapshot stays reusable."""
        game = self._game if self._game is not None and self._game.path == snapshot.game else None
        self._game = game or self._pick(None, {"game": snapshot.game})
        self._load(snapshot.game)
        self._state = self._engine_reset()
        self._instruction = _instruction(self._state.feedback)
        for command in snapshot.commands:
            if command not in self._state["admissible_commands"]:
                raise EnvError(f"replaying {snapshot.game} diverged: {command!r} is not admissible")
            self._state = self._engine_step(command)
        self._commands = list(snapshot.commands)
        self._steps, self._done, self._won = snapshot.steps, snapshot.done, snapshot.won
        self._last_obs = snapshot.last_obs
        self._expert, self._plan = copy.deepcopy(snapshot.oracle) or (None, "look")
        self._expert_error = None if self._expert is not None or self.oracle != "handcoded" else \
            "it was unavailable when the snapshot was taken"

    def close(self) -> None:
        """Drop the engine. Its copy of fast-downward's library stays mapped: unloading it
        could pull it from under a step still running in another thread."""
        self._engine, self._loaded, self._state, self._expert = None, None, None, None

    # -- oracles -----------------------------------------------------------------
    def _start_expert(self) -> None:
        self._instruction = _instruction(self._state.feedback)
        self._expert, self._expert_error = None, None
        if self.oracle != "handcoded":
            return
        from alfworld.agents.expert import HandCodedTWAgent

        try:
            expert = HandCodedTWAgent(max_steps=200)  # as AlfredExpert makes it
            expert.reset(str(self.game.path))  # reads traj_data.json beside the game
            expert.observe(self._state.feedback)
        except Exception as e:  # no or a broken traj_data.json: the oracle is unavailable here
            self._expert_error = f"{type(e).__name__}: {e}"
            return
        self._expert = expert
        self._plan = "look"

    def _feed_expert(self, command: str, valid: bool) -> None:
        """After a step: the handcoded expert's next command, as ``AlfredExpert._gather_infos``."""
        if self._expert is None:
            return
        # Only an admissible move lets go of anything (the expert reads "Nothing happens." as a
        # failed command), and _MOVE takes quadratic time on a long line of junk.
        move = _MOVE.fullmatch(command.strip()) if valid else None
        if move:  # see the module docstring: the expert looks for "put" to let go of what it holds
            command = f"put {move[1]} in/on {move[2]}"
        try:
            action = self._expert.act(self._state, 0, self._state["won"], command)
        except Exception as e:  # it times out or gives up (HandCodedAgentTimeout/Failed)
            self._expert, self._expert_error = None, f"{type(e).__name__}: {e}"
            return
        self._plan = action if action in self._state["admissible_commands"] else "look"

    def oracle_action(self) -> str:
        """The privileged expert's next command (see the module docstring)."""
        if self._state is None:
            raise EnvError("call reset() before oracle_action()")
        if self.oracle is None:
            raise EnvError("this env was made with oracle=None")
        if self.oracle == "planner":
            inner = self._engine.unwrapped
            with engine_call():
                plan = inner._pddl_state.replan(inner._entity_infos)
            if not plan:
                raise EnvError(f"the planner finds no plan from here in {self.game.name}")
            return plan[0]
        if self._expert is None:
            raise EnvError(f"ALFWorld's handcoded expert is unavailable in {self.game.name}: {self._expert_error}")
        return self._plan


def _instruction(obs: str) -> str:
    """The task sentence of a reset text ("put a clean mug in coffeemachine."), or ""."""
    start = obs.rfind(_TASK_PREFIX)
    return obs[start + len(_TASK_PREFIX):].strip() if start >= 0 else ""
