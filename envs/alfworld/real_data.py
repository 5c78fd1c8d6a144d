"""The real ALFWorld games on disk: where they are, which ones a split holds, and
writing our own scenes in the same layout.

ALFWorld's layout (what ``alfworld-download`` unpacks into ``$ALFWORLD_DATA``,
``~/.cache/alfworld`` by default)::

    $ALFWORLD_DATA/json_2.1.1/
        train/ valid_seen/ valid_unseen/
            <task dir>/                      e.g. pick_and_place_simple-Mug-None-CoffeeMachine-5
                <trial>/                     e.g. trial_T20190909_124852_071149
                    game.tw-pddl             JSON: pddl_domain, grammar (the task filled in),
                                             pddl_problem, solvable, walkthrough
                    traj_data.json           ALFRED's task record: task_type, pddl_params, ...
                    initial_state.pddl       the problem alone (from json_2.1.1_pddl.zip)

A split holds every trial folder with a ``traj_data.json`` whose path names
neither movable receptacles nor sliced objects, whose task family is one of
the six, and whose ``game.tw-pddl`` exists and is marked ``solvable``: the
filter of ALFWorld's own ``AlfredTWEnv.collect_game_files``. With the
published data that gives 3,553 train, 140 ``valid_seen`` and 134
``valid_unseen`` games. Games are sorted by path, so game ``i`` of a split is
the same on every machine (ALFWorld itself walks the folders in file-system
order).

The task family is the task dir's name up to its first ``-``, as the papers
count it (verl-agent, GiGPO: ``pick_and_place``, ``look_at_obj_in_light``, ...).
``FAMILY_LABELS`` are the column names of their tables.

``export_games(scenes, root)`` writes our procedural scenes (``scene``) in this
layout, with problems from ``pddl_export`` and alfworld's bundled domain and
grammar, so that the real-games env and its tests run offline.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from agentrl.errors import EnvError

from .pddl_export import scene_to_pddl
from .scene import Scene

__all__ = [
    "DATA_FOLDER",
    "FAMILIES",
    "FAMILY_LABELS",
    "SPLITS",
    "RealGame",
    "data_root",
    "export_games",
    "family_of",
    "list_games",
    "missing_data_message",
]

DATA_FOLDER = "json_2.1.1"
SPLITS: tuple[str, ...] = ("train", "valid_seen", "valid_unseen")
# ALFWorld's config names for the two evaluation splits.
SPLIT_ALIASES = {"eval_in_distribution": "valid_seen", "eval_out_of_distribution": "valid_unseen"}
FAMILIES: tuple[str, ...] = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
FAMILY_LABELS: dict[str, str] = dict(zip(FAMILIES, ("Pick", "Look", "Clean", "Heat", "Cool", "Pick2"), strict=True))


@dataclass(frozen=True, slots=True)
class RealGame:
    """One game of a split: its ``game.tw-pddl`` file and what its path says."""

    path: Path
    split: str
    family: str
    task_dir: str
    trial: str

    @property
    def name(self) -> str:
        """``<split>/<task dir>/<trial>``: the game's id in reports."""
        return f"{self.split}/{self.task_dir}/{self.trial}"


def family_of(task_dir: str) -> str | None:
    """The task family a task dir's name starts with, or None when it names none of the six."""
    family = task_dir.split("-", 1)[0]
    return family if family in FAMILIES else None


def missing_data_message(root: Path, split: str, why: str) -> str:
    """The error text for missing or unusable data: the layout expected and how to get it."""
    return (
        f"no ALFWorld games for split {split!r} under {root}: {why}. The real games live in "
        f"ALFWorld's layout, <data>/{DATA_FOLDER}/{{train,valid_seen,valid_unseen}}/<task dir>/<trial>/"
        "{game.tw-pddl, traj_data.json}. Get them with ALFWorld's own tools: "
        "pip install 'agentrl[alfworld]', then `alfworld-download` (writes to $ALFWORLD_DATA, "
        "default ~/.cache/alfworld; `alfworld-generate` rebuilds game.tw-pddl files). Then point "
        "the env at the folder: ALFWORLD_DATA=<data> or data_dir=<data>. agentrl never downloads it."
    )


def data_root(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder holding ``train/``, ``valid_seen/``, ``valid_unseen/``.

    ``data_dir`` (else ``$ALFWORLD_DATA``, else ``~/.cache/alfworld``, as
    alfworld itself) may name the data folder or its ``json_2.1.1`` child.
    """
    raw = data_dir if data_dir is not None else os.environ.get("ALFWORLD_DATA") or "~/.cache/alfworld"
    root = Path(raw).expanduser()
    if (root / DATA_FOLDER).is_dir():
        return root / DATA_FOLDER
    return root


def list_games(root: Path, split: str) -> tuple[RealGame, ...]:
    """The games of ``split`` under ``root`` (see ``data_root``), sorted by path.

    Raises ``EnvError`` naming the expected layout when there are none.
    """
    split = SPLIT_ALIASES.get(split, split)
    if split not in SPLITS:
        raise EnvError(f"unknown ALFWorld split {split!r}; use one of {', '.join(SPLITS)}")
    folder = root / split
    if not folder.is_dir():
        raise EnvError(missing_data_message(root, split, f"{folder} is not a folder"))
    games = _scan(folder.resolve(), split)
    if not games:
        raise EnvError(missing_data_message(root, split, f"{folder} holds no solvable game"))
    return games


_SCANNED: dict[tuple[Path, str], tuple[RealGame, ...]] = {}


def _scan(folder: Path, split: str) -> tuple[RealGame, ...]:
    """The games of ``folder``, read once per process. A folder found without games is read
    again next time: kept, it hid the games a download brought later until a restart."""
    games = _SCANNED.get((folder, split))
    if games is None:
        games = _read_games(folder, split)
        if games:
            _SCANNED[(folder, split)] = games
    return games


def _read_games(folder: Path, split: str) -> tuple[RealGame, ...]:
    out = []
    for trial_dir in sorted(p.parent for p in folder.glob("*/*/traj_data.json")):
        if "movable" in str(trial_dir) or "Sliced" in str(trial_dir):
            continue  # ALFWorld skips them: movable receptacles and slicing are not supported
        family = family_of(trial_dir.parent.name)
        game = trial_dir / "game.tw-pddl"
        if family is None or not game.is_file():
            continue
        try:
            solvable = json.loads(game.read_text()).get("solvable")
        except (OSError, ValueError):
            continue
        if solvable:
            out.append(RealGame(game, split, family, trial_dir.parent.name, trial_dir.name))
    return tuple(out)


# -- our scenes in ALFWorld's layout ---------------------------------------------------


@cache
def _alfred_names() -> dict[str, str]:
    """lower-case type -> ALFRED's class name ("coffeemachine" -> "CoffeeMachine")."""
    from alfworld.gen import constants

    return {name.lower(): name for name in constants.OBJECTS}


def _traj_data(scene: Scene) -> dict:
    """The part of ALFRED's ``traj_data.json`` that ALFWorld reads, for ``scene``."""
    names = _alfred_names()
    task = scene.task
    look = task.family == "look_at_obj_in_light"
    return {
        "task_type": task.family,
        "task_id": f"agentrl_{scene.split}_{scene.seed}",
        "pddl_params": {
            "object_target": names[task.obj_type],
            "parent_target": "" if look else names[task.target],
            "toggle_target": names[task.target] if look else "",
            "mrecep_target": "",
            "object_sliced": False,
        },
        "scene": {"scene_num": scene.seed, "room": scene.room},
        "turk_annotations": {"anns": [{"task_desc": task.goal, "high_descs": [], "votes": []}]},
        "agentrl": {"generator": "agentrl.envs.alfworld.scene", "split": scene.split, "seed": scene.seed},
    }


def _walkthrough(scene: Scene) -> list[str]:
    """Our oracle's commands for ``scene`` in alfworld's wording (the cross-check shows they win)."""
    from .env import oracle_plan

    return oracle_plan(scene, put_style="move")


def export_games(scenes: Iterable[Scene], root: str | os.PathLike[str]) -> list[Path]:
    """Write ``scenes`` as ALFWorld games under ``root/json_2.1.1/<split>/`` and return
    the ``game.tw-pddl`` paths. Needs the ``alfworld`` extra (its domain and grammar)."""
    from .real_engine import logic_files

    domain, grammar = logic_files()
    names = _alfred_names()
    out = []
    for scene in scenes:
        task = scene.task
        look = task.family == "look_at_obj_in_light"
        parent = "None" if look else names[task.target]
        toggle = names[task.target] if look else "None"
        # ALFRED names a task dir <family>-<object>-<movable receptacle>-<parent>-<scene>
        # (look_at_obj_in_light: <family>-<object>-None-<lamp>-<scene>).
        task_dir = f"{task.family}-{names[task.obj_type]}-None-{toggle if look else parent}-{scene.seed}"
        trial = Path(root) / DATA_FOLDER / scene.split / task_dir / f"trial_T00000000_000000_{scene.seed:06d}"
        trial.mkdir(parents=True, exist_ok=True)
        problem = scene_to_pddl(scene)
        game = {
            "pddl_domain": domain,
            "grammar": grammar.replace("UNKNOWN GOAL.", task.goal),
            "pddl_problem": problem,
            "solvable": True,
            "walkthrough": _walkthrough(scene),
        }
        (trial / "game.tw-pddl").write_text(json.dumps(game))
        (trial / "traj_data.json").write_text(json.dumps(_traj_data(scene), indent=1))
        (trial / "initial_state.pddl").write_text(problem)
        out.append(trial / "game.tw-pddl")
    _SCANNED.clear()
    return out
