"""Env throughput: how fast each registered env resets, steps, snapshots and restores.

For every env in ``agentrl.env.list_envs()`` (envs whose optional extras are
missing are skipped with a note) it measures, on one pinned core:

- ``reset`` time (p50, ms);
- ``step`` time (p50, us) and steps/s (steps divided by the time spent in ``step``);
- ``snapshot`` and ``restore`` time (p50, us), taken mid-episode.

Envs with admissible actions are walked by a random-admissible policy (a
uniform pick from ``info["admissible_actions"]``). Tool envs are walked by
scripted, valid tool calls (``_TOOL_CALLS``: ``TOOL_CALLS_PER_EPISODE`` calls,
then a final answer), so their steps really run the sandbox, the interpreter
and the search index; their rows count the calls made (``tool_calls``) and give
the p50 latency of a step holding one call, per tool (``tool_ms_p50``).
Sandboxed tool envs are measured again on each backend that can run here
(``local``, ``bwrap``): ``tool_call_latency[env][backend]``.

Then, where they can run:

- WebShop-style BM25 search: queries/s over goal queries on the default
  10,000-product catalog (target: >= 2,000/s);
- real TextWorld (``textworld.start`` stepped directly) against our
  ``agentrl/TextWorld-v0`` wrapper on the same games, with the ratio;
- the real ALFWorld PDDL engine
  (``agentrl.envs.alfworld.real_engine.time_real_engine``) against our
  ``agentrl/ALFWorld-v0``, with the ratio.

Step counts are keyword-only everywhere, so a renamed parameter fails loudly
instead of being dropped.

Prints a table and writes JSON next to this script (``--out`` to change).
``--quick`` is a smoke run of a few hundred steps.

    python bench/env_throughput.py [--quick] [--out PATH] [--envs ID ...]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one core: keep numpy/BLAS single-threaded

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

__all__ = ["main", "measure_env", "tool_call_latency"]

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


def _call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


# Valid, cheap calls per tool; a tool env's turn makes one of its tools' calls.
_TOOL_CALLS: dict[str, list[dict[str, Any]]] = {
    "python": [
        {"code": "total = sum(i * i for i in range(1000))"},
        {"code": "print(total % 97)"},
    ],
    "calculator": [{"expression": "(123 * 456 - 789) % 97"}],
    "search": [{"query": "born in river country", "k": 3}, {"query": "company founded", "k": 3}],
    "bash": [{"command": "python3 -m unittest discover tests 2>&1 | tail -1"}],
    "read_file": [{"path": "README.md"}],
    "write_file": [{"path": "notes.txt", "content": "checked the tests\n"}],
    "edit_file": [{"path": "notes.txt", "search": "checked", "replace": "ran"}],
}
TOOL_CALLS_PER_EPISODE = 4


def _tool_action(tools: list[str], turn: int) -> str:
    """The scripted action of ``turn`` (0-based) in a tool env's episode."""
    usable = [t for t in tools if t in _TOOL_CALLS]
    if turn >= TOOL_CALLS_PER_EPISODE or not usable:
        return "Answer: 0"
    # Walk the tools in order, so that write_file comes before edit_file.
    calls = [(t, args) for t in usable for args in _TOOL_CALLS[t]]
    name, args = calls[turn % len(calls)]
    return _call(name, **args)


def measure_env(
    env_id: str, *, n_steps: int, seed: int = 0, branch: bool = True, **env_kwargs: Any
) -> dict[str, Any]:
    """Reset/step/snapshot/restore timings of one env; see the module docstring for the policy.

    With ``branch`` the env is snapshotted and restored every fifth step; a restore
    restarts the ``python`` interpreter, so ``tool_call_latency`` turns it off.
    """
    from agentrl.env import make_env

    env = make_env(env_id, **env_kwargs)
    base = env.unwrapped
    rng = random.Random(seed)
    pool = _SEED_POOL.get(env_id)
    episode, turn = 0, 0

    def reset() -> dict[str, Any]:
        nonlocal episode, turn
        task_seed = episode % pool if pool else episode
        episode, turn = episode + 1, 0
        (_, info), took = _timed(env.reset, seed=task_seed)
        reset_times.append(took)
        return info

    reset_times: list[float] = []
    step_times: list[float] = []
    snap_times: list[float] = []
    restore_times: list[float] = []
    call_times: dict[str, list[float]] = {}
    failures = 0
    can_branch = branch and callable(getattr(base, "snapshot", None))
    info = reset()
    tools = [t["name"] for t in info.get("tools") or []]
    for i in range(n_steps):
        actions = info.get("admissible_actions") or []
        if tools:
            action = _tool_action(tools, turn)
        else:
            action = rng.choice(actions) if actions else env.action_space.sample()
        if can_branch and i % 5 == 2:
            snap, took = _timed(base.snapshot)
            snap_times.append(took)
            _, took = _timed(base.restore, snap)
            restore_times.append(took)
        (_, _, terminated, truncated, info), took = _timed(env.step, action)
        step_times.append(took)
        turn += 1
        for call in info.get("tool_calls") or []:
            call_times.setdefault(call["name"], []).append(took)
        failures += "error" in info
        if terminated or truncated:
            info = reset()
    env.close()
    row = {
        "episodes": len(reset_times),
        "steps": len(step_times),
        "reset_ms_p50": 1e3 * _p50(reset_times),
        "step_us_p50": 1e6 * _p50(step_times),
        "steps_per_s": len(step_times) / sum(step_times),
        "failed_steps": failures,
    }
    if can_branch:
        row["snapshot_us_p50"] = 1e6 * _p50(snap_times)
        row["restore_us_p50"] = 1e6 * _p50(restore_times)
    if tools:
        row["tool_calls"] = sum(len(v) for v in call_times.values())
        row["tool_ms_p50"] = {name: 1e3 * _p50(v) for name, v in sorted(call_times.items())}
    return row


def tool_call_latency(env_id: str, backend: str, *, n_steps: int) -> dict[str, Any]:
    """``measure_env`` for a sandboxed tool env on one sandbox backend, without branching:
    the first ``python`` call of an episode starts the interpreter, later ones reuse it."""
    return measure_env(env_id, n_steps=n_steps, branch=False, sandbox=backend)


def webshop_search(*, queries: int) -> dict[str, Any]:
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


def _random_walk(step, reset, admissible, *, n_steps: int, rng: random.Random) -> float:
    """Steps/s of ``step`` under a random-admissible policy (time inside ``step`` only)."""
    total, done_steps = 0.0, 0
    state = reset()
    while done_steps < n_steps:
        action = rng.choice(admissible(state))
        (state, done), took = _timed(step, action)
        total += took
        done_steps += 1
        if done:
            state = reset()
    return done_steps / total


def textworld_side_by_side(*, n_steps: int) -> dict[str, Any]:
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
        real_step,
        real.reset,
        lambda s: s["admissible_commands"],
        n_steps=n_steps,
        rng=random.Random(0),
    )
    real.close()
    ours = TextWorldEnv()

    def our_step(cmd):
        _, _, term, trunc, info = ours.step(cmd)
        return info, term or trunc

    def our_reset():
        return ours.reset(options={"game_file": paths[0]})[1]

    our_sps = _random_walk(
        our_step,
        our_reset,
        lambda i: i["admissible_actions"],
        n_steps=n_steps,
        rng=random.Random(0),
    )
    ours.close()
    return {"real_steps_per_s": real_sps, "ours_steps_per_s": our_sps, "ratio": our_sps / real_sps}


def alfworld_side_by_side(*, n_steps: int, ours: dict[str, Any] | None) -> dict[str, Any]:
    """The real ALFWorld engine's steps/s (``time_real_engine``) beside our env's."""
    from agentrl.envs.alfworld import real_engine

    result = dict(real_engine.time_real_engine(n_steps=n_steps))
    real_sps = float(result["steps_per_s"])
    out: dict[str, Any] = {"real": result, "real_steps_per_s": real_sps}
    if ours:
        out["ours_steps_per_s"] = ours["steps_per_s"]
        out["ratio"] = ours["steps_per_s"] / real_sps
    return out


def _table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for h in headers:
            table.add_column(h, justify="left" if h in ("env", "backend") else "right")
        for row in rows:
            table.add_row(*row)
        Console(width=120).print(table)
    except ImportError:
        print(title)
        print(" | ".join(headers))
        for row in rows:
            print(" | ".join(row))


def _tool_ms(row: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in row.get("tool_ms_p50", {}).items()) or "-"


def _print_tables(result: dict[str, Any]) -> None:
    envs, latency = result["envs"], result.get("tool_call_latency", {})
    headers = ["env", "reset ms", "step us p50", "steps/s", "snapshot us", "restore us", "calls"]
    rows = [
        [
            env_id,
            f"{r['reset_ms_p50']:.2f}",
            f"{r['step_us_p50']:.1f}",
            f"{r['steps_per_s']:,.0f}",
            f"{r['snapshot_us_p50']:.1f}",
            f"{r['restore_us_p50']:.1f}",
            str(r.get("tool_calls", "-")),
        ]
        for env_id, r in envs.items()
    ]
    _table("env throughput (one core; random-admissible or scripted tool calls)", headers, rows)
    rows = [
        [env_id, backend, str(r["tool_calls"]), _tool_ms(r), f"{r['reset_ms_p50']:.1f}"]
        for env_id, per in latency.items()
        for backend, r in per.items()
    ]
    if rows:
        headers = ["env", "backend", "calls", "ms per call p50, by tool", "reset ms"]
        _table("tool-call latency per sandbox backend", headers, rows)
    skip = {"quick", "machine", "envs", "tool_call_latency", "notes"}
    for name, value in result.items():
        if name not in skip:
            print(f"{name}: {json.dumps(value, default=float)}")
    for note in result["notes"]:
        print(f"note: {note}")


def _pin_one_core() -> str:
    try:
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return f"pinned to cpu {cpu}"
    except (AttributeError, OSError) as exc:
        return f"not pinned ({exc})"


_SANDBOXED = ("agentrl/MathPython-v0", "agentrl/BashFix-v0")
_BACKENDS = ("local", "bwrap")


def _latency_per_backend(
    env_ids: list[str], steps: int, notes: list[str]
) -> dict[str, dict[str, Any]]:
    """``tool_call_latency`` of each sandboxed tool env on each backend that runs here."""
    from agentrl.errors import SandboxUnavailableError
    from agentrl.sandboxes import check_backend

    out: dict[str, dict[str, Any]] = {}
    for backend in _BACKENDS:
        try:
            check_backend(backend)
        except SandboxUnavailableError as exc:
            notes.append(f"tool-call latency on {backend} skipped: {exc}")
            continue
        for env_id in env_ids:
            n = max(20, steps // _SLOW_ENVS[env_id])
            out.setdefault(env_id, {})[backend] = tool_call_latency(env_id, backend, n_steps=n)
    return out


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
            envs[env_id] = measure_env(env_id, n_steps=n)
        except (EnvError, ImportError) as exc:
            notes.append(f"{env_id} skipped: {exc}")
    latency = _latency_per_backend([e for e in envs if e in _SANDBOXED], steps, notes)
    if not args.envs or "agentrl/WebShop-v0" in args.envs:
        extras["webshop_search"] = webshop_search(queries=200 if args.quick else 5_000)
    if "agentrl/TextWorld-v0" in envs:
        extras["textworld_real_vs_ours"] = textworld_side_by_side(n_steps=max(50, steps // 10))
    elif not args.envs or "agentrl/TextWorld-v0" in args.envs:
        notes.append("real TextWorld comparison skipped: textworld is not installed")
    if not args.envs or "agentrl/ALFWorld-v0" in args.envs:
        try:
            extras["alfworld_real_vs_ours"] = alfworld_side_by_side(
                n_steps=max(20, steps // 100), ours=envs.get("agentrl/ALFWorld-v0")
            )
        except ImportError as exc:  # a missing extra: a note, not a crash
            notes.append(f"real ALFWorld comparison skipped: {exc}")
    result = {
        "quick": args.quick,
        "machine": {"python": platform.python_version(), "cpu": platform.processor(), "cores": pin},
        "envs": envs,
        "tool_call_latency": latency,
        **extras,
        "notes": notes,
    }
    _print_tables(result)
    args.out.write_text(json.dumps(result, indent=2, default=float) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
