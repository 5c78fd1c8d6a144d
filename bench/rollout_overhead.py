"""Runner overhead: the multi-turn runner against bare generation on the same prompts.

1. ``runner``: ``run_episodes`` on GuessNumber, greedy; every batch of prompts it
   sends to the policy is recorded.
2. ``policy``: the same batches replayed through ``HFPolicy.generate`` alone.
   Both of these reuse each episode's keys and values across turns (a fresh
   prefix cache each); ``hf_generate`` below re-prefills every turn.
3. ``hf_generate``: the same batches through transformers' ``model.generate``
   (greedy, KV cache, same ``max_new_tokens``), the bare baseline.

Greedy decoding should make all three produce the same tokens; the bench checks
that, row by row, and reports how many rows differ (a near-tie can flip under
different batching), so the ratios measure the runner's own cost (env steps, chat deltas, trees) and our decoding loop
against transformers'. The runner's own work is also timed directly (wall time
minus time inside generate), which is steadier than the ratio on a busy machine. Prints a table and writes ``rollout_overhead.json``.

    python bench/rollout_overhead.py [--model smollm2-135m] [--episodes 8] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from agentrl.config import load_config
from agentrl.models import load_model
from agentrl.policy import GenerateRequest, HFPolicy
from agentrl.rollout import run_episodes


class RecordingPolicy(HFPolicy):
    """HFPolicy that keeps every batch it was asked to generate."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.batches: list[list[GenerateRequest]] = []
        self.outputs: list[list[list[int]]] = []
        self.gen_s = 0.0

    def generate(self, requests):
        self.batches.append(requests)
        t0 = time.perf_counter()
        out = super().generate(requests)
        self.gen_s += time.perf_counter() - t0
        self.outputs.append([r.token_ids for r in out])
        return out


def hf_generate(model, tokenizer, batch: list[GenerateRequest], eos_ids: set[int]) -> list[list[int]]:
    """Bare transformers generate on one batch (left-padded, greedy); each row's new tokens up to EOS."""
    width = max(len(r.prompt_ids) for r in batch)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])
    mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                         max_new_tokens=batch[0].params.max_new_tokens, pad_token_id=pad)
    rows = []
    for row in out[:, width:].tolist():
        ends = [i for i, t in enumerate(row) if t in eos_ids]
        rows.append(row[:ends[0] + 1] if ends else row)
    return rows


def differing_rows(a: list[list[list[int]]], b: list[list[list[int]]]) -> int:
    """How many rows of the same batches came out with different tokens."""
    return sum(x != y for ba, bb in zip(a, b, strict=True) for x, y in zip(ba, bb, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="tiny-random model, 2 episodes")
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = ap.parse_args()
    if args.quick:
        args.model, args.episodes = "tiny-random", 2
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, tok = load_model(args.model)
    cfg = load_config(overrides=[f"rollout.episodes={args.episodes}", "rollout.max_turns=8",
                                 "sampling.temperature=0",
                                 f"sampling.max_new_tokens={args.max_new_tokens}"])
    policy = RecordingPolicy(model, tok)
    run_episodes(cfg.env.id, policy, cfg)  # warm-up: first calls pay one-time costs
    policy.prefix_cache.clear()  # the timed run repeats the warm-up's prompts: start cold
    policy.batches.clear()
    policy.outputs.clear()
    policy.gen_s = 0.0
    t0 = time.perf_counter()
    trees = run_episodes(cfg.env.id, policy, cfg)
    runner_s = time.perf_counter() - t0
    tokens = sum(len(n.action_ids) for t in trees for n in t.nodes.values())

    bare = HFPolicy(model, tok)
    t0 = time.perf_counter()
    policy_out = [[r.token_ids for r in bare.generate(batch)] for batch in policy.batches]
    policy_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    hf_out = [hf_generate(model, tok, batch, policy.eos_ids) for batch in policy.batches]
    hf_s = time.perf_counter() - t0
    rows = sum(len(b) for b in policy.batches)

    result = {
        "model": args.model, "episodes": args.episodes, "turn_batches": len(policy.batches),
        "action_tokens": tokens, "runner_s": round(runner_s, 3),
        "policy_generate_s": round(policy_s, 3), "hf_generate_s": round(hf_s, 3),
        "runner_generate_s": round(policy.gen_s, 3),
        "runner_own_overhead_s": round(runner_s - policy.gen_s, 3),
        "runner_over_its_generate": round(runner_s / policy.gen_s, 3),
        "runner_over_policy": round(runner_s / policy_s, 3),
        "runner_over_hf_generate": round(runner_s / hf_s, 3),
        "tokens_per_s_runner": round(tokens / runner_s, 1),
        "rows": rows, "rows_differing_policy": differing_rows(policy.outputs, policy_out),
        "rows_differing_hf_generate": differing_rows(policy.outputs, hf_out),
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
    }
    print(f"{'path':<22}{'seconds':>10}{'ratio (runner / path)':>24}")
    print(f"{'runner':<22}{runner_s:>10.2f}{1.0:>24.2f}")
    print(f"{'HFPolicy.generate':<22}{policy_s:>10.2f}{result['runner_over_policy']:>24.2f}")
    print(f"{'transformers generate':<22}{hf_s:>10.2f}{result['runner_over_hf_generate']:>24.2f}")
    print(f"same tokens as the runner: HFPolicy.generate {rows - result['rows_differing_policy']}/{rows} rows, "
          f"transformers generate {rows - result['rows_differing_hf_generate']}/{rows} rows")
    print(f"{tokens} action tokens in {len(policy.batches)} batched turns; the runner's own work "
          f"(envs, chat deltas, trees) took {runner_s - policy.gen_s:.3f} s of {runner_s:.2f} s")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
