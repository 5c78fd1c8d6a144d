"""Procedural household scenes and tasks for the ALFWorld-style env, from a seed.

``generate_scene(seed, split)`` returns a ``Scene``: numbered receptacles, typed
objects placed where ``catalog.CAN_CONTAIN`` allows, light sources, and one task
of the six ALFWorld families with its goal text.

Splits. A task's *combination* is (room type, object type, target receptacle
type), or (room type, object type, lamp type) for ``look_at_obj_in_light``. A
fixed hash puts about one combination in five into the unseen set:
``valid_unseen`` draws only unseen combinations, ``train`` and ``valid_seen``
draw only the others. ``train`` and ``valid_seen`` differ by seed namespace, so
their scenes differ but their combinations are shared. Everything is a pure
function of ``(split, seed)``: string-seeded ``random.Random`` hashes with
SHA-512, so results do not depend on ``PYTHONHASHSEED`` or the platform.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from functools import cache

from agentrl.errors import EnvError

from .catalog import (
    CAN_CONTAIN,
    CLEANABLE,
    COOLABLE,
    FAMILIES,
    FAMILY_ROOMS,
    HEATABLE,
    LAMP_HOLDERS,
    OPENABLE,
    ROOMS,
)

__all__ = [
    "GOAL_TEMPLATES",
    "SPLITS",
    "Scene",
    "Task",
    "combination_is_unseen",
    "generate_scene",
    "task_combinations",
]

SPLITS: tuple[str, ...] = ("train", "valid_seen", "valid_unseen")
_UNSEEN_PERCENT = 20
_APPLIANCE = {
    "pick_clean_then_place_in_recep": "sinkbasin",
    "pick_heat_then_place_in_recep": "microwave",
    "pick_cool_then_place_in_recep": "fridge",
}
_PROPERTY = {
    "pick_clean_then_place_in_recep": CLEANABLE,
    "pick_heat_then_place_in_recep": HEATABLE,
    "pick_cool_then_place_in_recep": COOLABLE,
}
GOAL_TEMPLATES: dict[str, tuple[str, str]] = {  # the goal sentences, ALFWorld's wording

    "pick_and_place_simple": ("put a {o} in {r}.", "put some {o} on {r}."),
    "look_at_obj_in_light": ("look at {o} under the {r}.", "examine the {o} with the {r}."),
    "pick_clean_then_place_in_recep": (
        "put a clean {o} in {r}.",
        "clean some {o} and put it in {r}.",
    ),
    "pick_heat_then_place_in_recep": ("put a hot {o} in {r}.", "heat some {o} and put it in {r}."),
    "pick_cool_then_place_in_recep": ("put a cool {o} in {r}.", "cool some {o} and put it in {r}."),
    "pick_two_obj_and_place": ("put two {o} in {r}.", "find two {o} and put them in {r}."),
}


@dataclass(frozen=True, slots=True)
class Task:
    """One goal. ``target`` is a receptacle type, or the lamp type for ``look_at_obj_in_light``."""

    family: str
    obj_type: str
    target: str
    goal: str


@dataclass(frozen=True, slots=True)
class Scene:
    """A generated room: static facts plus the initial placement of objects.

    Receptacle ``i`` is named ``recep_names[i]`` ("cabinet 3"); object ``j`` is
    ``obj_names[j]`` and starts inside receptacle ``obj_start[j]``. All
    receptacles start closed and all objects start plain (not clean/hot/cool).
    """

    seed: int
    split: str
    room: str
    recep_types: tuple[str, ...]
    recep_names: tuple[str, ...]
    obj_types: tuple[str, ...]
    obj_names: tuple[str, ...]
    obj_start: tuple[int, ...]
    task: Task

    def openable(self, r: int) -> bool:
        return self.recep_types[r] in OPENABLE


def _bucket(*parts: str) -> int:
    return zlib.crc32("|".join(parts).encode()) % 100


def combination_is_unseen(room: str, obj_type: str, target: str) -> bool:
    """Whether this (room, object, target) combination is reserved for ``valid_unseen``."""
    return _bucket(room, obj_type, target) < _UNSEEN_PERCENT


def _targets(family: str, room: str, obj_type: str) -> list[str]:
    spec = ROOMS[room]
    if family == "look_at_obj_in_light":
        return sorted(spec.lamps)
    skip = _APPLIANCE.get(family)
    return sorted(
        rt
        for rt, _, hi in spec.receptacles
        if hi > 0 and rt != skip and obj_type in CAN_CONTAIN[rt]
    )


@cache
def task_combinations(family: str, unseen: bool) -> tuple[tuple[str, str, str], ...]:
    """Every (room, object type, target) combination of ``family`` in the seen or unseen set."""
    out = []
    for room in FAMILY_ROOMS[family]:
        prop = _PROPERTY.get(family)
        for obj_type in sorted(ROOMS[room].objects):
            if prop is not None and obj_type not in prop:
                continue
            hosts = {t for t in _room_types(room) if obj_type in CAN_CONTAIN[t]}
            for target in _targets(family, room, obj_type):
                if not hosts - {target}:
                    continue  # it could only start where it must end
                if combination_is_unseen(room, obj_type, target) == unseen:
                    out.append((room, obj_type, target))
    return tuple(out)


def _furnish(rng: random.Random, room: str, must: set[str]) -> list[str]:
    """Receptacle types, one entry per instance, with every type in ``must`` present."""
    types: list[str] = []
    for rt, lo, hi in ROOMS[room].receptacles:
        n = rng.randint(lo, hi)
        if rt in must:
            n = max(n, 1)
        types.extend([rt] * n)
    return types


def _trim(rng: random.Random, types: list[str], must: set[str], cap: int) -> list[str]:
    """``types`` with random receptacles removed down to ``cap``, keeping one of each ``must`` type."""
    keep = {types.index(t) for t in must}
    spare = [i for i in range(len(types)) if i not in keep]
    rng.shuffle(spare)
    kept = keep | set(spare[: max(0, cap - len(keep))])
    return [t for i, t in enumerate(types) if i in kept]


def _number(types: list[str]) -> list[str]:
    counts: dict[str, int] = {}
    names = []
    for t in types:
        counts[t] = counts.get(t, 0) + 1
        names.append(f"{t} {counts[t]}")
    return names


def generate_scene(seed: int, split: str = "train", families: tuple[str, ...] | None = None,
                   max_receptacles: int | None = None) -> Scene:
    """The scene and task of ``seed`` in ``split``; the same inputs give the same scene.

    Easier levels for a curriculum: ``families`` draws the task from those
    families only; ``max_receptacles`` furnishes the room with at most that
    many receptacles (never fewer than the task needs). With both left at
    None, scenes are those of the full task.
    """
    if split not in SPLITS:
        raise EnvError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    pool = FAMILIES if families is None else tuple(families)
    if not pool or any(f not in FAMILIES for f in pool):
        raise EnvError(f"families must be a non-empty subset of {', '.join(FAMILIES)}; got {families!r}")
    if max_receptacles is not None and max_receptacles < 2:
        raise EnvError(f"max_receptacles must be >= 2, got {max_receptacles}")
    rng = random.Random(f"alfworld|{split}|{int(seed)}")
    family = pool[rng.randrange(len(pool))]
    room, obj_type, target = rng.choice(task_combinations(family, split == "valid_unseen"))
    spec = ROOMS[room]
    look = family == "look_at_obj_in_light"

    must = {target} if not look else {rng.choice(sorted(LAMP_HOLDERS & _room_types(room)))}
    if family in _APPLIANCE:
        must.add(_APPLIANCE[family])
    # Somewhere for the task object to start that is not already the target.
    starts = sorted(t for t in _room_types(room) if obj_type in CAN_CONTAIN[t] and t != target)
    if not starts:
        raise EnvError(f"catalog: {obj_type!r} has no start place in a {room} besides {target!r}")
    must.add(rng.choice(starts))
    types = _furnish(rng, room, must)
    if max_receptacles is not None:
        types = _trim(random.Random(f"alfworld-trim|{split}|{int(seed)}"), types, must, max_receptacles)
    rng.shuffle(types)  # the order in which "look" lists receptacles
    names = _number(types)

    # Objects: the task's type (two or more for pick_two), then distractor types.
    hosts = {o: [i for i, t in enumerate(types) if o in CAN_CONTAIN[t]] for o in spec.objects}
    pool = sorted(o for o in spec.objects if hosts[o] and o != obj_type)
    distractors = rng.sample(pool, min(len(pool), rng.randint(5, 10)))
    n_task = rng.randint(2, 4) if family == "pick_two_obj_and_place" else rng.randint(1, 3)
    placed: list[tuple[str, int]] = []
    banned = set() if look else {i for i, t in enumerate(types) if t == target}
    task_hosts = [i for i in hosts[obj_type] if i not in banned]
    if not task_hosts:  # cannot happen with the catalog; guard anyway
        raise EnvError(f"scene {split}/{seed}: no place for {obj_type!r} outside {target!r}")
    placed += [(obj_type, rng.choice(task_hosts)) for _ in range(n_task)]
    for o in distractors:
        placed += [(o, rng.choice(hosts[o])) for _ in range(rng.randint(1, 2))]
    lamp_hosts = [i for i, t in enumerate(types) if t in LAMP_HOLDERS]
    for lamp in spec.lamps:
        if lamp_hosts and (lamp == target or rng.random() < 0.5):
            placed.append((lamp, rng.choice(lamp_hosts)))
    rng.shuffle(placed)
    obj_types = [o for o, _ in placed]
    goal = rng.choice(GOAL_TEMPLATES[family]).format(o=obj_type, r=target)
    task = Task(family, obj_type, target, goal)
    return Scene(
        seed=int(seed),
        split=split,
        room=room,
        recep_types=tuple(types),
        recep_names=tuple(names),
        obj_types=tuple(obj_types),
        obj_names=tuple(_number(obj_types)),
        obj_start=tuple(r for _, r in placed),
        task=task,
    )


def _room_types(room: str) -> set[str]:
    return {rt for rt, _, hi in ROOMS[room].receptacles if hi > 0}
