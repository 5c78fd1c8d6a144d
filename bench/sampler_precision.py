"""The ``hf`` sampler's precision (``policy.precision``): make run's held-out evaluation, timed.

Runs the evaluation ``make run`` prints (examples/train_alfworld_easy.yaml:
64 greedy ``valid_seen`` games of the easy level, 10 turns) with ``--model``
(make run's SFT weights, exported as an HF folder, are the case that matters:
the base model never plays a valid command) under each precision, one process
after another, each in its own subprocess. Per row: wall seconds, seconds in
prefill and in decode steps (timers around ``HFPolicy._prefill`` and
``_decode``), the tokens the prefill forwards ran (a row padded to its group's
longest re-runs a few cached ones) and the tokens decoded, the prefix cache's bytes, and the
success, turns and invalid-action fraction (greedy bf16 and fp32 may pick other
tokens where two logits are near).

Prints a table and writes ``sampler_precision.json``.

    python bench/sampler_precision.py --model FOLDER [--precisions fp32,bf16] [--rounds 2] [--episodes 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "train_alfworld_easy.yaml"


def child(model: str, precision: str, episodes: int) -> dict:
    """One evaluation in this process: its times and results."""
    import torch

    from agentrl.evaluation import evaluate_held_out
    from agentrl.policy import make_policy
    from agentrl.train.config import load_train_config

    cfg = load_train_config(CONFIG, [f"policy.model={model}", f"policy.precision={precision}"])
    policy = make_policy(cfg.policy)
    spent = {"prefill": 0.0, "decode": 0.0}
    counts = {"prefilled_tokens": 0, "decoded_tokens": 0}

    def timed(name, fn, count):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[name] += time.perf_counter() - t0
            count(args, out)
            return out
        return run

    def prefilled(args, out):  # rows [start, end) ran `window` tokens each
        (start, end), window = args[2], args[3]
        counts["prefilled_tokens"] += (end - start) * window

    def decoded(args, out):
        counts["decoded_tokens"] += sum(len(t) for t in out[0])

    policy._prefill = timed("prefill", policy._prefill, prefilled)
    policy._decode = timed("decode", policy._decode, decoded)
    ev = cfg.train.evaluation.model_copy(update={"episodes": episodes})
    t0 = time.perf_counter()
    m = evaluate_held_out(policy, cfg, ev)
    wall = time.perf_counter() - t0
    stats = policy.prefix_cache.stats if policy.prefix_cache is not None else None
    return {"precision": precision, "resolved": policy.precision, "wall_s": round(wall, 2),
            "prefill_s": round(spent["prefill"], 2), "decode_s": round(spent["decode"], 2), **counts,
            "success": m["eval/success"], "turns": m["eval/turns"],
            "invalid_action_frac": m.get("eval/invalid_action_frac"),
            "prefix_cache_mb": round(stats.bytes / 2**20, 1) if stats else None,
            "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the precisions, interleaved")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="4 games, one round")
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    ap.add_argument("--child", nargs=2, metavar=("PRECISION", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        Path(a.child[1]).write_text(json.dumps(child(a.model, a.child[0], a.episodes)))
        return
    episodes, rounds = (4, 1) if a.quick else (a.episodes, a.rounds)
    rows = []
    for r in range(rounds):
        for p in a.precisions.split(","):
            out = Path(a.out).with_suffix(f".{p}.{r}.tmp")
            subprocess.run([sys.executable, __file__, "--model", a.model, "--episodes", str(episodes),
                            "--child", p, str(out)], check=True)
            rows.append({"round": r, **json.loads(out.read_text())})
            out.unlink()
    print(f"{'precision':>9} {'wall s':>7} {'prefill s':>9} {'decode s':>8} {'prefilled':>9} {'decoded':>7} "
          f"{'success':>7} {'cache MB':>8}")
    for row in rows:
        print(f"{row['resolved']:>9} {row['wall_s']:7.1f} {row['prefill_s']:9.1f} {row['decode_s']:8.1f} "
              f"{row['prefilled_tokens']:9d} {row['decoded_tokens']:7d} {row['success']:7.3f} "
              f"{row['prefix_cache_mb'] or 0:8.0f}")
    Path(a.out).write_text(json.dumps({
        "what": "make run's held-out evaluation (64 greedy valid_seen games of the easy level) under each "
                "policy.precision of the hf sampler, each row its own process, rounds interleaved",
        "model": a.model, "episodes": episodes, "date": time.strftime("%Y-%m-%d"),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "quick": a.quick, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
