"""Why bf16 learned worse than fp32: the trainer's log-probs of sampled tokens under each precision, and their cost.

The easy ALFWorld-style level of ``make run-alfworld`` is played by SmolLM2-135M
in fp32 (``hf``, temperature 0.7, as that recipe samples), ``--episodes`` tasks
x ``--group`` episodes. Every action token's log-prob is then recomputed by the
trainer's forward in each precision:

- ``fp32``: the reference;
- ``bf16 autocast``: what ``train.precision: bf16`` ran when its SFT scored 0.547
  against fp32's 0.656: every matmul in bf16, the vocabulary head too, so the
  logits are bf16 (a logit near 16 moves in steps of 0.125);
- ``bf16 autocast, fp32 head``: the same body, the last hidden state cast to
  fp32 and the vocabulary head run in fp32 outside autocast;
- ``bf16 weights``: the model cast to bf16 (what an optimizer on bf16 weights
  would update).

``--sft SEEDS`` then answers whether the difference matters for learning: the
SFT of ``examples/train_alfworld_easy.yaml`` (128 expert episodes, 2 epochs,
full fine-tuning) for each seed and precision (``fp32``; ``bf16`` as agentrl
runs it now, the head in fp32; ``bf16, bf16 head``, as it ran before), each in
its own process, and its held-out greedy success on 64 ``valid_seen`` games,
with the SFT's tokens/s.

For each: the mean, 99th percentile and largest ``|logp - logp_fp32|`` and
``|logp - logp_sampler|`` over the action tokens, the mean difference (a bias),
and PPO's ratio ``exp(logp - logp_sampler)`` at step 0 (it is exactly 1 where
the trainer agrees with the sampler): its standard deviation and the fraction
of tokens outside the clip range [0.8, 1.2]; and the seconds of one forward and
backward over ``--tokens`` tokens (``--reps`` repeats, median). Writes
``bench/precision.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from agentrl.config import Config
from agentrl.models import load_model
from agentrl.policy import HFPolicy
from agentrl.rollout import collect
from agentrl.types import Episode

EASY = {"max_steps": 10, "families": ["pick_and_place_simple"], "max_receptacles": 6}
TEMPERATURE = 0.7


def episodes(model, tok, n: int, group: int) -> list[Episode]:
    cfg = Config.model_validate({
        "sampling": {"temperature": TEMPERATURE, "max_new_tokens": 20, "stop": ["\n"]},
        "rollout": {"group_size": group, "max_turns": 10, "max_context_tokens": 2048, "seed": 0},
        "env": {"id": "agentrl/ALFWorld-v0", "kwargs": EASY}})
    trees = collect("agentrl/ALFWorld-v0", HFPolicy(model, tok), cfg, seeds=list(range(n)))
    return [Episode.from_path(t.path(leaf.id)) for t in trees for leaf in t.leaves()]


def head_logits(model, ids: torch.Tensor, variant: str) -> torch.Tensor:
    """Logits ``[1, T, V]`` (fp32) of one sequence under a precision variant."""
    if variant == "fp32":
        return model(input_ids=ids).logits.float()
    if variant == "bf16 autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=ids).logits.float()
    if variant == "bf16 autocast, fp32 head":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = model.model(input_ids=ids).last_hidden_state
        with torch.autocast("cpu", enabled=False):
            return model.lm_head(hidden.float())
    if variant == "bf16 weights":
        return model(input_ids=ids).logits.float()
    raise ValueError(variant)


def action_logprobs(model, ep: Episode, variant: str) -> torch.Tensor:
    ids = torch.tensor([ep.input_ids])
    logits = head_logits(model, ids, variant)[0, :-1]
    logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    lp = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
    mask = torch.tensor(ep.loss_mask[1:], dtype=torch.bool)
    return lp[mask]


def update_seconds(model, variant: str, tokens: int, reps: int) -> float:
    ids = torch.randint(100, 49000, (1, tokens))
    out = []
    for _ in range(reps + 1):
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        logits = head_logits(model, ids, variant)[0, :-1]
        loss = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).mean()
        loss.backward()
        out.append(time.perf_counter() - t)
    return statistics.median(out[1:])  # the first is warm-up


def summarize(d: torch.Tensor) -> dict:
    a = d.abs()
    return {"mean_abs": round(a.mean().item(), 5), "p99_abs": round(a.quantile(0.99).item(), 5),
            "max_abs": round(a.max().item(), 5), "mean": round(d.mean().item(), 6)}


SFT_VARIANTS = {  # the overrides of each SFT variant (train.compile auto would compile bf16 on an AMX CPU)
    "fp32": ["train.precision=fp32", "train.compile=false"],
    "bf16": ["train.precision=bf16", "train.compile=false"],
    "bf16, bf16 head": ["train.precision=bf16", "train.compile=false"],
    "bf16+compile": ["train.precision=bf16", "train.compile=true"],  # agentrl.train.compiled
}


def sft_child(variant: str, seed: int, out: str) -> None:
    """One SFT of the easy ALFWorld recipe at one precision; prints its row as JSON."""
    import agentrl.train.logprobs as logprobs
    from agentrl.train.config import load_train_config
    from agentrl.train.trainer import train

    if variant == "bf16, bf16 head":  # the head back under autocast: the old bf16
        logprobs.fp32_head = lambda model: contextlib.nullcontext()
    recipe = Path(__file__).resolve().parents[1] / "examples" / "train_alfworld_easy.yaml"
    cfg = load_train_config(recipe, ["train.steps=0", "train.evaluation.start=false", f"train.seed={seed}",
                                     *SFT_VARIANTS[variant], f"train.output.dir={out}",
                                     "train.checkpointing.export_hf=false", "train.output.plot=false", "train.output.tensorboard=false"])
    t = time.perf_counter()
    result = train(cfg, progress=False)
    rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    sft = next(r for r in rows if "sft/tokens_per_s" in r)
    print(json.dumps({"variant": variant, "seed": seed, "micro_batch_tokens": cfg.train.micro_batch_tokens,
                      "success": result["phases"]["after_sft"],
                      "sft_tokens_per_s": round(sft["sft/tokens_per_s"], 1),
                      "nll_after": round(sft["sft/nll_after"], 4), "wall_s": round(time.perf_counter() - t, 1)}))


def sft_rows(seeds: int, variants: list[str]) -> list[dict]:
    rows = []
    for seed in range(seeds):
        for variant in variants:
            with tempfile.TemporaryDirectory() as out:
                r = subprocess.run([sys.executable, __file__, "--child-sft", variant, str(seed), out],
                                   capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"SFT {variant} seed {seed} failed: {r.stderr[-3000:]}")
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny-random, 2 x 2 episodes, 256 tokens, 1 rep")
    ap.add_argument("--sft", type=int, default=0, metavar="SEEDS", help="also SFT at each precision, per seed")
    ap.add_argument("--sft-variants", default=",".join(SFT_VARIANTS),
                    help=f"which SFT precisions, of {list(SFT_VARIANTS)}")
    ap.add_argument("--sft-only", action="store_true",
                    help="only the SFT rows, written into the existing JSON's 'sft' (the rest kept)")
    ap.add_argument("--child-sft", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = ap.parse_args()
    if args.child_sft:
        return sft_child(args.child_sft[0], int(args.child_sft[1]), args.child_sft[2])
    variants = [v.strip() for v in args.sft_variants.split(",") if v.strip()]
    if unknown := [v for v in variants if v not in SFT_VARIANTS]:
        raise SystemExit(f"--sft-variants: unknown {unknown}; choose of {list(SFT_VARIANTS)}")
    if args.sft_only:
        load = os.getloadavg()
        result = json.loads(Path(args.out).read_text())
        kept = [r for r in result.get("sft", []) if r["variant"] not in variants]  # other variants' rows stay
        result["sft"] = kept + sft_rows(args.sft or 1, variants)
        result["sft_machine"] = {"load_avg_1m": [round(load[0], 2), round(os.getloadavg()[0], 2)]}
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print_sft(result, variants)
        return
    if args.quick:
        args.model, args.episodes, args.group, args.tokens, args.reps = "tiny-random", 2, 2, 256, 1
    torch.manual_seed(0)
    load = os.getloadavg()
    model, tok = load_model(args.model)
    model.eval()
    eps = episodes(model, tok, args.episodes, args.group)
    sampler = torch.cat([torch.tensor(e.logprobs[1:])[torch.tensor(e.loss_mask[1:], dtype=torch.bool)]
                         for e in eps])
    bf16_model = copy.deepcopy(model).to(torch.bfloat16)
    rows, ref = [], None
    with torch.no_grad():
        logit_abs = torch.cat([model(input_ids=torch.tensor([e.input_ids])).logits[0].abs().amax(-1) for e in eps])
    for variant in ("fp32", "bf16 autocast", "bf16 autocast, fp32 head", "bf16 weights"):
        m = bf16_model if variant == "bf16 weights" else model
        with torch.no_grad():
            lp = torch.cat([action_logprobs(m, e, variant) for e in eps])
        ref = lp if ref is None else ref
        ratio = torch.exp(lp - sampler)
        m.train()
        sec = update_seconds(m, variant, args.tokens, args.reps)
        m.eval()
        rows.append({"variant": variant, "vs_fp32": summarize(lp - ref), "vs_sampler": summarize(lp - sampler),
                     "ratio_std": round(ratio.std().item(), 5),
                     "ratio_outside_clip": round(((ratio < 0.8) | (ratio > 1.2)).float().mean().item(), 5),
                     "fwd_bwd_s": round(sec, 3), "tokens_per_s": round(args.tokens / sec, 1)})
    result = {"model": args.model, "action_tokens": int(sampler.numel()), "episodes": len(eps),
              "max_logit_abs": {"median": round(logit_abs.median().item(), 2), "max": round(logit_abs.max().item(), 2)},
              "rows": rows, "sft": sft_rows(args.sft, variants) if args.sft else None, "args": {k: v for k, v in vars(args).items() if k != "out"},
              "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                          "load_avg_1m": [round(load[0], 2), round(os.getloadavg()[0], 2)],
                          "python": platform.python_version(), "torch": torch.__version__}}
    print(f"{args.model}: {result['action_tokens']} action tokens of {len(eps)} episodes; the largest logit of a "
          f"position: median {result['max_logit_abs']['median']}, max {result['max_logit_abs']['max']}")
    print(f"{'variant':26} {'|d| vs fp32 mean/p99/max':>28} {'|d| vs sampler mean/p99/max':>30} "
          f"{'ratio sd':>9} {'out of clip':>11} {'tok/s':>7}")
    for r in rows:
        a, b = r["vs_fp32"], r["vs_sampler"]
        print(f"{r['variant']:26} {a['mean_abs']:9.4f}/{a['p99_abs']:7.4f}/{a['max_abs']:7.4f}  "
              f"{b['mean_abs']:10.4f}/{b['p99_abs']:7.4f}/{b['max_abs']:7.4f} {r['ratio_std']:9.4f} "
              f"{r['ratio_outside_clip']:11.4f} {r['tokens_per_s']:7.0f}")
    if args.sft:
        print_sft(result, variants)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def print_sft(result: dict, variants: list[str]) -> None:
    """Each SFT precision's held-out success: mean +- standard error over the seeds."""
    for variant in variants:
        got = [r for r in result["sft"] if r["variant"] == variant]
        s = [r["success"] for r in got]
        se = statistics.stdev(s) / len(s) ** 0.5 if len(s) > 1 else float("nan")
        print(f"SFT {variant:16} held-out success {statistics.mean(s):.3f} +- {se:.3f} "
              f"(seeds: {', '.join(f'{x:.3f}' for x in s)}), {statistics.mean(r['sft_tokens_per_s'] for r in got):.0f} tok/s")


if __name__ == "__main__":
    from agentrl.cli import process_defaults

    process_defaults()  # as the agentrl command: compiled kernels in ~/.cache/agentrl/inductor
    main()
