"""Row layouts of the update, timed: packed, padded, and one sequence at a time.

For each row ``pack_sequences`` makes, ``agentrl.train.rows.padding_is_cheaper``
picks by a FLOP estimate between the sequences end to end under a block-causal
mask (``packed``) and one a row, padded to the longest (``padded``). This bench
measures both, the pick (``picked``), and ``singles``: a forward and backward
for each sequence alone, which pays no padding and no masked pairs but makes
more, smaller calls (``agentrl.train.rows.forced_layout``), on:

- ``make_run_sft``: make run's SFT minibatches, 8 expert episodes of the easy
  ALFWorld level each (240-400 tokens), in rows of 2,048 tokens;
- ``uniform_L``: rows of ``2048 // L`` sequences of ``L`` tokens.

Each minibatch gets a forward and backward of SFT's loss (``minibatch_step``
with ``StepLoss``: the token-mean NLL of the action tokens) under
``train.precision`` (``--precision``); layouts are interleaved within each
repeat and the median repeat is reported. Each layout's gradient is checked
against the packed one (the largest relative difference of a parameter's
gradient), since a faster layout means nothing otherwise.

    python bench/row_layout.py                   # SmolLM2-135M, precision auto
    python bench/row_layout.py --quick           # smoke test: the tiny model, 1 repeat
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from agentrl.models import load_model
from agentrl.precision import resolved_precision
from agentrl.train.batch import Sample, minibatch_step, samples_from_credit
from agentrl.train.config import load_train_config
from agentrl.train.loss import StepLoss
from agentrl.train.model import precision
from agentrl.train.rows import LAYOUTS, forced_layout, pack_sequences, padding_is_cheaper
from agentrl.train.sft import expert_trees

ROOT = Path(__file__).resolve().parents[1]


def sft_samples(tokenizer: object, episodes: int) -> list[Sample]:
    """make run's SFT episodes (examples/train_alfworld_easy.yaml), as SFT trains them."""
    cfg = load_train_config(ROOT / "examples" / "train_alfworld_easy.yaml")
    trees = expert_trees(cfg.env.id, tokenizer, cfg, list(range(episodes)))
    return samples_from_credit([(ep, [float(m) for m in ep.loss_mask]) for t in trees for ep in t.episodes()])


def uniform_samples(length: int, n: int, vocab: int, seed: int) -> list[Sample]:
    """``n`` random sequences of ``length`` tokens, the last quarter of each the action."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(vocab) for _ in range(length)]
        mask = [int(t >= length * 3 // 4) for t in range(length)]
        out.append(Sample(ids, mask, [float(m) for m in mask], [0.0] * length, [0] * length))
    return out


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_case(model: torch.nn.Module, samples: list[Sample], batches: list[list[int]], max_tokens: int,
             pad_id: int, repeats: int) -> dict:
    """Seconds a layout takes over ``batches`` (median of ``repeats``), and its gradient's
    largest relative difference from packed's."""
    times: dict[str, list[float]] = {k: [] for k in (*LAYOUTS, "picked")}
    diff: dict[str, float] = {}
    for rep in range(repeats):
        print(f"  repeat {rep + 1}/{repeats}", flush=True)
        for name in times:
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            with forced_layout(None if name == "picked" else name):
                for idx in batches:
                    minibatch_step(model, samples, idx, StepLoss(), fields=(), per_token=True,
                                   max_tokens=max_tokens, pad_id=pad_id, temperature=1.0)
            times[name].append(time.perf_counter() - t0)
            if rep == 0:
                g = grads(model)
                if name == "packed":
                    ref = g
                diff[name] = max(float((g[k] - ref[k]).norm() / ref[k].norm().clamp(min=1e-30)) for k in ref)
    picks: dict[str, int] = {}
    for idx in batches:
        for row in pack_sequences([samples[i].input_ids for i in idx], max_tokens):
            name = "padded" if padding_is_cheaper([e - s for s, e in row.spans], model.config) else "packed"
            picks[name] = picks.get(name, 0) + 1
    tokens = sum(len(samples[i].input_ids) for idx in batches for i in idx)
    return {"tokens": tokens, "rows_picked": picks,
            "seconds": {k: statistics.median(v) for k, v in times.items()},
            "tokens_per_s": {k: tokens / statistics.median(v) for k, v in times.items()},
            "grad_max_rel_diff_vs_packed": diff}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--precision", default="auto", help="train.precision: auto, bf16 or fp32")
    p.add_argument("--episodes", type=int, default=32, help="make run SFT episodes (4 minibatches of 8)")
    p.add_argument("--lengths", default="64,128,256,512")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="the tiny model, 8 episodes, 1 repeat (smoke test)")
    p.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = p.parse_args()
    if args.quick:
        args.model, args.episodes, args.lengths, args.repeats = "tiny-random", 8, "64", 1
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    model.train()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    resolved = resolved_precision(args.precision, "cpu")
    cases: dict[str, dict] = {}
    with precision(args.precision):
        sft = sft_samples(tokenizer, args.episodes)
        print("make_run_sft", flush=True)
        cases["make_run_sft"] = run_case(model, sft, [list(range(s, min(s + 8, len(sft))))
                                                      for s in range(0, len(sft), 8)],
                                         args.max_tokens, pad, args.repeats)
        for length in map(int, args.lengths.split(",")):
            n = max(args.max_tokens // length, 2)
            print(f"uniform_{length}", flush=True)
            cases[f"uniform_{length}"] = run_case(model, uniform_samples(length, n, model.config.vocab_size, length),
                                                  [list(range(n))], args.max_tokens, pad, args.repeats)
    print(f"{'case':>14} {'tokens':>7} " + " ".join(f"{k:>9}" for k in (*LAYOUTS, "picked"))
          + "  (tokens/s; picked rows)")
    for name, c in cases.items():
        print(f"{name:>14} {c['tokens']:7d} " + " ".join(f"{c['tokens_per_s'][k]:9.1f}" for k in (*LAYOUTS, "picked"))
              + f"  {c['rows_picked']}")
    Path(args.out).write_text(json.dumps({
        "what": "forward+backward of SFT's loss per row layout (agentrl.train.rows.forced_layout; picked: "
                "padding_is_cheaper's pick), layouts interleaved, "
                "median of the repeats",
        "model": args.model, "precision": resolved, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "quick": args.quick, "date": time.strftime("%Y-%m-%d"), "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "loadavg": os.getloadavg(),
        "cases": cases}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
