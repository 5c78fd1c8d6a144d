"""``agentrl/ALFWorld-v0``: ALFWorld-style household tasks as a ``TextEnv``.

Each reset generates a room from ``(split, seed)`` (see ``scene``): numbered
receptacles, typed objects, light sources and one task of the six ALFWorld
families, stated the ALFWorld way ("Your task is to: put a clean mug in
coffeemachine."). The agent acts with ALFWorld's commands (see ``world``);
``info["admissible_actions"]`` lists the valid ones, sorted, every step;
``info["state_key"]`` is a short hash of the true world state (GiGPO's anchor);
``info["invalid_action"]`` says whether the last action was answered "Nothing
happens." (rollouts and evaluations log the fraction of such turns).

Reward: 1.0 on the step the goal first holds (``terminated=True``). With
``dense_reward=True`` each subgoal reached for the first time in the episode
also pays ``subgoal_reward`` (holding a task object; its state change, its
first placement, or the lamp switched on). ``invalid_penalty`` (0 by default)
is subtracted on every step answered "Nothing happens.", so among failed
episodes the ones that wasted fewer steps score higher: an outcome-only group
whose leaves all fail carries no signal, and the SFT'd 135M model's commonest
waste is taking an object it has not seen. After ``max_steps`` steps (50, as in
ALFWorld's evaluations) the episode is truncated by the env itself.

Input is forgiving the way a model needs: exact admissible commands take the
fast path; otherwise case, repeated spaces and a trailing period are ignored,
and ``put O in/on R``, ``put O in R``, ``put O on R`` and ``move O to R`` all
mean the same thing. Anything else, including junk or huge strings, is
answered "Nothing happens." and uses up the step; an action that is not text
is too, and the answer adds that it must be text, naming its type
(``agentrl.envs._action``).

``put_style="move"`` lists and answers puts as alfworld >= 0.4 does
(``move O to R`` / "You move the O to the R.") instead of the ALFWorld paper's
``put O in/on R``.
"""

from __future__ import annotations

import copy
import hashlib
import re
from dataclasses import dataclass
from typing import Any

from agentrl.env import TextEnv
from agentrl.errors import EnvError

from .._action import not_text
from .._settings import flag, names, number, one_of, reset_options, whole
from .catalog import FAMILIES
from .expert import Notes, next_command
from .oracle import oracle_command
from .scene import SPLITS, Scene, generate_scene
from .world import World

__all__ = ["ALFWorldEnv", "expert_trajectory"]

_INTRO = "-= Welcome to TextWorld, ALFRED! =-\n\n{look}\n\nYour task is to: {goal}"
_NOTHING = "Nothing happens."
_MAX_PARSE = 400
_MOVE = re.compile(r"move (.+?) to (.+)")
_PUT = re.compile(r"put (.+?) (?:in/on|into|onto|in|on|to) (.+)")


@dataclass(slots=True)
class _Snapshot:
    world: World
    steps: int
    done: bool
    won: bool
    achieved: int
    last_obs: str
    notes: Notes
    invalid: bool = False


def _state_key(w: World) -> str:
    """A short hash of the true world state (scene, agent location and inventory,
    open receptacles, object places and states): equal keys mean the same state,
    whatever path led there. GiGPO groups steps by it (``agentrl.credit.gigpo``)."""
    scene = w.s.scene
    state = (scene.split, scene.seed, w.loc, w.held, w.opened, w.where, w.flags)
    return hashlib.blake2b(repr(state).encode(), digest_size=8).hexdigest()


def _canonical(text: str, style: str) -> str | None:
    """``text`` with put/move aliases rewritten to the env's put style, else None."""
    m = _MOVE.fullmatch(text) or _PUT.fullmatch(text)
    if m is None:
        return None
    o, r = m.groups()
    return f"move {o} to {r}" if style == "move" else f"put {o} in/on {r}"


class ALFWorldEnv(TextEnv):
    """ALFWorld-style household tasks; see the module docstring."""

    def __init__(
        self,
        split: str = "train",
        dense_reward: bool = False,
        subgoal_reward: float = 0.1,
        invalid_penalty: float = 0.0,
        max_steps: int = 50,
        put_style: str = "put",
        families: list[str] | tuple[str, ...] | None = None,
        max_receptacles: int | None = None,
        expert_search: str = "listed",
        render_mode: str | None = None,
    ):
        super().__init__(render_mode=render_mode)
        if split not in SPLITS:
            raise EnvError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
        self.split = split
        self.put_style = one_of("put_style", put_style, ("put", "move"))
        self.max_steps = whole("max_steps", max_steps, low=1)
        self.dense_reward = flag("dense_reward", dense_reward)
        self.subgoal_reward = number("subgoal_reward", subgoal_reward)
        self.invalid_penalty = number("invalid_penalty", invalid_penalty, low=0.0)  # it is subtracted
        self.families = names("families", families, FAMILIES) if families is not None else None
        self.max_receptacles = None if max_receptacles is None else whole("max_receptacles", max_receptacles, low=2)
        self.expert_search = one_of("expert_search", expert_search, ("listed", "prior"))
        generate_scene(0, split, self.families, self.max_receptacles)  # a bad option fails here, not at reset
        self._world: World | None = None
        self._notes = Notes(put_style=put_style, search=expert_search)
        self._steps = 0
        self._done = False
        self._won = False
        self._achieved = 0

    # -- properties --------------------------------------------------------------
    @property
    def scene(self) -> Scene:
        """The current scene (after ``reset``)."""
        return self._require().s.scene

    @property
    def world(self) -> World:
        """The current mutable world state (after ``reset``)."""
        return self._require()

    @property
    def instruction(self) -> str:
        return self.scene.task.goal

    def _require(self) -> World:
        if self._world is None:
            raise EnvError("call reset() before using the ALFWorld env")
        return self._world

    def _info(self) -> dict[str, Any]:
        w = self._require()
        task = w.s.scene.task
        return {
            "instruction": task.goal,
            "admissible_actions": [] if self._done else list(w.admissible()),
            "tools": [],
            "won": self._won,
            "task_type": task.family,
            "state_key": _state_key(w),
            "invalid_action": self._invalid,
        }

    # -- gymnasium API -----------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Start the task of ``seed``; ``options={"split": ...}`` overrides the split, and
        ``options={"scene": Scene}`` plays that scene instead of a generated one."""
        super().reset(seed=seed)
        options = reset_options(options, ("split", "scene"))
        split = options.get("split", self.split)
        if split not in SPLITS:
            raise EnvError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
        task_seed = int(seed) if seed is not None else int(self.np_random.integers(0, 2**31 - 1))
        scene = options.get("scene")
        if scene is not None and not isinstance(scene, Scene):
            raise EnvError(f"options['scene'] must be a Scene, not {type(scene).__name__}")
        if scene is None:
            scene = generate_scene(task_seed, split, self.families, self.max_receptacles)
        task_seed, split = scene.seed, scene.split
        self._world = World(scene, self.put_style)
        self._steps, self._done, self._won, self._invalid = 0, False, False, False
        self._achieved = self._world.subgoals() if self.dense_reward else 0
        goal = self._world.s.scene.task.goal
        self._last_obs = _INTRO.format(look=self._world.look(), goal=goal)
        self._notes = Notes(put_style=self.put_style, search=self.expert_search)
        self._notes.read(None, self._last_obs)
        info = self._info()
        if self._plan_in_info:  # for a distillation teacher only (train.distill.privileged)
            info["privileged"] = "The expert's plan: " + "; ".join(self._oracle_plan(scene))
        return self._last_obs, info

    _plan_in_info = True

    def _oracle_plan(self, scene: Scene) -> list[str]:
        return oracle_plan(scene, put_style=self.put_style, max_steps=self.max_steps)

    def step(self, action: str):
        w = self._require()
        if self._done:
            obs = "The episode is over. Call reset() to start a new one."
            return obs, 0.0, self._won, not self._won, self._info()
        self._steps += 1
        why = not_text(action)
        op = None if why else self._parse(w, action)
        obs = (f"{_NOTHING} {why}" if why else _NOTHING) if op is None else w.apply(op)
        self._invalid = op is None
        reward = 0.0
        if op is None:
            reward -= self.invalid_penalty
        else:
            if self.dense_reward:
                now = w.subgoals()
                new = now & ~self._achieved
                if new:
                    self._achieved |= now
                    reward += self.subgoal_reward * bin(new).count("1")
            if w.goal_met():
                self._won = self._done = True
                reward += 1.0
        truncated = not self._won and self._steps >= self.max_steps
        if truncated:
            self._done = True
        self._last_obs = obs
        self._notes.read("" if why else action, obs)
        return obs, reward, self._won, truncated, self._info()

    def _parse(self, w: World, action: str) -> tuple | None:
        """The op an action string means, or None ("Nothing happens.")."""
        op = w.lookup(action)
        if op is not None or len(action) > _MAX_PARSE:
            return op
        text = " ".join(action.lower().split()).strip("`'\"").rstrip(".!").strip()
        op = w.lookup(text)
        if op is None:
            alias = _canonical(text, self.put_style)
            op = w.lookup(alias) if alias else None
        return op

    # -- branching and expert ----------------------------------------------------
    def snapshot(self) -> _Snapshot:
        """The episode state (a copy of a few small lists; the scene is shared)."""
        w = self._require()
        return _Snapshot(
            w.copy(), self._steps, self._done, self._won, self._achieved, self._last_obs,
            copy.deepcopy(self._notes), self._invalid,
        )

    def restore(self, snapshot: _Snapshot) -> None:
        """Return to ``snapshot``; it stays reusable."""
        self._world = snapshot.world.copy()
        self._steps, self._done, self._won = snapshot.steps, snapshot.done, snapshot.won
        self._achieved, self._last_obs = snapshot.achieved, snapshot.last_obs
        self._notes = copy.deepcopy(snapshot.notes)
        self._invalid = snapshot.invalid

    def expert_action(self) -> str:
        """The observation-consistent expert's next command: it acts on what was seen (see ``expert``)."""
        self._require()
        return next_command(self._notes)

    def oracle_action(self) -> str:
        """The privileged oracle's next command: it reads the hidden state (see ``oracle``)."""
        return oracle_command(self._require())


def oracle_plan(scene: Scene, **kwargs: Any) -> list[str]:
    """The oracle's commands from the start of ``scene``, played on a separate env made with
    ``kwargs`` (``put_style``, ``max_steps``)."""
    env = ALFWorldEnv(split=scene.split, **kwargs)
    env._plan_in_info = False
    env.reset(options={"scene": scene})
    plan, done = [], False
    while not done:
        plan.append(env.oracle_action())
        _, _, terminated, truncated, _ = env.step(plan[-1])
        done = terminated or truncated
    return plan


def expert_trajectory(
    seed: int, split: str = "train", put_style: str = "put"
) -> list[tuple[str, str]]:
    """The expert's episode for ``(split, seed)`` as (observation, action) pairs, for SFT."""
    env = ALFWorldEnv(split=split, put_style=put_style)
    obs, _ = env.reset(seed=seed)
    pairs = []
    done = False
    while not done:
        action = env.expert_action()
        pairs.append((obs, action))
        obs, _, terminated, truncated, _ = env.step(action)
        done = terminated or truncated
    return pairs
