"""How well the scripted experts play: success and episode length per task family and split.

For ALFWorld-v0 (each of the six families, on train, valid_seen and
valid_unseen) and WebShop-v0 (its score too), the observation-consistent
expert (``expert_action``, what ``agentrl sft`` clones by default) beside the
privileged oracle (``oracle_action``). The gap in length is the price of not
knowing where things are. Also the easy levels that ``bench/learning.py`` and
``make run-alfworld`` train on.

    python bench/experts.py [--seeds 1200] [--out bench/experts.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from agentrl.envs.alfworld import SPLITS, ALFWorldEnv
from agentrl.envs.webshop import WebShopEnv

POLICIES = ("expert_action", "oracle_action")
ALFWORLD_LEVELS = {
    "full": {},
    "easy (pick_and_place_simple, 6 receptacles)": {"families": ["pick_and_place_simple"], "max_receptacles": 6},
}


def _play(env: Any, seed: int, policy: str) -> tuple[dict[str, Any], float, int]:
    _, info = env.reset(seed=seed)
    first, done, reward, steps = info, False, 0.0, 0
    while not done:
        _, reward, terminated, truncated, info = env.step(getattr(env, policy)())
        done, steps = terminated or truncated, steps + 1
    return {**first, **info}, float(reward), steps


def alfworld(seeds: int) -> list[dict[str, Any]]:
    rows = []
    for level, kwargs in ALFWORLD_LEVELS.items():
        for split in SPLITS:
            env = ALFWorldEnv(split=split, **kwargs)
            for policy in POLICIES:
                by_family: dict[str, list[tuple[bool, int]]] = defaultdict(list)
                for seed in range(seeds):
                    info, _, steps = _play(env, seed, policy)
                    by_family[info["task_type"]].append((bool(info["won"]), steps))
                for family, runs in sorted(by_family.items()):
                    rows.append({"env": "ALFWorld-v0", "level": level, "split": split, "policy": policy,
                                 "family": family, "episodes": len(runs),
                                 "success": sum(w for w, _ in runs) / len(runs),
                                 "mean_steps": statistics.mean(n for _, n in runs)})
    return rows


def webshop(seeds: int) -> list[dict[str, Any]]:
    rows = []
    for max_steps in (15,):
        env = WebShopEnv(max_steps=max_steps)
        for policy in POLICIES:
            runs = [_play(env, seed, policy) for seed in range(seeds)]
            rows.append({"env": "WebShop-v0", "level": f"max_steps={max_steps}", "split": "all",
                         "policy": policy, "family": "all", "episodes": seeds,
                         "success": sum(r >= 1.0 for _, r, _ in runs) / seeds,
                         "mean_score": statistics.mean(r for _, r, _ in runs),
                         "mean_steps": statistics.mean(n for _, _, n in runs)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=1200, help="Task seeds per split (about 200 a family).")
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = alfworld(args.seeds) + webshop(args.seeds)
    print(f"{'env':12s} {'level':44s} {'split':12s} {'policy':14s} {'family':32s} {'n':>4s} "
          f"{'success':>7s} {'score':>6s} {'steps':>6s}")
    for r in rows:
        score = f"{r['mean_score']:.3f}" if "mean_score" in r else ""
        print(f"{r['env']:12s} {r['level']:44s} {r['split']:12s} {r['policy']:14s} {r['family']:32s} "
              f"{r['episodes']:4d} {r['success']:7.3f} {score:>6s} {r['mean_steps']:6.2f}")
    out = {"seeds": args.seeds, "rows": rows, "wall_s": round(time.perf_counter() - t0, 1)}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
