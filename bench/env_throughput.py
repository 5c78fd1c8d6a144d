"""Env throughput: how fast each registered env resets, steps, snapshots and restores.

For every env in ``agentrl.env.list_envs()`` (envs whose optional extras are
missing are skipped with a note) it measures, on one pinned core, with a
random-admissible policy (a uniform pick from ``info["admissible_actions"]``):

- ``reset`` time (p50, ms);
- ``step`` time (p50, us) and steps/s (steps divided by the time spent in ``step``);
- ``snapshot`` and ``restore`` time (p50, us), taken mid-episode.

Then, where they can run:

- WebShop-style BM25 search: queries/s over goal queries on the default
  10,000-product catalog (target: >= 2,000/s);
- real TextWorld (``textworld.start`` stepped directly) against our
  ``agentrl/TextWorld-v0`` wrapper on the same games, with the ratio;
- the real ALFWorld PDDL engine, through
  ``agentrl.envs.alfworld.real_engine`` when that module is importable,
  against our ``agentrl/ALFWorld-v0``, with the ratio.

The ALFWorld timer is looked up in ``real_engine`` under one of the names in
``_ALFWORLD_TIMERS`` and called as ``fn(steps=N)`` (or ``fn()``). It returns
a dict; a key containing ``per_s`` (steps/s), or else a key ending in
``_ms`` that names a step time, is read as the real engine's speed.

Prints a table and writes JSON next to this script (``--out`` to change).
``--quick`` is a smoke run of a few hundred steps.

    python bench/env_throughput.py [--quick] [--out PATH] [--envs ID ...]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one core: keep numpy/BLAS single-threaded

import argparse  # noqa: E402
import importlib  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

__all__ = ["main", "measure_env"]

HERE = Path(__file__).resolve().parent
# Few distinct seeds for envs whose tasks are expensive to build (TextWorld
# compiles a game per seed, then caches it).
_SEED_POOL = {"agentrl/TextWorld-v0": 3}


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _timed(fn, *args, **kwargs) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


# Envs whose steps run a real engine or sandbox get fewer steps (divisor of --steps).
_SLOW_ENVS = {
    "agentrl/TextWorld-v0": 10,
    "agentrl/MathPython-v0": 100,
    "agentrl/SearchQA-v0": 100,
    "agentrl/BashFix-v0": 1000,
}


def measure_env(env_id: str, steps: int, seed: int = 0) -> dict[str, Any]:
    """Reset/step/snapshot/restore timings of one env under a random-admissible policy."""
    from agentrl.env import make_env

    env = make_env(env_id)
    base = env.unwrapped
    rng = random.Random(seed)
    pool = _SEED_POOL.get(env_id)
    episode = 0

    def reset() -> dict[str, Any]:
        nonlocal episode
        task_seed = episode % pool if pool else episode
        episode += 1
        (_, info), took = _timed(env.reset, seed=task_seed)
        reset_times.append(took)
        return info

    reset_times: list[float] = []
    step_times: list[float] = []
    snap_times: list[float] = []
    restore_times: list[float] = []
    can_branch = callable(getattr(base, "snapshot", None))
    info = reset()
    for i in range(steps):
        actions = info.get("admissible_actions") or []
        action = rng.choice(actions) if actions else env.action_space.sample()
        if can_branch and i % 5 == 2:
            snap, took = _timed(base.snapshot)
            snap_times.append(took)
            _, took = _timed(base.restore, snap)
            restore_times.append(took)
        (_, _, terminated, truncated, info), took = _timed(env.step, action)
        step_times.append(took)
        if terminated or truncated:
            info = reset()
    env.close()
    return {
        "episodes": len(reset_times),
        "steps": len(step_times),
        "reset_ms_p50": 1e3 * _p50(reset_times),
        "step_us_p50": 1e6 * _p50(step_times),
        "steps_per_s": len(step_times) / sum(step_times),
        "snapshot_us_p50": 1e6 * _p50(snap_times),
        "restore_us_p50": 1e6 * _p50(restore_times),
    }


def webshop_search(queries: int) -> dict[str, Any]:
    """BM25 queries/s over goal-derived queries on the default catalog."""
    from agentrl.envs.webshop import build_catalog, get_catalog, make_goal

    _, build_s = _timed(build_catalog, 0, 10_000)  # uncached, to time the build
    catalog = get_catalog(0, 10_000)
    rng = random.Random(0)
    texts = [make_goal(catalog, rng).query for _ in range(queries)]
    _, took = _timed(lambda: [catalog.search(q) for q in texts])
    return {
        "products": len(catalog),
        "catalog_build_s": build_s,
        "queries": queries,
        "queries_per_s": queries / took,
    }


def _random_walk(step, reset, admissible, steps: int, rng: random.Random) -> float:
    """Steps/s of ``step`` under a random-admissible policy (time inside ``step`` only)."""
    total, done_steps = 0.0, 0
    state = reset()
    while done_steps < steps:
        action = rng.choice(admissible(state))
        (state, done), took = _timed(step, action)
        total += took
        done_steps += 1
        if done:
            state = reset()
    return done_steps / total


def textworld_side_by_side(steps: int) -> dict[str, Any]:
    """Real TextWorld stepped directly vs our wrapper, on the same generated games."""
    import textworld

    from agentrl.envs.textworld import GameSpec, TextWorldEnv, game_file

    paths = [str(game_file(GameSpec(), s)) for s in range(_SEED_POOL["agentrl/TextWorld-v0"])]
    infos = textworld.EnvInfos(admissible_commands=True, policy_commands=True, objective=True)
    infos.score = infos.max_score = infos.won = infos.lost = True
    real = textworld.start(paths[0], request_infos=infos)

    def real_step(cmd):
        state, _, done = real.step(cmd)
        return state, done

    real_sps = _random_walk(
        real_step, real.reset, lambda s: s["admissible_commands"], steps, random.Random(0)
    )
    real.close()
    ours = TextWorldEnv()

    def our_step(cmd):
        _, _, term, trunc, info = ours.step(cmd)
        return info, term or trunc

    def our_reset():
        return ours.reset(options={"game_file": paths[0]})[1]

    our_sps = _random_walk(
        our_step, our_reset, lambda i: i["admissible_actions"], steps, random.Random(0)
    )
    ours.close()
    return {"real_steps_per_s": real_sps, "ours_steps_per_s": our_sps, "ratio": our_sps / real_sps}


_ALFWORLD_TIMERS = ("time_real_engine", "benchmark_real_engine", "real_engine_timing", "benchmark")


def alfworld_side_by_side(steps: int, ours: dict[str, Any] | None) -> dict[str, Any]:
    """Call the ALFWorld helper's real-engine timer and set it beside our env's steps/s."""
    module = importlib.import_module("agentrl.envs.alfworld.real_engine")
    timer = next((getattr(module, n) for n in _ALFWORLD_TIMERS if hasattr(module, n)), None)
    if timer is None:
        raise RuntimeError(f"real_engine has none of {_ALFWORLD_TIMERS}")
    params = inspect.signature(timer).parameters
    result = timer(steps=steps) if "steps" in params else timer()
    result = dict(result) if isinstance(result, dict) else {"value": result}
    real_sps = next((float(v) for k, v in result.items() if "per_s" in k), None)
    if real_sps is None:
        ms = next((float(v) for k, v in result.items() if k.endswith("_ms") and "step" in k), None)
        real_sps = 1e3 / ms if ms else None
    out: dict[str, Any] = {"real": result, "real_steps_per_s": real_sps}
    if ours and real_sps:
        out["ours_steps_per_s"] = ours["steps_per_s"]
        out["ratio"] = ours["steps_per_s"] / real_sps
    return out


def _print_table(envs: dict[str, dict[str, Any]], extras: dict[str, Any], notes: list[str]) -> None:
    headers = ["env", "reset ms", "step us p50", "steps/s", "snapshot us", "restore us"]
    rows = [
        [
            env_id,
            f"{r['reset_ms_p50']:.2f}",
            f"{r['step_us_p50']:.1f}",
            f"{r['steps_per_s']:,.0f}",
            f"{r['snapshot_us_p50']:.1f}",
            f"{r['restore_us_p50']:.1f}",
        ]
        for env_id, r in envs.items()
    ]
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="env throughput (one core, random-admissible policy)")
        for h in headers:
            table.add_column(h, justify="left" if h == "env" else "right")
        for row in rows:
            table.add_row(*row)
        Console(width=110).print(table)
    except ImportError:
        print(" | ".join(headers))
        for row in rows:
            print(" | ".join(row))
    for name, value in extras.items():
        print(f"{name}: {json.dumps(value, default=float)}")
    for note in notes:
        print(f"note: {note}")


def _pin_one_core() -> str:
    try:
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return f"pinned to cpu {cpu}"
    except (AttributeError, OSError) as exc:
        return f"not pinned ({exc})"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: few steps")
    parser.add_argument("--out", type=Path, default=HERE / "env_throughput.json")
    parser.add_argument("--envs", nargs="*", help="only these env ids (default: all)")
    args = parser.parse_args(argv)
    from agentrl.env import list_envs
    from agentrl.errors import EnvError

    steps = 300 if args.quick else 20_000
    pin = _pin_one_core()
    env_ids = [e for e in list_envs() if not args.envs or e in args.envs]
    envs: dict[str, dict[str, Any]] = {}
    extras: dict[str, Any] = {}
    notes: list[str] = []
    for env_id in env_ids:
        n = max(20, steps // _SLOW_ENVS.get(env_id, 1))
        try:
            envs[env_id] = measure_env(env_id, n)
        except (EnvError, ImportError) as exc:
            notes.append(f"{env_id} skipped: {exc}")
    if not args.envs or "agentrl/WebShop-v0" in args.envs:
        extras["webshop_search"] = webshop_search(200 if args.quick else 5_000)
    if "agentrl/TextWorld-v0" in envs:
        extras["textworld_real_vs_ours"] = textworld_side_by_side(max(50, steps // 10))
    elif not args.envs or "agentrl/TextWorld-v0" in args.envs:
        notes.append("real TextWorld comparison skipped: textworld is not installed")
    if not args.envs or "agentrl/ALFWorld-v0" in args.envs:
        try:
            ours = envs.get("agentrl/ALFWorld-v0")
            extras["alfworld_real_vs_ours"] = alfworld_side_by_side(max(20, steps // 100), ours)
        except Exception as exc:  # a missing extra or helper: a note, not a crash
            notes.append(f"real ALFWorld comparison skipped: {type(exc).__name__}: {exc}")
    result = {
        "quick": args.quick,
        "machine": {"python": platform.python_version(), "cpu": platform.processor(), "cores": pin},
        "envs": envs,
        **extras,
        "notes": notes,
    }
    _print_table(envs, extras, notes)
    args.out.write_text(json.dumps(result, indent=2, default=float) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
