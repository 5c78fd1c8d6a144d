"""Env workers on Ray: episodes/s of an env-bound batch, in one process and on 1 and 2 workers.

1. ``bashfix``: ``agentrl/BashFix-v0`` on the ``local`` sandbox with the
   ``mock`` policy (instant): each episode makes ``--bash-calls`` ``bash`` calls
   that run the repository's unit tests (a Python subprocess each, about
   0.1 s of CPU), then answers. The batch (``--episodes``) runs with
   ``rollout.env_executor: thread`` (in-process), then ``ray`` with 1 and 2 env
   workers: episodes/s, and the speed-up from 1 to 2 workers.
2. ``micro``: ``agentrl/ALFWorld-v0`` (a step takes microseconds) with scripted
   commands, the same three ways: the Ray overhead per env step is the extra
   wall time of 1 Ray worker over in-process, divided by the steps; and the
   round trip of one synchronous ``RayEnv.step`` against ``env.step`` in this
   process (p50).

Each row is timed after a warm batch (imports, actor start, first sandboxes);
the actors' start is reported as ``start_s``. Ray runs locally with this
machine's CPUs, or on the cluster ``--ray`` names (the machine fields then
describe the driver only). Env workers reserve ``--worker-cpus`` logical CPUs
each and are killed after their row, so the next row's fit (a worker that does
not fit stays pending, and its episodes wait for it). Scaling past the cores is not possible: on a
2-core machine 2 workers can at best double one, and less when the cores are
busy with other work (the load average is in the JSON).

Prints a table and writes ``scale.json``.

    python bench/scale.py [--episodes 32] [--bash-calls 3] [--ray HOST:PORT] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from agentrl.config import load_config
from agentrl.env import make_env
from agentrl.models import load_tokenizer
from agentrl.policy import MockPolicy
from agentrl.rollout import collect

BASHFIX, MICRO = "agentrl/BashFix-v0", "agentrl/ALFWorld-v0"
COMMANDS = ["look", "inventory", "go to countertop 1", "open drawer 1", "go to cabinet 2",
            "take apple 1 from countertop 1", "examine sidetable 1"]
BASH = ('<tool_call>{"name": "bash", "arguments": {"command": '
        '"python3 -m unittest discover tests 2>&1 | tail -1"}}</tool_call>')
# (name, env_executor, env workers); None: in-process
SETUPS = [("thread", "thread", None), ("ray-1", "ray", 1), ("ray-2", "ray", 2)]


def _cfg(args: argparse.Namespace, env_id: str, executor: str, workers: int | None, turns: int) -> Any:
    over = [f"env.id={env_id}", f"rollout.max_turns={turns}", "rollout.max_context_tokens=8192",
            "rollout.concurrency=64", f"rollout.env_executor={executor}", "rollout.deterministic=true",
            "sampling.max_new_tokens=256"]
    if env_id == BASHFIX:
        over.append("env.kwargs={sandbox: local}")
    if workers is not None:
        over += ["distributed.ray=auto", f"distributed.num_env_workers={workers}",
                 f"distributed.env_worker_cpus={args.worker_cpus}"]
    return load_config(overrides=over)


def _policy(tok: Any, env_id: str, args: argparse.Namespace) -> MockPolicy:
    if env_id == BASHFIX:  # bash_calls test runs, then a final answer (no tool call)
        return MockPolicy(tok, [BASH] * args.bash_calls + ["Done."], deterministic=True)
    return MockPolicy(tok, COMMANDS, deterministic=True)


def _row(args: argparse.Namespace, tok: Any, workload: str, env_id: str, setup: tuple[str, str, int | None],
         turns: int) -> dict[str, Any]:
    name, executor, workers = setup
    cfg = _cfg(args, env_id, executor, workers, turns)
    t0 = time.perf_counter()
    collect(env_id, _policy(tok, env_id, args), cfg, list(range(1000, 1000 + min(4, args.episodes))))  # warm
    start = time.perf_counter() - t0
    t0 = time.perf_counter()
    trees = collect(env_id, _policy(tok, env_id, args), cfg, list(range(args.episodes)))
    wall = time.perf_counter() - t0
    if workers is not None:
        _drop_workers(cfg)
    nodes = [n for t in trees for n in t.nodes.values()]
    steps = sum(1 for n in nodes if n.action_ids)
    return {"workload": workload, "env": env_id, "setup": name, "env_executor": executor,
            "env_workers": workers, "episodes": len(trees), "failed_episodes": sum(1 for n in nodes if n.error),
            "env_steps": steps, "wall_s": round(wall, 3), "episodes_per_s": round(len(trees) / wall, 2),
            "steps_per_s": round(steps / wall, 1), "start_s": round(start, 2)}


def _drop_workers(cfg: Any) -> None:
    """Kill the row's env workers, so that the next row's fit in the CPUs (a worker that
    does not fit stays pending, and its episodes wait for it)."""
    from agentrl.distributed import env_worker_pool, env_workers

    env_worker_pool(cfg).shutdown()
    env_workers._POOLS.clear()


def _step_us_p50(env: Any, n: int) -> float:
    """p50 of one synchronous ``env.step`` (ALFWorld, a cycle of the scripted commands)."""
    env.reset(seed=0)
    took = []
    for i in range(n):
        t0 = time.perf_counter()
        _, _, term, trunc, _ = env.step(COMMANDS[i % len(COMMANDS)])
        took.append(time.perf_counter() - t0)
        if term or trunc:
            env.reset(seed=i)
    return 1e6 * statistics.median(took)


def round_trip(args: argparse.Namespace) -> dict[str, float]:
    """One ``RayEnv.step`` (sync, 1 worker) against ``env.step`` in this process, p50 in us."""
    from agentrl.distributed import env_worker_pool

    local = make_env(MICRO)
    cfg = _cfg(args, MICRO, "ray", 1, 8)
    remote = env_worker_pool(cfg).make_env()
    try:
        _step_us_p50(remote, 50)  # warm
        out = {"local_step_us_p50": round(_step_us_p50(local, args.round_trips), 1),
               "ray_step_us_p50": round(_step_us_p50(remote, args.round_trips), 1)}
    finally:
        local.close()
        remote.close()
        _drop_workers(cfg)
    out["ray_round_trip_us"] = round(out["ray_step_us_p50"] - out["local_step_us_p50"], 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=32, help="the batch: episodes per row")
    ap.add_argument("--bash-calls", type=int, default=3, help="bashfix: test runs per episode")
    ap.add_argument("--micro-turns", type=int, default=20, help="micro: ALFWorld steps per episode")
    ap.add_argument("--round-trips", type=int, default=500, help="sync RayEnv.step calls timed")
    ap.add_argument("--worker-cpus", type=float, default=0.5, help="distributed.env_worker_cpus")
    ap.add_argument("--ray", default=None, help="a cluster to join (host:port); default: a local Ray "
                    "instance with this machine's CPUs")
    ap.add_argument("--quick", action="store_true", help="few episodes (a smoke test)")
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = ap.parse_args()
    load_at_start = os.getloadavg()
    if args.quick:
        args.episodes, args.bash_calls, args.micro_turns, args.round_trips = 4, 1, 5, 50

    import ray

    from agentrl.distributed import LOCAL_SYSTEM_CONFIG

    if args.ray:
        ray.init(address=args.ray, log_to_driver=False)
    else:
        ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False,
                 _system_config=LOCAL_SYSTEM_CONFIG)  # workers at nice 0, as agentrl's own instance
    tok = load_tokenizer("smollm2-135m")
    try:
        rows = [_row(args, tok, "bashfix", BASHFIX, s, args.bash_calls + 1) for s in SETUPS]
        rows += [_row(args, tok, "micro", MICRO, s, args.micro_turns) for s in SETUPS]
        trip = round_trip(args)
    finally:
        ray.shutdown()
    by = {(r["workload"], r["setup"]): r for r in rows}
    micro_thread, micro_ray = by["micro", "thread"], by["micro", "ray-1"]
    overhead = (micro_ray["wall_s"] - micro_thread["wall_s"]) / micro_ray["env_steps"]
    result = {
        "bench": "scale", "rows": rows,
        "ray_overhead_per_env_step_us": round(1e6 * overhead, 1),
        "round_trip": trip,
        "bashfix_speedup_1_to_2_workers": round(by["bashfix", "ray-2"]["episodes_per_s"]
                                                / by["bashfix", "ray-1"]["episodes_per_s"], 2),
        "bashfix_ray1_vs_thread": round(by["bashfix", "ray-1"]["episodes_per_s"]
                                        / by["bashfix", "thread"]["episodes_per_s"], 2),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "ray": ray.__version__,
                    "load_avg_at_start": load_at_start, "load_avg_at_end": os.getloadavg()},
        "note": (f"{os.cpu_count()} cores cap scaling here: 2 workers can at best double 1, and less "
                 "while other work keeps the cores busy (see the load average)"),
        "quick": args.quick, "args": {k: v for k, v in vars(args).items() if k != "out"},
    }
    print(f"{'row':16} {'episodes':>8} {'failed':>6} {'steps':>6} {'wall s':>8} {'ep/s':>7} {'steps/s':>8}"
          f" {'start s':>7}")
    for r in rows:
        print(f"{r['workload'] + '/' + r['setup']:16} {r['episodes']:>8} {r['failed_episodes']:>6} "
              f"{r['env_steps']:>6} {r['wall_s']:>8} {r['episodes_per_s']:>7} {r['steps_per_s']:>8} "
              f"{r['start_s']:>7}")
    print(f"Ray overhead per env step (micro, 1 worker vs in-process): {result['ray_overhead_per_env_step_us']} us; "
          f"sync round trip {trip['ray_round_trip_us']} us")
    print(f"bashfix: 1 -> 2 workers x{result['bashfix_speedup_1_to_2_workers']}, "
          f"1 worker vs in-process x{result['bashfix_ray1_vs_thread']} ({result['note']})")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
