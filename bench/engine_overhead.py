"""Rollout engine overhead: turns per second, time outside generation, batch occupancy.

1. ``mock``: the instant ``mock`` backend on ALFWorld-v0. Everything measured
   is the engine's own work (env steps, chat deltas, trees): turns per second
   in one process, with env steps in the thread pool and inline.
2. ``hf``: the 135M model on ALFWorld-v0. The share of wall time spent outside
   ``generate`` (time inside it is measured on the generate thread).
3. Batch occupancy: mean requests per ``generate`` call, for the engine (its
   micro-batcher) against a lockstep loop on the same episodes (one
   ``generate`` per turn over every episode still running, as the old runner
   did; re-implemented here, about 30 lines, so the comparison stays runnable).
4. Deterministic mode (``rollout.deterministic``, docs/reproducibility.md):
   every row above runs with it on and off; on ``hf`` its cost is the wall
   time of the deterministic engine row against the timing-based one.

Prints a table and writes ``engine_overhead.json``. ``--backends mock`` runs
only the mock rows (seconds, where the ``hf`` rows take minutes on CPU); the
``hf`` rows of the file it rewrites are then kept, marked
``"from_previous_run": true``.

    python bench/engine_overhead.py [--tasks 16] [--turns 8] [--backends mock,hf] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from agentrl.chat import ChatContext
from agentrl.config import load_config
from agentrl.env import make_env
from agentrl.models import load_model, load_tokenizer
from agentrl.policy import (
    GenerateRequest,
    HFPolicy,
    MockPolicy,
    SamplingParams,
    action_text,
    request_seed,
)
from agentrl.rollout import collect

ENV = "agentrl/ALFWorld-v0"
COMMANDS = ["look", "inventory", "go to countertop 1", "open drawer 1", "go to cabinet 2",
            "take apple 1 from countertop 1", "examine sidetable 1"]


class Timed(HFPolicy):
    """HFPolicy that adds up the seconds spent inside ``generate`` and counts calls."""

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.gen_s, self.calls, self.rows = 0.0, 0, 0

    def generate(self, requests):
        t0 = time.perf_counter()
        out = super().generate(requests)
        self.gen_s += time.perf_counter() - t0
        self.calls += 1
        self.rows += len(requests)
        return out


def _cfg(args: argparse.Namespace, executor: str = "thread", deterministic: bool = False) -> Any:
    return load_config(overrides=[
        f"rollout.max_turns={args.turns}", f"sampling.max_new_tokens={args.new_tokens}",
        "sampling.temperature=1.0", "rollout.max_context_tokens=4096", "rollout.concurrency=64",
        f"rollout.env_executor={executor}", "rollout.seed=7", f"rollout.deterministic={str(deterministic).lower()}"])


def mock_rows(args: argparse.Namespace, tok: Any) -> list[dict[str, Any]]:
    rows = []
    for executor in ("thread", "inline"):
        for deterministic in (False, True):
            cfg = _cfg(args, executor, deterministic)
            cfg.rollout.max_turns = args.mock_turns
            policy = MockPolicy(tok, lambda p: COMMANDS[len(p) % len(COMMANDS)])
            collect(ENV, policy, cfg, list(range(4)))  # warm: imports, template probes
            t0 = time.perf_counter()
            trees = collect(ENV, policy, cfg, list(range(args.mock_tasks)))
            wall = time.perf_counter() - t0
            turns = sum(1 for t in trees for n in t.nodes.values() if n.action_ids)
            rows.append({"backend": "mock", "env_executor": executor, "deterministic": deterministic,
                         "episodes": len(trees), "turns": turns, "wall_s": round(wall, 3),
                         "turns_per_s": round(turns / wall, 1)})
    return rows


def lockstep(policy: Any, cfg: Any, seeds: list[int]) -> tuple[int, int]:
    """The old runner's shape: every running episode's turn in one ``generate``; returns (calls, rows)."""
    tok, s = policy.tokenizer, cfg.sampling
    envs = [make_env(ENV) for _ in seeds]
    ctxs = []
    for env, seed in zip(envs, seeds, strict=True):
        obs, info = env.reset(seed=seed)
        ctxs.append(ChatContext(tok, [{"role": "system", "content": cfg.rollout.system_prompt},
                                      {"role": "user", "content": obs}], check_prefix=False))
    active, calls, rows, turn = list(range(len(seeds))), 0, 0, 0
    while active and turn < cfg.rollout.max_turns:
        turn += 1
        reqs = [GenerateRequest(list(ctxs[i].ids), SamplingParams(
            temperature=s.temperature, max_new_tokens=s.max_new_tokens,
            seed=request_seed(cfg.rollout.seed, seeds[i], turn))) for i in active]
        results = policy.generate(reqs)
        calls, rows = calls + 1, rows + len(reqs)
        still = []
        for i, res in zip(active, results, strict=True):
            ctxs[i].append_action(res.token_ids)
            obs, _, term, trunc, _ = envs[i].step(action_text(tok, res.token_ids).strip())
            if not (term or trunc):
                ctxs[i].append_observation([{"role": "user", "content": obs}])
                still.append(i)
        active = still
    for env in envs:
        env.close()
    return calls, rows


def hf_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    model, tok = load_model(args.model)
    seeds = list(range(args.tasks))
    rows = []
    for deterministic in (False, True):  # timing-based batches, then deterministic mode
        cfg = _cfg(args, deterministic=deterministic)
        policy = Timed(model, tok, max_batch_size=args.max_batch)
        collect(ENV, policy, cfg, seeds[:2])  # warm
        policy.gen_s = policy.calls = policy.rows = 0
        policy.batcher.batches = policy.batcher.batched_requests = 0
        t0 = time.perf_counter()
        trees = collect(ENV, policy, cfg, seeds)
        wall = time.perf_counter() - t0
        turns = sum(1 for t in trees for n in t.nodes.values() if n.action_ids)
        rows.append({"backend": "hf", "runner": "engine", "deterministic": deterministic, "model": args.model,
                     "episodes": len(trees), "turns": turns, "wall_s": round(wall, 2),
                     "generate_s": round(policy.gen_s, 2),
                     "outside_generation_share": round(1 - policy.gen_s / wall, 4),
                     "generate_calls": policy.calls, "mean_batch_occupancy": round(policy.rows / policy.calls, 2)})
    cfg = _cfg(args)
    lock = Timed(model, tok, max_batch_size=args.max_batch)
    t0 = time.perf_counter()
    calls, nrows = lockstep(lock, cfg, seeds)
    wall = time.perf_counter() - t0
    rows.append({"backend": "hf", "runner": "lockstep", "deterministic": False, "model": args.model,
                 "episodes": len(seeds),
                 "turns": nrows, "wall_s": round(wall, 2), "generate_s": round(lock.gen_s, 2),
                 "outside_generation_share": round(1 - lock.gen_s / wall, 4),
                 "generate_calls": calls, "mean_batch_occupancy": round(nrows / calls, 2)})
    return rows


def _previous_rows(path: Path, backends: set[str]) -> list[dict[str, Any]]:
    """The rows of ``backends`` in an earlier result at ``path``, marked as such (none: [])."""
    if not backends or not path.exists():
        return []
    old = json.loads(path.read_text()).get("rows", [])
    return [{**r, "from_previous_run": True} for r in old if r.get("backend") in backends]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=16, help="hf: policy.max_batch_size")
    ap.add_argument("--mock-tasks", type=int, default=64)
    ap.add_argument("--mock-turns", type=int, default=20)
    ap.add_argument("--backends", default="mock,hf", help="which rows to run: mock, hf or both")
    ap.add_argument("--quick", action="store_true", help="tiny model, few episodes (a smoke test)")
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = ap.parse_args()
    if args.quick:
        args.model, args.tasks, args.turns, args.mock_tasks, args.mock_turns = "tiny-random", 4, 3, 8, 5
    backends = set(args.backends.split(","))
    if not backends or backends - {"mock", "hf"}:
        ap.error(f"--backends takes mock, hf or mock,hf, not {args.backends!r}")
    tok = load_tokenizer("smollm2-135m")
    rows = (mock_rows(args, tok) if "mock" in backends else []) + (hf_rows(args) if "hf" in backends else [])
    rows += _previous_rows(Path(args.out), {"mock", "hf"} - backends)
    result = {
        "bench": "engine_overhead", "env": ENV, "rows": rows,
        "targets": {"mock_turns_per_s": 2000, "hf_outside_generation_share": 0.05},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_at_end": os.getloadavg()},
        "quick": args.quick, "args": {k: v for k, v in vars(args).items() if k != "out"},
    }
    det = {r["backend"]: r["wall_s"] for r in rows if r.get("runner") == "engine" and r.get("deterministic")}
    base = {r["backend"]: r["wall_s"] for r in rows if r.get("runner") == "engine" and not r.get("deterministic")}
    if "hf" in det and "hf" in base:
        result["hf_deterministic_cost"] = round(det["hf"] / base["hf"] - 1, 3)  # extra wall time, a fraction
    print(f"{'row':34} {'turns':>6} {'wall s':>8} {'turns/s':>8} {'outside gen':>11} {'batch':>6}")
    for r in rows:
        name = f"{r['backend']}/{r.get('env_executor') or r.get('runner')}" + ("/det" if r.get("deterministic") else "")
        print(f"{name:34} {r['turns']:>6} {r['wall_s']:>8} {r.get('turns_per_s', '-'):>8} "
              f"{r.get('outside_generation_share', '-'):>11} {r.get('mean_batch_occupancy', '-'):>6}")
    if "hf_deterministic_cost" in result:
        print(f"hf deterministic mode: {result['hf_deterministic_cost']:+.1%} wall time against timing-based batches")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
