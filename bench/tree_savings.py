"""Tree savings: how many fewer tokens branching allocators sample than independent episodes, at equal leaves.

On ``agentrl/ALFWorld-v0``, the same task seeds and sampling config
(temperature 1.0, one rollout seed) are rolled out three times, each with the
same number of leaves (episodes) per task:

- ``independent``: ``leaves`` fresh episodes per task (GRPO's group);
- ``segment_tree``: TreePO-style trees, ``depth`` levels of ``width``-way
  splits, each level a segment of ``segment_turns`` turns (the last level runs
  to the end), so the first ``depth - 1`` segments are shared by sibling leaves;
- ``entropy_branch``: half the leaves fresh, the rest branched before turns
  whose entropy rose (ARPO/AEPO); it branches only where the policy's entropy
  rises, so with the ``mock`` backend (entropy 0) it has no branch point.

Each task runs in its own engine with a budget of ``leaves``, all on one
event loop (the ``hf`` backend batches across them), so every allocator grows
exactly ``leaves`` leaves on every task. For each allocator the bench reports
the engine's exact counters (generated, prefilled, reused and shared tokens;
env steps played and replayed), wall time, success rate and the % fewer
generated tokens than ``independent``. It asserts that every allocator spent
exactly the leaves budget of every task and left no open leaf, and that the
segment trees really branched (nodes with more than one child).

Savings depend on how long episodes are against the segment length: if every
episode runs the full ``L`` turns, a full tree samples
``k * sum(w^1 .. w^(d-1)) + w^d * (L - (d-1) k)`` turns where independent
episodes sample ``w^d * L`` (``expected_turn_saving``). An episode that ends
inside a shared segment hands its unspent leaves to the tree's other open
leaves or to fresh episodes, which share less or nothing. The JSON therefore records the segment length, the episode
length distribution and why episodes ended. A second measure, free of the
sampling noise between runs, is each run's own ``generated / path tokens``:
what it sampled against what the same episodes would cost sampled apart.

    python bench/tree_savings.py                  # SmolLM2-135M, 4 tasks x 16 leaves (minutes on CPU)
    python bench/tree_savings.py --backend mock   # scripted ALFWorld commands, seconds, deterministic
    python bench/tree_savings.py --quick          # tiny random model, small sizes (smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import time
from collections import Counter
from pathlib import Path

from agentrl.config import load_config
from agentrl.policy.base import GenerateRequest, SamplingParams
from agentrl.policy.mock import MockPolicy
from agentrl.rollout import Engine, summarize
from agentrl.rollout.allocators import Budget, is_open, make_allocator
from agentrl.types import RolloutTree

ENV_ID = "agentrl/ALFWorld-v0"
ALLOCATORS = ("independent", "segment_tree", "entropy_branch")


class CommandMock(MockPolicy):
    """A scripted policy that plays plausible ALFWorld commands: ``look``,
    ``inventory``, and ``go to`` / ``open`` / ``examine`` a receptacle named in
    the prompt, picked with the request's seed, so that branches diverge and
    reruns repeat. Entropies are 0, as for every mock response."""

    _NAMED = re.compile(r"\ban? ([a-z]+ \d+)")

    def generate(self, requests):
        out = []
        for req in requests:
            names = sorted(set(self._NAMED.findall(self.tokenizer.decode(req.prompt_ids))))
            commands = ["look", "inventory"] + [f"{verb} {name}" for name in names
                                                for verb in ("go to", "open", "examine")]
            text = random.Random(req.params.seed).choice(commands)
            self.calls += 1
            ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append(self._cut(ids, req))
        return out


def expected_turn_saving(depth: int, width: int, segment_turns: int, turns: int) -> float:
    """Fraction of turns a full ``width ** depth``-leaf segment tree samples fewer
    than as many independent episodes, when every episode runs ``turns`` turns:
    level i < depth - 1 has ``width ** (i + 1)`` segments of ``segment_turns``
    turns, the last level ``width ** depth`` runs of what is left."""
    shared = segment_turns * sum(width ** (i + 1) for i in range(depth - 1))
    tree = shared + width**depth * max(turns - (depth - 1) * segment_turns, 0)
    return 1 - tree / (width**depth * turns)


def end_reason(tree: RolloutTree, leaf_id: int) -> str:
    """Why the episode ending at ``leaf_id`` ended: success, failure (error),
    a truncation reason without its numbers, or the env's own end."""
    leaf = tree.nodes[leaf_id]
    if leaf.error:
        return "error"
    if leaf.success or leaf.info.get("won"):
        return "success"
    reason = leaf.info.get("truncation_reason")
    if reason:
        return reason.split("=")[0].split(":")[0]
    return "terminated" if leaf.terminated else "truncated by env"


def tree_shape(trees: list[RolloutTree]) -> dict:
    """Leaves per task, branch nodes (more than one child), roots, and what
    the episodes' own paths would cost sampled apart (action tokens and turns)."""
    path_tokens = path_turns = 0
    lengths: Counter[int] = Counter()
    reasons: Counter[str] = Counter()
    for t in trees:
        for leaf in t.leaves():
            path = t.path(leaf.id)
            path_tokens += sum(len(n.action_ids) for n in path)
            turns = sum(not n.partial for n in path)
            path_turns += turns
            lengths[turns] += 1
            reasons[end_reason(t, leaf.id)] += 1
    return {
        "leaves_per_task": [len(t.leaves()) for t in trees],
        "open_leaves": sum(is_open(n) for t in trees for n in t.leaves()),
        "branch_nodes": sum(len(n.children) > 1 for t in trees for n in t.nodes.values()),
        "roots": sum(len(t.roots) for t in trees),
        "turns_sampled": sum(not n.partial for t in trees for n in t.nodes.values()),
        "path_turns": path_turns,
        "path_action_tokens": path_tokens,
        "episode_turns": dict(sorted(lengths.items())),
        "end_reasons": dict(reasons.most_common()),
    }


def allocator_options(name: str, args: argparse.Namespace) -> dict:
    if name == "independent":
        return {"n": args.leaves}
    if name == "segment_tree":
        return {"depth": args.depth, "width": args.width, "segment_turns": args.segment_turns}
    return {"k": args.width}


def make_policy(args: argparse.Namespace, model, tok):
    """A fresh policy per run: the hf prefix cache must not carry one run's prompts into the next."""
    if args.backend == "mock":
        return CommandMock(tok, ["look"])
    from agentrl.policy import HFPolicy

    return HFPolicy(model, tok, max_batch_size=args.max_batch_size, prefix_cache_mb=args.cache_mb)


async def grow(policy, cfg, seeds: list[int], name: str, options: dict, leaves: int) -> list[RolloutTree]:
    """One engine per task seed, each with a budget of ``leaves``, all on one
    event loop, so the policy batches across tasks. One engine for all tasks
    would let ``entropy_branch`` (which ranks turns across tasks) give one task
    more leaves than another."""
    engines = [Engine(policy, cfg, ENV_ID) for _ in seeds]
    try:
        runs = await asyncio.gather(*(e.run([seed], make_allocator(name, **options), Budget(leaves, "leaves"))
                                      for e, seed in zip(engines, seeds, strict=True)))
    finally:
        for e in engines:
            e.close()
    trees = [run[0] for run in runs]
    for task, tree in enumerate(trees):  # each engine numbered its one task 0
        tree.meta["task"] = task
    return trees


def run_one(name: str, args: argparse.Namespace, cfg, model, tok) -> dict:
    """One allocator's rollout, its counters and its tree shape; asserts the budget was met."""
    seeds = [args.task_seed + i for i in range(args.tasks)]
    options = allocator_options(name, args)
    t0 = time.perf_counter()
    trees = asyncio.run(grow(make_policy(args, model, tok), cfg, seeds, name, options, args.leaves))
    wall = time.perf_counter() - t0
    s = summarize(trees, wall)
    shape = tree_shape(trees)
    spent = [t.meta["budget"]["spent"] for t in trees]
    assert spent == shape["leaves_per_task"] == [args.leaves] * args.tasks, (
        f"{name} spent {spent} leaves and grew {shape['leaves_per_task']}, budget {args.leaves} a task")
    assert shape["open_leaves"] == 0, f"{name} left {shape['open_leaves']} open (paused) leaves"
    if name == "segment_tree":
        assert shape["branch_nodes"] > 0, "segment_tree grew no node with more than one child"
    counters = {k: s[k] for k in ("generated_tokens", "prefilled_tokens", "reused_tokens",
                                  "shared_tokens", "env_steps", "env_steps_replayed")}
    assert counters["generated_tokens"] == sum(
        len(n.action_ids) for t in trees for n in t.nodes.values()), f"{name}: counter off the tree"
    report = [t.meta.get("allocation_report", {}).get(name, {}) for t in trees]
    return {"allocator": name, "options": options, "leaves": sum(shape["leaves_per_task"]),
            **counters, "wall_s": round(wall, 2), "success_rate": round(s["success_rate"], 4),
            "mean_turns": round(s["mean_turns"], 2), "failed_episodes": s["failed_episodes"],
            "own_path_saving_pct": round(100 * (1 - counters["generated_tokens"]
                                               / max(shape["path_action_tokens"], 1)), 1),
            **shape, "allocation_report": report}


def machine() -> dict:
    import torch

    return {"machine": f"{platform.machine()} {os.cpu_count()} cpus, {torch.get_num_threads()} torch threads, "
                       f"torch {torch.__version__}, python {platform.python_version()}",
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "note": "shared machine (2 cores, other engineers' jobs alongside): wall times are noisy. "
                    "Counters are exact for this run; timing decides which requests share a batch, "
                    "which can move prefilled/reused counts a little and, by float noise, rarely a sample"}


def print_table(rows: list[dict]) -> None:
    head = (f"{'allocator':<15}{'leaves':>7}{'generated':>10}{'fewer':>8}{'prefilled':>10}{'reused':>9}"
            f"{'shared':>9}{'steps':>7}{'replayed':>9}{'branch':>7}{'wall s':>8}{'success':>8}")
    print(head)
    for r in rows:
        print(f"{r['allocator']:<15}{r['leaves']:>7}{r['generated_tokens']:>10}{r['fewer_generated_pct']:>7.1f}%"
              f"{r['prefilled_tokens']:>10}{r['reused_tokens']:>9}{r['shared_tokens']:>9}{r['env_steps']:>7}"
              f"{r['env_steps_replayed']:>9}{r['branch_nodes']:>7}{r['wall_s']:>8.1f}{r['success_rate']:>8.2f}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("hf", "mock"), default="hf")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu", help="torch device of the hf model")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--leaves", type=int, default=16, help="leaves (episodes) per task, for every allocator")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--width", type=int, default=2, help="segment_tree width; entropy_branch's k")
    ap.add_argument("--segment-turns", type=int, default=2)
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--max-context-tokens", type=int, default=2048)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--cache-mb", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0, help="rollout (sampling) seed")
    ap.add_argument("--task-seed", type=int, default=0, help="first ALFWorld task seed")
    ap.add_argument("--allocators", default=",".join(ALLOCATORS))
    ap.add_argument("--quick", action="store_true", help="tiny random model, 2 tasks x 8 leaves, short turns")
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = ap.parse_args()
    if args.quick:
        args.tasks, args.leaves, args.max_turns, args.segment_turns, args.max_new_tokens = 2, 8, 8, 2, 8
        if args.backend == "hf":
            args.model = "tiny-random"
    for name in ("tasks", "leaves", "depth", "width", "segment_turns", "max_turns", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main() -> None:
    start = time.perf_counter()
    args = parse_args()
    from agentrl.models import load_model, load_tokenizer

    if args.backend == "hf":
        model, tok = load_model(args.model, device=args.device)
    else:
        model, tok = None, load_tokenizer("smollm2-135m")
    cfg = load_config(overrides=[
        f"env.id={ENV_ID}", f"rollout.max_turns={args.max_turns}", f"rollout.seed={args.seed}",
        f"rollout.max_context_tokens={args.max_context_tokens}", "sampling.temperature=1.0",
        f"sampling.max_new_tokens={args.max_new_tokens}", "rollout.concurrency=64"])
    if args.backend == "hf":  # first calls pay one-time costs; keep them out of the first run's time
        make_policy(args, model, tok).generate(
            [GenerateRequest(tok.encode("look"), SamplingParams(temperature=1.0, max_new_tokens=2, seed=0))])
    load_start = machine()["load_avg_1m"]
    rows = [run_one(name, args, cfg, model, tok) for name in args.allocators.split(",")]
    base = next((r for r in rows if r["allocator"] == "independent"), None)
    for r in rows:
        r["fewer_generated_pct"] = (round(100 * (1 - r["generated_tokens"] / base["generated_tokens"]), 1)
                                    if base and base["generated_tokens"] else None)
    expected = expected_turn_saving(args.depth, args.width, args.segment_turns, args.max_turns)
    tree = next((r for r in rows if r["allocator"] == "segment_tree"), None)
    result = {
        "env": ENV_ID, "env_kwargs": {}, "backend": args.backend,
        "model": args.model if args.backend == "hf" else "mock (seeded ALFWorld commands)",
        "tasks": args.tasks, "leaves_per_task": args.leaves, "task_seeds": list(
            range(args.task_seed, args.task_seed + args.tasks)),
        "rollout_seed": args.seed, "temperature": 1.0, "max_turns": args.max_turns,
        "max_new_tokens": args.max_new_tokens, "max_context_tokens": args.max_context_tokens,
        "segment_turns": args.segment_turns, "depth": args.depth, "width": args.width,
        "expected_turn_saving_pct_if_all_episodes_run_max_turns": round(100 * expected, 1),
        "expected_turn_saving_pct_by_segment_turns": {
            k: round(100 * expected_turn_saving(args.depth, args.width, k, args.max_turns), 1)
            for k in range(1, args.max_turns // max(args.depth - 1, 1) + 1)},
        "target": "segment_tree (depth 4) samples >= 40% fewer generated tokens than independent",
        "target_met": bool(tree and tree["fewer_generated_pct"] is not None
                           and tree["fewer_generated_pct"] >= 40.0),
        "rows": rows, **machine(), "load_avg_1m_at_start": load_start, "quick": args.quick,
        "wall_s_total_with_model_load": round(time.perf_counter() - start, 1),
    }
    print_table(rows)
    print(f"segment length {args.segment_turns} turns, max {args.max_turns} turns: a full depth-{args.depth} "
          f"width-{args.width} tree samples {100 * expected:.1f}% fewer turns if every episode runs to the end")
    for r in rows:
        print(f"{r['allocator']}: episode turns {r['episode_turns']}, ends {r['end_reasons']}, "
              f"{r['own_path_saving_pct']}% fewer tokens than its own paths sampled apart")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
