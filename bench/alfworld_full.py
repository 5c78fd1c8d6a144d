"""The full ALFWorld-style task: a recipe's held-out success per family on valid_seen and valid_unseen.

Trains ``--config`` (default ``examples/train_alfworld_full.yaml``: all six
task families, full-size rooms, 50 steps) with ``agentrl train``, then plays
its exported model with ``agentrl eval`` on ``--episodes`` tasks of each split
(greedy, the env's own 50 steps), and writes one row per family and split
with the training's wall time. The commands are the ones a user runs; this
script only times them and gathers their ``summary.json``.

    python bench/alfworld_full.py                      # train (about 1 h on 2 cores), then evaluate
    python bench/alfworld_full.py --skip-train         # evaluate the config's finished run again
    python bench/alfworld_full.py --model runs/x/hf --label "easy SFT"   # evaluate any model
    python bench/alfworld_full.py --quick              # tiny random model, 2 tasks: a smoke test

Writes ``bench/alfworld_full.json``; ``--add`` keeps its other entries (one a label).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
AGENTRL = [str(Path(sys.executable).with_name("agentrl"))]  # the venv's command, as a user runs it
SPLITS = ("valid_seen", "valid_unseen")


def run(cmd: list[str]) -> float:
    """Run ``cmd`` from the repository root; its wall seconds. A failure stops the bench."""
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    return time.perf_counter() - t0


def train_seconds(metrics: Path) -> dict:
    """SFT, RL and evaluation seconds from the run's ``metrics.jsonl`` (a resumed run's rows too)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    sft = sum(r.get("time/sft_s", 0.0) + r.get("time/sft_build_s", 0.0) for r in rows if r.get("phase") == "sft")
    rl = [r for r in rows if r.get("phase") == "rl"]
    return {"sft_s": round(sft, 1), "rl_steps": len(rl),
            "rl_step_s": [round(r.get("time/step_s", 0.0), 1) for r in rl],
            "rl_s": round(sum(r.get("time/step_s", 0.0) for r in rl), 1),
            "rollout_success_per_step": [round(r["rollout/success"], 3) for r in rl if "rollout/success" in r]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/train_alfworld_full.yaml")
    ap.add_argument("--set", action="append", default=[], help="key.path=value for the training run")
    ap.add_argument("--skip-train", action="store_true", help="evaluate the config's finished run")
    ap.add_argument("--model", help="evaluate this model instead of training (a folder or name)")
    ap.add_argument("--label", default="recipe", help="this entry's name in the JSON")
    ap.add_argument("--episodes", type=int, default=64, help="tasks per split")
    ap.add_argument("--splits", default=",".join(SPLITS))
    ap.add_argument("--quick", action="store_true", help="tiny-random, 1 SFT episode and 2 tasks a split "
                    "of an easy level: a smoke test")
    ap.add_argument("--add", action="store_true", help="keep the JSON's other labels")
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = ap.parse_args()
    cfg_path = ROOT / args.config
    cfg = yaml.safe_load(cfg_path.read_text())
    overrides = list(args.set)
    if args.quick:
        args.episodes = 2
        overrides += ["policy.model=tiny-random", "sft.levels=[]", "sft.episodes=1", "train.steps=0",
                      "sampling.max_new_tokens=4", "env.kwargs={max_steps: 12, families: [pick_and_place_simple], max_receptacles: 3}",
                      "rollout.max_turns=12",
                      "train.evaluation.episodes=0", "train.output.tensorboard=false", "train.output.plot=false"]
    run_dir = Path(next((o.split("=", 1)[1] for o in overrides if o.startswith("train.output.dir=")),
                        cfg["train"]["output"]["dir"]))
    if args.quick:
        run_dir = Path(args.out).with_suffix("") / "run"
        overrides.append(f"train.output.dir={run_dir}")
    run_dir = run_dir if run_dir.is_absolute() else ROOT / run_dir
    load = os.getloadavg()
    entry: dict = {"config": args.config, "overrides": overrides}
    if args.model:
        model, entry["model"] = args.model, args.model
    else:
        if not args.skip_train:
            sets = [a for o in overrides for a in ("--set", o)]
            entry["train_wall_s"] = round(run(AGENTRL + ["train", "--config", str(cfg_path), "--overwrite",
                                                         "--no-progress", *sets]), 1)
        entry["train"] = train_seconds(run_dir / "metrics.jsonl")
        ckpts = sorted((run_dir / "checkpoints").glob("step-*/hf"))
        if not ckpts:
            raise SystemExit(f"no exported model under {run_dir}/checkpoints (train.checkpointing.export_hf)")
        model = str(ckpts[-1])
        entry["model"] = str(ckpts[-1].relative_to(ROOT)) if ckpts[-1].is_relative_to(ROOT) else model
    # the run's overrides, less its training and the model it started from: --model names the one evaluated
    sets = [a for o in overrides if not o.startswith(("train.", "sft.", "policy.model=")) for a in ("--set", o)]
    entry["splits"] = {}
    for split in args.splits.split(","):
        slug = "".join(c if c.isalnum() else "_" for c in args.label)
        out = run_dir / f"eval_{split}" if not args.model else ROOT / "runs" / "bench_alfworld_full" / f"{slug}_{split}"
        wall = run(AGENTRL + ["eval", "--env", cfg["env"]["id"], "--split", split, "--model", model,
                              "--config", str(cfg_path), "--episodes", str(args.episodes), "--out", str(out),
                              "--overwrite", "--no-progress", *sets])  # a rerun (--skip-train) evaluates again
        summary = json.loads((out / "summary.json").read_text())
        report = summary["reports"][0]
        entry["splits"][split] = {"eval_wall_s": round(wall, 1), "model": summary["model"], "tasks": report["tasks"],
                                  "rows": [{k: r[k] for k in ("family", "tasks", "success", "errors")}
                                           for r in report["rows"]]}
    entry["machine"] = {"cpu_count": os.cpu_count(), "load_avg_1m": [round(load[0], 2), round(os.getloadavg()[0], 2)]}
    out_path = Path(args.out)
    result = json.loads(out_path.read_text()) if args.add and out_path.exists() else {}
    result[args.label] = entry
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.label}: {entry['model']}" + (f", trained in {entry['train_wall_s'] / 60:.1f} min"
                                                if "train_wall_s" in entry else ""))
    for split, s in entry["splits"].items():
        print(f"  {split} ({s['tasks']} tasks, {s['eval_wall_s']:.0f} s): " + ", ".join(
            f"{r['family'].split('_then')[0]} {r['success']:.2f}" for r in s["rows"]))


if __name__ == "__main__":
    main()
