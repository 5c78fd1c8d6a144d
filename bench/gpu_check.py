"""The GPU recipe's first check: rollout tokens/s against raw vLLM, and one training step's time and memory.

Run on a machine with one GPU, within 10 minutes (``bench/gpu_check.sh`` wraps it):

- **rollout**: the same prompts (``--prompts`` of ``--prompt-tokens`` random ids,
  at most ``--new-tokens`` each) sampled by raw ``vllm.LLM.generate`` and by
  agentrl's ``VLLMPolicy.generate`` on the same engine settings: tokens/s of each and
  their ratio (agentrl's bookkeeping: logprobs, top-k entropies, the driver thread).
  Where vLLM is not installed the rows say so and ``hf`` alone is measured.
- **hf decode**: ``HFPolicy.generate`` on the same prompts, for comparison.
- **training**: ``agentrl train`` on ``examples/train_alfworld_gpu.yaml`` shrunk to
  ``--steps`` steps of ``--tasks`` tasks x ``--group`` episodes of at most
  ``--turns`` turns, with ``policy.backend=hf`` in one process (no Ray): the
  step's rollout, update and total seconds, the trainer's tokens/s, and
  CUDA's peak allocated memory, from ``metrics.jsonl``. The first step includes
  warm-up; the table reports the last.

``--random-init`` builds Qwen2.5-1.5B's architecture (28 layers, hidden 1536, 12
heads, 2 KV heads, MLP 8960, vocabulary 151,936, tied embeddings) with random
weights and the SmolLM2 tokenizer, for a machine that cannot download the
weights: time and memory are those of the real model, success is not.
``--quick`` runs every part on CPU with the tiny model in well under a minute
(the suite's bench smoke test). Writes ``bench/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "train_alfworld_gpu.yaml"
QWEN_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                 tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6)


def random_qwen(out: Path) -> str:
    """Qwen2.5-1.5B's architecture with random weights, saved with the SmolLM2 tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agentrl.models import load_tokenizer

    tok = load_tokenizer("tiny-random")
    cfg = Qwen2Config(**QWEN_1_5B, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return str(out)


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(100, min(vocab, 49152)) for _ in range(length)] for _ in range(n)]


def hf_decode(model: str, device: str, batch: list[list[int]], new_tokens: int) -> dict:
    import torch

    from agentrl.models import load_model
    from agentrl.policy import GenerateRequest, HFPolicy, SamplingParams

    net, tok = load_model(model, dtype="bfloat16" if device == "cuda" else "float32", device=device)
    policy = HFPolicy(net, tok, max_batch_size=len(batch))
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    policy.generate([GenerateRequest(batch[0][:8], params)])  # warm-up
    t = time.perf_counter()
    out = policy.generate([GenerateRequest(p, params) for p in batch])
    dt = time.perf_counter() - t
    n = sum(len(r.token_ids) for r in out)
    del policy, net
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"backend": "hf", "tokens": n, "seconds": round(dt, 2), "tok_per_s": round(n / dt, 1)}


def vllm_rows(model: str, batch: list[list[int]], new_tokens: int, mem: float) -> list[dict]:
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return [{"backend": b, "skipped": f"vllm does not import here ({e})"} for b in ("vllm raw", "vllm agentrl")]
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt

    from agentrl.policy import GenerateRequest, SamplingParams
    from agentrl.policy.vllm import VLLMPolicy

    policy = VLLMPolicy(model, dtype="bfloat16", max_model_len=4096, enforce_eager=False,
                        gpu_memory_utilization=mem)
    rows = []
    sp = VSP(temperature=1.0, max_tokens=new_tokens)
    policy.llm.generate([TokensPrompt(prompt_token_ids=batch[0][:8])], sp, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    out = policy.llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in out)
    rows.append({"backend": "vllm raw", "tokens": n, "seconds": round(dt, 2), "tok_per_s": round(n / dt, 1)})
    policy.llm.reset_prefix_cache()
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    t = time.perf_counter()
    res = policy.generate([GenerateRequest(p, params) for p in batch])
    dt = time.perf_counter() - t
    n = sum(len(r.token_ids) for r in res)
    rows.append({"backend": "vllm agentrl", "tokens": n, "seconds": round(dt, 2), "tok_per_s": round(n / dt, 1)})
    policy.close()
    return rows


def train_row(model: str, device: str, args: argparse.Namespace, out: Path) -> dict:
    sets = {"policy.backend": "hf", "policy.model": model, "policy.device": device, "distributed": "null",
            "train.steps": args.steps, "train.tasks_per_step": args.tasks, "rollout.group_size": args.group,
            "rollout.max_turns": args.turns, "sampling.max_new_tokens": args.new_tokens,
            "train.evaluation.episodes": 0, "train.evaluation.start": "false", "train.checkpointing.every": 0,
            "train.checkpointing.export_hf": "false", "train.output.plot": "false", "train.output.tensorboard": "false",
            "train.minibatch_size": args.tasks * args.group, "rollout.max_context_tokens": 4096,
            "train.micro_batch_tokens": 4096}
    # `python -m agentrl`: the package may be importable without its console script
    cmd = [sys.executable, "-m", "agentrl", "train", "--config", str(RECIPE), "--out", str(out),
           "--overwrite", "--no-progress"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    t = time.perf_counter()
    # cwd outside the checkout: `-m` puts cwd first on sys.path, where a bare checkout's
    # agentrl/ would shadow an installed agentrl (whose agentrl.tools maps tools/)
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=out.parent)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        return {"error": (r.stderr or r.stdout)[-2000:], "wall_s": round(wall, 1)}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    last = [x for x in rows if x.get("phase") == "rl"][-1]
    keep = ("train/tokens_per_s", "train/tokens", "rollout/action_tokens", "memory/peak_cuda_mb",
            "memory/peak_rss_mb")
    return {"wall_s": round(wall, 1), "steps": len([x for x in rows if x.get("phase") == "rl"]),
            **{k: round(v, 3) for k, v in last.items() if k.startswith("time/") or k in keep}}


def guarded(part: str, fn, *args) -> list[dict]:
    """One part's rows, or one row naming its error: a failing part must not hide the others'
    numbers (a GPU lease is short, and the first run on a new machine finds the bugs)."""
    import traceback

    try:
        out = fn(*args)
        return out if isinstance(out, list) else [out]
    except Exception as e:  # noqa: BLE001 - recorded, and the exit status says so
        return [{"backend": part, "error": f"{type(e).__name__}: {e}",
                 "traceback": traceback.format_exc()[-3000:]}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen/Qwen2.5-1.5B-Instruct")
    ap.add_argument("--random-init", action="store_true", help="Qwen2.5-1.5B's shapes, random weights")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    ap.add_argument("--quick", action="store_true", help="CPU, tiny model, tiny sizes (the suite's smoke test)")
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = ap.parse_args()
    import torch

    device = "cpu" if args.quick else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check needs a CUDA GPU (or --quick for the CPU dry run)")
    if args.quick:
        args.model, args.prompts, args.prompt_tokens, args.new_tokens = "tiny-random", 4, 16, 8
        args.steps, args.tasks, args.group, args.turns = 1, 2, 2, 2
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model = random_qwen(Path(tmp) / "qwen") if args.random_init else args.model
        batch = prompts(args.prompts, args.prompt_tokens, QWEN_1_5B["vocab_size"])
        t0 = time.perf_counter()
        decode = guarded("hf", hf_decode, model, device, batch, args.new_tokens)
        decode += guarded("vllm", vllm_rows, model, batch, args.new_tokens, args.gpu_memory_utilization) \
            if device == "cuda" else [{"backend": "vllm", "skipped": "--quick runs on CPU"}]
        train = guarded("train", train_row, model, device, args, Path(tmp) / "run")[0]
        total = time.perf_counter() - t0
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    result = {"model": args.model, "random_init": args.random_init, "device": device, "gpu": gpu,
              "decode": decode, "train": train, "total_s": round(total, 1),
              "args": {k: v for k, v in vars(args).items() if k != "out"},
              "cudnn_attention": os.environ.get("AGENTRL_CUDNN_ATTENTION", "0") == "1",
              "machine": {"cpu_count": os.cpu_count(), "load_avg_1m": [round(load[0], 2), round(os.getloadavg()[0], 2)],
                          "python": platform.python_version(), "torch": torch.__version__}}
    print(f"model {args.model}{' (random init)' if args.random_init else ''} on {gpu or 'cpu'}")
    print(f"{'backend':14} {'tokens':>7} {'s':>7} {'tok/s':>8}")
    for r in decode:
        if "skipped" in r or "error" in r:
            print(f"{r['backend']:14} {'skipped: ' + r['skipped'] if 'skipped' in r else 'ERROR ' + r['error']}")
        else:
            print(f"{r['backend']:14} {r['tokens']:7} {r['seconds']:7} {r['tok_per_s']:8}")
    raw = next((r for r in decode if r["backend"] == "vllm raw" and "tok_per_s" in r), None)
    ours = next((r for r in decode if r["backend"] == "vllm agentrl" and "tok_per_s" in r), None)
    if raw and ours:
        print(f"agentrl's vLLM rollouts at {ours['tok_per_s'] / raw['tok_per_s']:.2f}x raw vLLM's tokens/s")
    print("training step:", ", ".join(f"{k} {v}" for k, v in train.items()))
    print(f"total {total:.0f} s")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if any("error" in r for r in [*decode, train]):
        for r in [*decode, train]:
            if "traceback" in r or "error" in r:
                print(r.get("traceback") or r["error"], file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
