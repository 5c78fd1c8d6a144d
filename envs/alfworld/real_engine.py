"""Play our scenes in the real ALFWorld PDDL engine and cross-check our env against it.

Needs the optional extra ``alfworld`` (``pip install alfworld``; it compiles
fast-downward, about 2 min). No ALFWorld game data is needed: the engine is
textworld's ``PddlEnv`` with alfworld's bundled ``alfred.pddl`` domain and
``alfred.twl2`` grammar, wrapped in ``AlfredDemangler``/``AlfredInfos``, and
loaded with a problem written by ``pddl_export``. ``AlfredTWEnv`` is never
used: without game data it spins forever.

``cross_check(seed)`` plays one episode in both engines (a few random
admissible commands, then our expert to the end) and records, at every step,
whether the admissible commands, the feedback text (up to the order of listed
items) and the win flag agree. Our env runs with ``put_style="move"`` there,
since alfworld 0.4 says "move O to R" where the ALFWorld paper said
"put O in/on R". Differences that remain by design:

- ``help``: our text omits the slicing line (our scenes have no slicing).
- the order of items in "you see ..." lists: the real engine's follows its
  fact store, ours follows placement order; the check sorts both.
- ``look`` in the middle of the room: the real grammar binds the agent's start
  location, which holds no receptacle, and answers "... you see nothing."
  even though its own intro lists every receptacle; ours lists them again.
- after the winning step, ours lists no admissible commands (a step after the
  end changes nothing), while the real engine lists them as before; the check
  compares admissible commands only while the episode runs.

Each engine loads its own copy of fast-downward's library, so engines do not
share the planner's state; but fast-downward's PDDL translator rewrites
``sys.argv``, swaps ``sys.stdout`` and keeps its options in module globals. Every
call into an engine therefore goes through ``engine_call()``: one process-wide
lock, with ``sys.argv`` put back afterwards. ``make_engine`` builds the wrapped
engine that ``RealEngine`` and ``real_env.ALFWorldRealEnv`` (the real games) use.

Run ``python -m agentrl.envs.alfworld.real_engine --seeds 300`` for the full
cross-check (a table and a JSON file), or ``--time 200`` to time the engine.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from agentrl.errors import EnvError

from .env import ALFWorldEnv
from .pddl_export import scene_to_pddl
from .scene import SPLITS, Scene, generate_scene

__all__ = [
    "CrossCheck",
    "RealEngine",
    "available",
    "cross_check",
    "engine_call",
    "logic_files",
    "make_engine",
    "normalize_feedback",
    "run_real_episode",
    "time_real_engine",
]

_INSTALL = "the real ALFWorld engine needs the optional extra: pip install 'agentrl[alfworld]'"
_LIST = re.compile(r"you see (.*?)\.")


def available() -> bool:
    """Whether alfworld (with textworld's PDDL engine) can be imported here."""
    try:
        _modules()
    except EnvError:
        return False
    return True


@cache
def _modules() -> tuple[Any, Any, Any, Any]:
    try:
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
        from textworld.envs.pddl import PddlEnv
    except ImportError as e:  # the extra is missing or half-installed
        raise EnvError(f"{_INSTALL} ({e})") from e
    return textworld, PddlEnv, AlfredDemangler, AlfredInfos


@cache
def logic_files() -> tuple[str, str]:
    """alfworld's bundled ``alfred.pddl`` domain and ``alfred.twl2`` grammar, as text."""
    _modules()
    import alfworld

    data = Path(alfworld.__file__).parent / "data"
    return (data / "alfred.pddl").read_text(), (data / "alfred.twl2").read_text()


_ENGINE_LOCK = threading.RLock()


@contextmanager
def engine_call() -> Iterator[None]:
    """Hold the process-wide engine lock, and give ``sys.argv`` back afterwards
    (fast-downward's translator overwrites it); see the module docstring."""
    with _ENGINE_LOCK:
        argv = list(sys.argv)
        try:
            yield
        finally:
            sys.argv = argv


def make_engine(infos: Any) -> Any:
    """A fresh ``AlfredInfos(AlfredDemangler(PddlEnv(infos)))``, the real games' engine stack,
    with nothing loaded; ``infos`` is a ``textworld.EnvInfos``."""
    _, pddl_env, demangler, infos_wrapper = _modules()
    with engine_call():
        return infos_wrapper(demangler(pddl_env(infos)))


def normalize_feedback(text: str) -> str:
    """Feedback with the items of each "you see ..." list sorted, for comparison."""

    def _sort(m: re.Match) -> str:
        items = m.group(1).replace(", and ", ", ").split(", ")
        return "you see " + ", ".join(sorted(items)) + "."

    return _LIST.sub(_sort, text.strip())


class RealEngine:
    """One scene loaded in alfworld's PDDL engine."""

    def __init__(self, scene: Scene):
        textworld = _modules()[0]
        domain, grammar = logic_files()
        data = {
            "pddl_domain": domain,
            "grammar": grammar.replace("UNKNOWN GOAL.", scene.task.goal),
            "pddl_problem": scene_to_pddl(scene),
        }
        self._env = make_engine(textworld.EnvInfos(won=True, admissible_commands=True))
        try:
            with engine_call():
                self._env.load(data)
        except Exception as e:  # a bad problem file; map it to our error tree
            raise EnvError(f"the real engine rejected scene {scene.split}/{scene.seed}: {e}") from e

    def reset(self) -> tuple[str, list[str], bool]:
        """(feedback, admissible commands, won) at the start."""
        with engine_call():
            s = self._env.reset()
        return s.feedback, list(s["admissible_commands"]), bool(s["won"])

    def step(self, command: str) -> tuple[str, list[str], bool]:
        """(feedback, admissible commands, won) after ``command``."""
        with engine_call():
            s, _, _ = self._env.step(command)
        return s.feedback, list(s["admissible_commands"]), bool(s["won"])


@dataclass
class CrossCheck:
    """The outcome of playing one seed in both engines."""

    seed: int
    split: str
    family: str
    steps: int = 0
    won_ours: bool = False
    won_real: bool = False
    admissible_mismatches: list[dict] = field(default_factory=list)
    feedback_mismatches: list[dict] = field(default_factory=list)
    win_mismatches: list[int] = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        return not (self.admissible_mismatches or self.feedback_mismatches or self.win_mismatches)


def _known_difference(cmd: str, ours: str, real: str) -> bool:
    """The documented text differences (see the module docstring)."""
    if cmd == "help":
        return True
    middle = "You are in the middle of a room. Looking quickly around you, you see "
    return cmd == "look" and ours.startswith(middle) and real == middle + "nothing."


def _compare(report: CrossCheck, step: int, cmd: str, ours: tuple, real: tuple) -> None:
    (o_obs, o_adm, o_won), (r_obs, r_adm, r_won) = ours, real
    if not (o_won or r_won) and set(o_adm) != set(r_adm):  # a won episode: see the module docstring
        only_ours, only_real = sorted(set(o_adm) - set(r_adm)), sorted(set(r_adm) - set(o_adm))
        report.admissible_mismatches.append(
            {"step": step, "after": cmd, "only_ours": only_ours, "only_real": only_real}
        )
    if not _known_difference(cmd, o_obs, r_obs) and normalize_feedback(o_obs) != normalize_feedback(
        r_obs
    ):
        report.feedback_mismatches.append(
            {"step": step, "after": cmd, "ours": o_obs, "real": r_obs}
        )
    if o_won != r_won:
        report.win_mismatches.append(step)


def cross_check(seed: int, split: str = "train", random_prefix: int = 4) -> CrossCheck:
    """Play ``seed`` in our env and the real engine side by side; see the module docstring."""
    env = ALFWorldEnv(split=split, put_style="move")
    obs, info = env.reset(seed=seed)
    real = RealEngine(env.scene)
    report = CrossCheck(seed=seed, split=split, family=env.scene.task.family)
    _compare(report, 0, "", (obs, info["admissible_actions"], False), real.reset())
    rng = random.Random(seed)
    for step in range(1, env.max_steps + 1):
        adm = info["admissible_actions"]
        cmd = rng.choice(adm) if step <= random_prefix else env.expert_action()
        obs, _, terminated, truncated, info = env.step(cmd)
        r = real.step(cmd)
        _compare(report, step, cmd, (obs, info["admissible_actions"], info["won"]), r)
        report.steps, report.won_ours, report.won_real = step, info["won"], r[2]
        if terminated or truncated:
            break
    return report


def run_real_episode(seed: int, split: str = "train") -> dict[str, Any]:
    """Play our expert's plan for ``seed`` in the real engine: won, steps, seconds."""
    env = ALFWorldEnv(split=split, put_style="move")
    env.reset(seed=seed)
    t0 = time.perf_counter()
    real = RealEngine(env.scene)
    real.reset()
    load_s = time.perf_counter() - t0
    won, steps = False, 0
    while not won and steps < env.max_steps:
        cmd = env.expert_action()
        env.step(cmd)
        won = real.step(cmd)[2]
        steps += 1
    return {
        "seed": seed,
        "won": won,
        "steps": steps,
        "load_s": load_s,
        "seconds": time.perf_counter() - t0,
    }


def time_real_engine(n_steps: int = 200, seed: int = 0, split: str = "train") -> dict[str, float]:
    """Time the real PDDL engine with a random-admissible policy on our tasks.

    Returns ``steps``, ``steps_per_s``, ``step_p50_s`` and ``reset_s`` (load +
    reset, mean), comparable to the env-throughput bench's numbers for our env.
    """
    rng = random.Random(seed)
    step_times, reset_times = [], []
    task, used = seed, 0
    while used < n_steps:
        t0 = time.perf_counter()
        real = RealEngine(generate_scene(task, split))
        _, adm, won = real.reset()
        reset_times.append(time.perf_counter() - t0)
        for _ in range(50):
            if used >= n_steps or won:
                break
            t0 = time.perf_counter()
            _, adm, won = real.step(rng.choice(adm))
            step_times.append(time.perf_counter() - t0)
            used += 1
        task += 1
    total = sum(step_times)
    return {
        "steps": float(used),
        "steps_per_s": used / total if total else 0.0,
        "step_p50_s": statistics.median(step_times),
        "reset_s": statistics.fmean(reset_times),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Cross-check agentrl's ALFWorld env against alfworld.")
    p.add_argument("--seeds", type=int, default=300, help="seeds per split")
    p.add_argument("--splits", default=",".join(SPLITS), help="comma-separated splits")
    p.add_argument("--time", type=int, default=0, help="only time N real-engine steps")
    p.add_argument("--json", default="alfworld_crosscheck.json", help="where to write results")
    args = p.parse_args(argv)
    if args.time:
        print(json.dumps(time_real_engine(args.time), indent=2))
        return 0
    reports = []
    t0 = time.perf_counter()
    for split in args.splits.split(","):
        for seed in range(args.seeds):
            reports.append(cross_check(seed, split))
    by_family: dict[str, list[CrossCheck]] = {}
    for r in reports:
        by_family.setdefault(r.family, []).append(r)
    print(f"{'family':34} {'seeds':>6} {'won both':>9} {'adm diff':>9} {'text diff':>10}")
    for fam, rs in sorted(by_family.items()):
        won = sum(r.won_ours and r.won_real for r in rs)
        adm = sum(bool(r.admissible_mismatches) for r in rs)
        txt = sum(bool(r.feedback_mismatches) for r in rs)
        print(f"{fam:34} {len(rs):6d} {won:9d} {adm:9d} {txt:10d}")
    print(f"{len(reports)} episodes in {time.perf_counter() - t0:.1f} s")
    Path(args.json).write_text(json.dumps([asdict(r) for r in reports], indent=1))
    return 0 if all(r.agrees and r.won_real for r in reports) else 1


if __name__ == "__main__":
    raise SystemExit(main())
