"""Tree packing vs episode packing: tokens through the model and wall time on one branched batch.

One batch of segment trees (``segment_tree``, ``depth`` levels of ``width``-way
splits, so ``width ** depth`` episodes a task) is rolled out once with the
model being measured, given tree credit, and then trained on in two layouts
(``agentrl.train.rows``):

- ``episode``: every episode its own packed sequence (``pack_sequences``), the
  trainer's default; the prompt and every turn above a branch point run once
  per episode under them;
- ``tree``: each minibatch's episodes as prefix-tree rows, every distinct
  token once (``train.tree_packing: true``).

For each layout it times the no-grad scoring pass (old logprobs) and one
forward+backward of the PPO loss over the whole batch (one minibatch), the
median of ``--repeats`` runs, and counts the tokens that went through the
model. It also checks that both layouts give the same loss and gradient
(the largest relative difference of a parameter's gradient), since the
speed-up means nothing otherwise. When tree credit gives every token 0 (a
random model wins no episode), each episode gets a synthetic advantage of
+-1 instead, so that the gradients compared are not all zero (the JSON says
``synthetic_advantages``).

    python bench/tree_packing.py                          # tiny model, GuessNumber, depth 3 width 2
    python bench/tree_packing.py --env agentrl/ALFWorld-v0 --tasks 2
    python bench/tree_packing.py --model smollm2-135m     # the default model (slower)
    python bench/tree_packing.py --quick                  # smoke test sizes
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from agentrl.credit import assign
from agentrl.train.batch import minibatch_step, samples_from_credit, score_old
from agentrl.train.config import load_train_config
from agentrl.train.loss import StepLoss
from agentrl.train.metrics import ProgressBars
from agentrl.train.rows import tree_token_savings
from agentrl.train.trainer import Trainer

FIELDS = ("advantages", "old", "behaviour", "versions")


def make_trainer(args: argparse.Namespace) -> Trainer:
    env_kwargs = "{high: 16, max_turns: 6}" if args.env == "agentrl/GuessNumber-v0" else "{}"
    cfg = load_train_config(None, [
        f"policy.model={args.model}", f"env.id={args.env}", f"env.kwargs={env_kwargs}",
        f"rollout.max_turns={args.max_turns}", f"rollout.allocator={{name: segment_tree, depth: {args.depth}, width: {args.width}}}",
        f"rollout.group_size={args.width ** args.depth}", f"rollout.max_context_tokens={args.max_context}",
        f"sampling.max_new_tokens={args.max_new_tokens}", "sampling.temperature=1.0",
        f"train.tasks_per_step={args.tasks}", "train.credit=tree", "train.evaluation.episodes=0",
        f"train.micro_batch_tokens={args.micro_batch_tokens}", "train.output.tensorboard=false",
        "train.output.plot=false", "train.checkpointing.export_hf=false", "train.output.dir=/tmp/agentrl-bench-tree-packing"])
    return Trainer(cfg, progress=False)


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def measure(tr: Trainer, samples: list, layout: str, repeats: int) -> dict:
    tree, t, lr = layout == "tree", tr.cfg.train, tr.learner
    scored = copy.deepcopy(samples)
    score_s, score_tokens = timed(lambda: score_old(lr.net, scored, t.micro_batch_tokens, lr.pad_id,
                                                    lr.temperature, tree=tree), repeats)
    idx = list(range(len(samples)))

    def step():
        lr.net.zero_grad(set_to_none=True)
        return minibatch_step(lr.net, samples, idx, StepLoss(t.loss, tr.policy.version), fields=FIELDS,
                              per_token=True, max_tokens=t.micro_batch_tokens, pad_id=lr.pad_id,
                              temperature=lr.temperature, tree=tree)

    lr.net.train()
    loss_s, (stats, loss_tokens) = timed(step, repeats)
    grads = {k: p.grad.detach().clone() for k, p in lr.net.named_parameters() if p.grad is not None}
    lr.net.zero_grad(set_to_none=True)
    lr.net.eval()
    return {"layout": layout, "score_tokens": score_tokens, "score_s": score_s,
            "loss_tokens": loss_tokens, "fwd_bwd_s": loss_s, "loss": stats["loss/total"],
            "_grads": grads}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--env", default="agentrl/GuessNumber-v0")
    p.add_argument("--tasks", type=int, default=4)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--width", type=int, default=2)
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="2 tasks, 1 repeat (smoke test)")
    p.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = p.parse_args()
    if args.quick:
        args.tasks, args.repeats = 2, 1
    torch.manual_seed(0)

    tr = make_trainer(args)
    t0 = time.perf_counter()
    trees, roll = tr.rollout(0, ProgressBars(tr.console, False))
    rollout_s = time.perf_counter() - t0
    samples = samples_from_credit(assign(trees, "tree"))
    if not samples:
        raise SystemExit("no episode to train on (every episode failed)")
    synthetic = not any(a for s in samples for a in s.advantages)
    if synthetic:  # no reward signal (a random model never wins): +-1 per episode, for the grad check
        for j, s in enumerate(samples):
            s.advantages = [(1.0 if j % 3 else -1.0) * m for m in s.mask]
    score_old(tr.learner.net, samples, tr.cfg.train.micro_batch_tokens, tr.learner.pad_id, tr.learner.temperature)
    rows = [measure(tr, samples, layout, args.repeats) for layout in ("episode", "tree")]
    ep, tree = rows
    grad_diff = max(float((tree["_grads"][k] - g).norm() / g.norm().clamp(min=1e-12))
                    for k, g in ep["_grads"].items())
    for r in rows:
        del r["_grads"]
    episode_tokens = sum(len(s.input_ids) for s in samples)
    result = {
        "model": args.model, "env": args.env, "tasks": args.tasks, "depth": args.depth,
        "width": args.width, "episodes": len(samples), "episode_tokens": episode_tokens,
        "action_tokens": sum(s.n_action for s in samples),
        "trie_saving_tokens": tree_token_savings([s.input_ids for s in samples]),
        "branched_nodes": sum(len(n.children) > 1 for t in trees for n in t.nodes.values()),
        "rollout_s": rollout_s, "rollout_success": roll["rollout/success"],
        "synthetic_advantages": synthetic, "rows": rows, "loss_abs_diff": abs(ep["loss"] - tree["loss"]),
        "grad_max_rel_diff": grad_diff,
        "speedup_score": ep["score_s"] / tree["score_s"],
        "speedup_fwd_bwd": ep["fwd_bwd_s"] / tree["fwd_bwd_s"],
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                    "loadavg": os.getloadavg()},
    }
    print(f"{args.model} on {args.env}: {args.tasks} segment trees (depth {args.depth}, width "
          f"{args.width}), {len(samples)} episodes, {episode_tokens} episode tokens, "
          f"{result['action_tokens']} action tokens")
    print(f"{'layout':<8} {'score tok':>10} {'score s':>9} {'loss tok':>9} {'fwd+bwd s':>10} {'loss':>10}")
    for r in rows:
        print(f"{r['layout']:<8} {r['score_tokens']:>10} {r['score_s']:>9.3f} {r['loss_tokens']:>9} "
              f"{r['fwd_bwd_s']:>10.3f} {r['loss']:>10.5f}")
    print(f"tokens through the model: tree = {tree['loss_tokens'] / ep['loss_tokens']:.1%} of episode; "
          f"speed-up: scoring {result['speedup_score']:.2f}x, fwd+bwd {result['speedup_fwd_bwd']:.2f}x; "
          f"same update: |dloss| {result['loss_abs_diff']:.1e}, grad rel diff {grad_diff:.1e}")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
