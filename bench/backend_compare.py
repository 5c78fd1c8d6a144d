"""hf against vllm on the default model: decode speed, prefix-cache hits, entropy error.

Runs with the real SmolLM2-135M, in float32 on CPU, one backend at a time:

- ``decode``: one batch of 8 chat prompts x 32 new tokens, seeded sampling.
  Each backend first warms up on a different batch, so that its prefix cache
  cannot serve the timed prompts.
- ``multiturn``: 8 prompts that share a long system prompt (about 580 tokens),
  then the 8 extended prompts of a second turn: each first-turn prompt, its
  sampled action, and a new observation. The hit rate is the share of prompt
  tokens served from the prefix cache (``cached_tokens / prompt tokens``).
  vLLM caches whole blocks only (128 tokens on CPU).
- ``entropy``: vLLM's top-20 entropy estimate against hf's exact entropy,
  teacher-forced on the tokens vLLM sampled.

Needs vLLM: run it with ``.venv-vllm/bin/python`` (see ``.ci/vllm-setup.sh``).
Prints a table and writes ``bench/backend_compare.json``.

    .venv-vllm/bin/python bench/backend_compare.py [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: spinning threads are slow on a shared CPU

import torch  # noqa: E402

from agentrl.models import load_model, prepare_model  # noqa: E402
from agentrl.policy import GenerateRequest, HFPolicy, SamplingParams  # noqa: E402
from agentrl.policy.hf import sampling_logprobs  # noqa: E402
from agentrl.policy.vllm import VLLMPolicy, topk_entropy  # noqa: E402

TASKS = ["put a clean mug in the coffee machine", "find two apples and put them in the fridge",
         "heat a potato and put it on the table", "look at the book under the desk lamp",
         "put a cool tomato in the microwave", "clean a knife and put it in a drawer",
         "put a pencil on the shelf", "examine the alarm clock with the desk lamp"]
SYSTEM = ("You are an agent in a household. Each turn you see an observation and reply with one "
          "action such as 'go to fridge 1', 'open drawer 2', 'take mug 1 from countertop 1', "
          "'put mug 1 in/on coffeemachine 1', 'heat potato 1 with microwave 1'. ") * 8


def chat(tok, task: str, system: str | None = None) -> list[int]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": task}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)


def timed(policy, reqs):
    t0 = time.perf_counter()
    out = policy.generate(reqs)
    return out, time.perf_counter() - t0


def decode_row(name, policy, tok, new_tokens: int) -> dict:
    params = [SamplingParams(max_new_tokens=new_tokens, seed=i) for i in range(8)]
    policy.generate([GenerateRequest(chat(tok, "Warm up: " + t), p) for t, p in zip(TASKS, params, strict=True)])
    out, s = timed(policy, [GenerateRequest(chat(tok, t), p) for t, p in zip(TASKS, params, strict=True)])
    n = sum(len(r.token_ids) for r in out)
    return {"backend": name, "prompts": 8, "new_tokens": n, "seconds": round(s, 2), "tok_per_s": round(n / s, 1)}


def multiturn_row(name, policy, tok) -> dict:
    params = SamplingParams(max_new_tokens=16, seed=0)
    first = [chat(tok, t, SYSTEM) for t in TASKS]
    out1, s1 = timed(policy, [GenerateRequest(p, params) for p in first])
    obs = tok.encode("\nObservation: nothing happens. Your next action?\n")
    second = [p + r.token_ids + obs for p, r in zip(first, out1, strict=True)]
    out2, s2 = timed(policy, [GenerateRequest(p, params) for p in second])

    def rate(prompts, outs):
        return round(sum(r.cached_tokens for r in outs) / sum(map(len, prompts)), 3)

    return {"backend": name, "shared_prefix_tokens": len(chat(tok, "", SYSTEM)) - 3,
            "turn1_prompt_tokens": sum(map(len, first)), "turn1_hit_rate": rate(first, out1),
            "turn1_s": round(s1, 2), "turn2_prompt_tokens": sum(map(len, second)),
            "turn2_hit_rate": rate(second, out2), "turn2_s": round(s2, 2)}


def entropy_row(vllm: VLLMPolicy, model, tok) -> dict:
    params = SamplingParams(max_new_tokens=32, seed=3, logprobs=20)
    errs, bounds, lp_diff = [], [], []
    for prompt, res in zip(prompts := [chat(tok, t) for t in TASKS[:4]],
                           vllm.generate([GenerateRequest(p, params) for p in prompts]), strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + res.token_ids])).logits[0, len(prompt) - 1:-1]
        logp = sampling_logprobs(logits, params)
        p = logp.exp()
        exact = (-(p * logp.masked_fill(p == 0, 0.0)).sum(-1)).tolist()
        chosen = logp.gather(-1, torch.tensor(res.token_ids)[:, None]).squeeze(-1).tolist()
        for est, row, h, lp, c in zip(res.entropies, res.top_logprobs, exact, res.logprobs, chosen, strict=True):
            errs.append(h - est)
            bounds.append(topk_entropy([v for _, v in row], vllm.vocab_size)[1])
            lp_diff.append(abs(lp - c))
    mean = sum(errs) / len(errs)
    return {"tokens": len(errs), "mean_exact_minus_estimate": round(mean, 4),
            "max_exact_minus_estimate": round(max(errs), 4), "mean_bound": round(sum(bounds) / len(bounds), 4),
            "max_logprob_abs_diff": float(f"{max(lp_diff):.2e}")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = ap.parse_args()
    torch.set_num_threads(2)
    model_dir = prepare_model("smollm2-135m")
    model, tok = load_model("smollm2-135m")
    rows: dict = {"decode": [], "multiturn": []}

    hf = HFPolicy(model, tok)
    rows["decode"].append(decode_row("hf", hf, tok, args.new_tokens))
    hf.prefix_cache.clear()
    rows["multiturn"].append(multiturn_row("hf", hf, tok))
    del hf

    t0 = time.perf_counter()
    vllm = VLLMPolicy(str(model_dir), max_model_len=2048)
    rows["vllm_start_s"] = round(time.perf_counter() - t0, 1)
    rows["decode"].append(decode_row("vllm", vllm, tok, args.new_tokens))
    vllm.llm.reset_prefix_cache()
    rows["multiturn"].append(multiturn_row("vllm", vllm, tok))
    rows["entropy"] = entropy_row(vllm, model, tok)
    vllm.close()

    rows["machine"] = {"cpu_count": os.cpu_count(), "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
                       "python": platform.python_version(), "torch": torch.__version__}
    print(f"{'backend':8} {'tokens':>7} {'s':>7} {'tok/s':>7}")
    for r in rows["decode"]:
        print(f"{r['backend']:8} {r['new_tokens']:7} {r['seconds']:7} {r['tok_per_s']:7}")
    print(f"\n{'backend':8} {'turn1 hit':>10} {'turn1 s':>8} {'turn2 hit':>10} {'turn2 s':>8}")
    for r in rows["multiturn"]:
        print(f"{r['backend']:8} {r['turn1_hit_rate']:10} {r['turn1_s']:8} {r['turn2_hit_rate']:10} {r['turn2_s']:8}")
    print(f"\nvllm start {rows['vllm_start_s']} s; entropy: {rows['entropy']}")
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
