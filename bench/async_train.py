"""Asynchronous training: wall time per step and tokens/s, synchronous against k = 1 and 2.

The same small GRPO run (``--model``, ``smollm2-135m`` by default, on
``agentrl/GuessNumber-v0`` for ``--steps`` steps; about 4.5 minutes on 2 CPU
cores, ``--model tiny-random`` takes seconds) three ways: synchronous
(``train.asynchronous: null``), then ``train.asynchronous: {max_batch_staleness: k,
queue_size: 2}`` for k = 1 and 2 (``agentrl.train.asynchronous``: the next
steps roll out from a copy of the weights while this one trains).

A one-step run first warms up (imports, model files, chat-template probes). Per
run, from the trainer's own ``metrics.jsonl``: each step's wall time (the
time between two logged steps, the first from the call to ``train``), its
rollout success, ``time/rollout_s`` and ``time/train_s``, and the staleness the
trainer logs (``async/staleness_mean``, ``async/staleness_max``,
``async/dropped_batches``); then generated tokens per wall second over the run.
Evaluation is off, so a step is rollout + update + sync; a small entropy bonus
(``train.loss.entropy_coef``) makes every step update the weights even when a
group's rewards are all equal (no advantage signal). Torch runs on
``--threads`` threads so the producer thread and the trainer can each have a
core.

Prints a table and writes ``async_train.json``.

    python bench/async_train.py [--model tiny-random] [--steps 3] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from agentrl.train.config import load_train_config
from agentrl.train.metrics import MetricsLogger
from agentrl.train.trainer import train

ENV = "agentrl/GuessNumber-v0"
RUNS = [("sync", None), ("async_k1", 1), ("async_k2", 2)]
STALENESS = ("async/staleness_mean", "async/staleness_max", "async/dropped_batches", "async/queue_wait_s")


def _cfg(args: argparse.Namespace, out: Path, k: int | None) -> Any:
    over = [f"policy.model={args.model}", "policy.backend=hf", f"env.id={ENV}", "rollout.max_turns=3",
            f"rollout.group_size={args.group}", "rollout.max_context_tokens=512",
            f"sampling.max_new_tokens={args.new_tokens}", "train.credit=grpo",
            f"train.tasks_per_step={args.tasks}", f"train.minibatch_size={args.tasks * args.group}",
            "train.micro_batch_tokens=4096", "train.loss.entropy_coef=0.01", f"train.steps={args.steps}", "train.optimizer.lr=1e-4",
            "train.evaluation.episodes=0", "train.output.tensorboard=false", "train.checkpointing.export_hf=false",
            "train.output.plot=false", "train.output.save_trees=0", f"train.output.dir={out}"]
    if k is not None:
        over.append(f"train.asynchronous={{max_batch_staleness: {k}, queue_size: 2}}")
    return load_train_config(None, over)


def run(args: argparse.Namespace, name: str, k: int | None, work: Path) -> dict[str, Any]:
    """One training run; the wall clock of each logged ``rl`` row is taken as it is written."""
    logged: list[float] = []
    log = MetricsLogger.log

    def timed(self: MetricsLogger, step: int, metrics: dict[str, Any]) -> None:
        if metrics.get("phase") == "rl":
            logged.append(time.perf_counter())
        log(self, step, metrics)

    MetricsLogger.log = timed  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        train(_cfg(args, work / name, k), progress=False)
        total = time.perf_counter() - t0
    finally:
        MetricsLogger.log = log  # type: ignore[method-assign]
    rows = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase") == "rl"]
    walls = [b - a for a, b in zip([t0, *logged], logged, strict=False)]
    steps = [{"step": r["step"], "wall_s": round(w, 3), "rollout_s": round(r["time/rollout_s"], 3),
              "train_s": round(r.get("time/train_s", 0.0), 3), "rollout_success": r["rollout/success"],
              "generated_tokens": r["rollout/generated_tokens"],
              **{key: r[key] for key in STALENESS if key in r}}
             for r, w in zip(rl, walls, strict=True)]
    tokens = sum(s["generated_tokens"] for s in steps)
    loop = logged[-1] - t0 if logged else total
    return {"run": name, "max_batch_staleness": k, "steps": steps, "wall_s": round(total, 2),
            "wall_to_last_step_s": round(loop, 2),
            "step_s_mean": round(loop / len(steps), 3),
            "step_s_median_after_first": round(statistics.median(walls[1:]), 3) if len(walls) > 1 else None,
            "generated_tokens_per_s": round(tokens / loop, 1),
            "train_tokens_per_s_mean": round(statistics.mean([r.get("train/tokens_per_s", 0.0) for r in rl]), 1),
            "rollout_success_mean": round(statistics.mean(s["rollout_success"] for s in steps), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=4, help="train.tasks_per_step")
    ap.add_argument("--group", type=int, default=4, help="rollout.group_size")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--quick", action="store_true", help="2 steps of a smaller batch (a smoke test)")
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = ap.parse_args()
    load_at_start = os.getloadavg()
    if args.quick:
        args.model, args.steps, args.tasks, args.group, args.new_tokens = "tiny-random", 2, 2, 2, 4
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="agentrl-async-bench-") as tmp:
        warm = argparse.Namespace(**{**vars(args), "steps": 1})
        train(_cfg(warm, Path(tmp) / "warm", None), progress=False)  # imports, model files, templates
        runs = [run(args, name, k, Path(tmp)) for name, k in RUNS]
    base = runs[0]["step_s_mean"]
    for r in runs:
        r["speedup_vs_sync"] = round(base / r["step_s_mean"], 2)
    result = {
        "bench": "async_train", "env": ENV, "model": args.model, "runs": runs,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "load_avg_at_start": load_at_start, "load_avg_at_end": os.getloadavg()},
        "quick": args.quick, "args": {k: v for k, v in vars(args).items() if k != "out"},
    }
    print(f"{'run':10} {'step s':>7} {'med s':>7} {'gen tok/s':>9} {'train tok/s':>11} {'success':>8} "
          f"{'stale mean':>10} {'stale max':>9} {'dropped':>7} {'x sync':>6}")
    for r in runs:
        last = r["steps"][-1]
        print(f"{r['run']:10} {r['step_s_mean']:>7} {r['step_s_median_after_first'] or '-':>7} "
              f"{r['generated_tokens_per_s']:>9} {r['train_tokens_per_s_mean']:>11} "
              f"{r['rollout_success_mean']:>8} "
              f"{statistics.mean(s.get('async/staleness_mean', 0.0) for s in r['steps']):>10.3f} "
              f"{max(s.get('async/staleness_max', 0) for s in r['steps']):>9} "
              f"{last.get('async/dropped_batches', 0):>7} {r['speedup_vs_sync']:>6}")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
