"""Trainer throughput: agentrl's GRPO step against TRL's ``GRPOTrainer`` on the same batch, and its peak memory.

One step = ``--prompts`` prompts x ``--group`` completions of exactly
``--completion-tokens`` tokens (EOS is ignored on both sides so the lengths
match), random 0/1 rewards, GRPO advantages, one AdamW step on all weights
(or, for the models in ``--lora-models``, on LoRA adapters: ``trainable: lora``
through ``agentrl.train.model.make_trainable``, with ``LoraConfig``'s defaults,
r 16 on every linear layer of the decoder; agentrl only).

agentrl's step is timed in its three parts, through the trainer's own
functions:

- ``gen_s``: ``HFPolicy.generate`` of the whole batch;
- ``score_s``: ``score_old``, the no-grad old-logprob pass (PPO's anchor).
  The trainer skips it when a batch gets one optimizer step (one epoch, one
  minibatch: ``Learner.needs_scoring_pass``), as here, so it is 0 unless
  ``--score-pass`` forces it;
- ``update_s``: ``train_on_samples`` with the step's loss (one minibatch:
  forward, backward, AdamW step; padded or packed rows, whichever
  ``padding_is_cheaper`` picks, as in the trainer).

TRL's step (``GRPOTrainer``, ``num_iterations=1``, ``beta=0``, fp32, and
gradient checkpointing off like agentrl's trainer, though TRL turns it on by
default: ``--trl-gradient-checkpointing`` restores that) is timed whole,
from ``on_step_begin`` to ``on_step_end``: it includes generation, so the
comparison is agentrl's ``gen + score + update`` against it. TRL's
``gen_s`` is its ``_generate_and_score_completions`` (generation and rewards),
timed by wrapping that private method; its ``update_s`` is the rest of the step. TRL with one
iteration skips the old-logprob pass (ratio 1 by construction), and so does
agentrl's trainer.

Each (framework, model) runs in its own subprocess so its peak memory is its
own: ``peak_rss_mb`` (``getrusage`` max resident set) and, on a GPU
(``--device cuda``), ``cuda_peak_mb`` (``torch.cuda.max_memory_allocated``;
``cuda_reserved_mb``, the caching allocator's peak). Seconds are medians over the
steps after the first (warm-up). The machine is shared: the JSON records
``os.getloadavg()`` before and after.

**How near the limits.** The parent process first times its own probes on
this CPU (``--device cpu``): the peak of a matmul (``matmul_peak``: square 1024
and the model-shaped tokens x hidden x MLP product, fp32 and bf16, the best of
several repeats) and the memory bandwidth (``copy_bandwidth``: a 256 MB copy).
Each agentrl row is then run once per ``--precisions`` (``fp32``; ``bf16`` is
``train.precision: bf16``, autocast with the fp32 head; ``bf16+compile`` adds
``train.compile: true``, the decoder layers through ``torch.compile``,
``agentrl.train.compiled``) and reports:

- ``update_gflops``: ``6 * N * tokens / update_s``, N the parameters every
  token's forward and backward multiply by (the decoder's linear layers and the
  vocabulary head, embeddings left out; attention's own products are small at
  these lengths and left out too), and ``frac_of_peak``: that over the
  probe's peak of the same dtype;
- ``decode_tokens_per_s`` and ``decode_frac_of_bound``: generation reads every
  weight once per decode step, so one step cannot beat
  ``weight_bytes / bandwidth``, nor ``2 * N * rows`` FLOP at the fp32 matmul
  peak (sampling runs in fp32); the bound is the larger of the two
  (``decode_bound``: ``bandwidth`` or ``compute``), and the fraction is its
  time over the measured time per decode step (1.0 would be at the bound). At
  16 rows on 2 cores the compute bound is the larger one. Key/value-cache reads
  are left out: they matter at long prompts (docs/benchmark-notes.md).

``--no-trl`` keeps the TRL rows of the JSON it overwrites, marked
``"previous_run": true`` with that run's load and its own agentrl rows (the
step ratio is only meaningful between rows measured together).

    python bench/train_throughput.py                 # tiny-random and smollm2-135m, agentrl and TRL
    python bench/train_throughput.py --quick         # tiny-random only, small batch
    python bench/train_throughput.py --no-trl        # agentrl only; TRL's previous rows kept
    python bench/train_throughput.py --no-trl --models smollm2-135m --lora-models ''   # the precision rows
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from agentrl.cli import process_defaults

process_defaults()  # as the agentrl command: OpenMP threads that wait do not spin; compiled kernels kept

PROMPTS = [
    "Write a long story about a robot who learns to cook.",
    "List every prime number you know, one per line, and explain each.",
    "Describe, step by step, how to plan a week-long hiking trip.",
    "Explain in detail how a steam engine works.",
]


def peak_memory_mb() -> dict:
    """Peak resident memory of this process and, when a GPU was used, CUDA's peaks."""
    import torch

    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
           "cuda_peak_mb": None, "cuda_reserved_mb": None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["cuda_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
    return out


# --------------------------------------------------------------------------- the CPU's limits


def matmul_peak(dtype_name: str, shapes: tuple[tuple[int, int, int], ...], reps: int = 10) -> float:
    """GFLOP/s of the best of ``reps`` timed ``(m, k) @ (k, n)`` products per shape (the best shape)."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    best = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        for _ in range(3):
            a @ b  # warm-up: thread pool, kernel selection
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            best = max(best, 2 * m * k * n / (time.perf_counter() - t0) / 1e9)
    return best


def copy_bandwidth(mb: int = 256, reps: int = 5) -> float:
    """GB/s of the best ``dst.copy_(src)`` of ``mb`` MB (bytes read plus bytes written)."""
    import torch

    src = torch.ones(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * src.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def matmul_params(model) -> int:
    """Parameters every token multiplies by: the weights of every ``nn.Linear``, the vocabulary
    head included (a tied head is the embedding's matrix, counted here once, as a matmul)."""
    import torch

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def cpu_limits(model: str) -> dict:
    """The probes of this CPU, with the model's own MLP shape among the matmuls."""
    from agentrl.models import load_model

    c = load_model(model)[0].config
    shapes = ((1024, 1024, 1024), (2048, c.hidden_size, c.intermediate_size))
    return {"matmul_peak_gflops": {d: matmul_peak(d, shapes) for d in ("fp32", "bf16")},
            "copy_bandwidth_gbs": copy_bandwidth(), "matmul_shapes": shapes}


def grpo_advantages(rewards: list[float], group: int) -> list[float]:
    """GRPO (Shao et al. 2024, eq. 3 outcome supervision): (r - group mean) / (group std + eps)."""
    out = []
    for g in range(0, len(rewards), group):
        r = rewards[g:g + group]
        mu, sd = statistics.fmean(r), statistics.pstdev(r)
        out += [(x - mu) / (sd + 1e-4) for x in r]
    return out


def random_rewards(n: int, seed: int) -> list[float]:
    import random

    rng = random.Random(seed)
    return [float(rng.random() < 0.5) for _ in range(n)]


# --------------------------------------------------------------------------- agentrl


def cpu_features() -> dict:
    """The CPU's name and the instruction sets that decide bf16's speed (``train.precision: auto``)."""
    import torch

    caps = torch.cpu.get_capabilities()
    return {"name": caps.get("cpu_name"), **{k: bool(caps.get(k)) for k in
            ("avx2", "avx512_f", "avx512_bf16", "amx_tile", "amx_bf16")}}


def run_agentrl(args: argparse.Namespace, lora: bool = False) -> dict:
    import torch

    from agentrl.models import load_model
    from agentrl.policy.base import GenerateRequest, SamplingParams
    from agentrl.policy.hf import HFPolicy
    from agentrl.train.batch import (
        Sample,
        minibatches,
        score_old,
        shuffled_orders,
        train_on_samples,
    )
    from agentrl.train.compiled import compile_mode
    from agentrl.train.config import OptimizerConfig, TrainConfig
    from agentrl.train.loss import PolicyLossConfig, StepLoss
    from agentrl.train.model import make_optimizer, make_trainable, precision

    prec, _, compiled = args.precision.partition("+")
    if compiled not in ("", "compile"):
        raise SystemExit(f"--precisions: {args.precision!r} is not fp32, bf16 or one of them +compile")
    torch.manual_seed(0)
    model, tok = load_model(args.model, device=args.device)
    policy = HFPolicy(model, tok, max_batch_size=args.prompts * args.group)
    policy.eos_ids = set()  # fixed completion length, as TRL's min_new_tokens does on its side
    pad_id = policy.pad_id
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:args.prompts]]
    train_cfg = TrainConfig(trainable="lora" if lora else "full", optimizer=OptimizerConfig(lr=1e-6))
    trained = make_trainable(model, train_cfg)  # LoRA: adapters injected into the policy's own model
    opt = make_optimizer(trained, train_cfg.optimizer.lr, train_cfg.optimizer)
    n_trainable = sum(p.numel() for p in trained.parameters() if p.requires_grad)
    loss = StepLoss(PolicyLossConfig(), version=0)  # the learning step's loss, policy version 0

    steps = []
    for step in range(args.steps):
        reqs = [GenerateRequest(p, SamplingParams(temperature=1.0, max_new_tokens=args.completion_tokens,
                                                  seed=step * 1000 + i))
                for p in prompts for i in range(args.group)]
        t0 = time.perf_counter()
        with torch.no_grad():
            results = policy.generate(reqs)
        gen_s = time.perf_counter() - t0
        adv = grpo_advantages(random_rewards(len(reqs), step), args.group)
        samples = []
        for req, res, a in zip(reqs, results, adv, strict=True):
            n_p, n_c = len(req.prompt_ids), len(res.token_ids)
            samples.append(Sample(req.prompt_ids + list(res.token_ids), [0] * n_p + [1] * n_c,
                                  [0.0] * n_p + list(res.logprobs), [0.0] * n_p + [a] * n_c,
                                  [0] * (n_p + n_c)))
        # as the trainer does: the order drawn first, the scoring pass packing the update's rows
        orders = shuffled_orders(len(samples), 1, torch.Generator().manual_seed(step))
        score_tokens, fields = 0, ("advantages", "behaviour", "versions")
        with precision(prec), compile_mode(compiled == "compile"):
            t0 = time.perf_counter()
            if args.score_pass:
                score_tokens = score_old(model, samples, args.micro_batch_tokens, pad_id, 1.0,
                                         groups=minibatches(orders[0], len(samples)))
                fields += ("old",)
            score_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            st = train_on_samples(trained, opt, None, samples, loss, fields=fields, epochs=1,
                                  minibatch_size=len(samples), max_tokens=args.micro_batch_tokens,
                                  max_grad_norm=1.0, per_token=True, pad_id=pad_id, temperature=1.0,
                                  orders=orders)
            update_s = time.perf_counter() - t0
        policy.weights_updated()
        steps.append({"gen_s": gen_s, "score_s": score_s, "update_s": update_s,
                      "completion_tokens": sum(len(r.token_ids) for r in results),
                      "train_tokens": int(st["train/tokens"]), "score_tokens": score_tokens})
    return {"steps": steps, "trainable_params": n_trainable, "precision": prec, "variant": args.precision,
            "matmul_params": matmul_params(model), "decode_batch": len(prompts) * args.group,
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            **peak_memory_mb()}


# --------------------------------------------------------------------------- TRL


def run_trl(args: argparse.Namespace) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from agentrl.models import load_model

    torch.manual_seed(0)
    model, tok = load_model(args.model, device=args.device)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    n = args.prompts * args.group
    times: list[float] = []
    lengths: list[int] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)

    step_rewards = iter(range(10 ** 6))

    def reward(completions, completion_ids, **kw):  # same random 0/1 rewards as agentrl's batch
        lengths.append(sum(len(c) for c in completion_ids))
        return random_rewards(len(completions), next(step_rewards))

    cfg = GRPOConfig(
        output_dir="/tmp/agentrl-bench-trl", per_device_train_batch_size=n, gradient_accumulation_steps=1,
        num_generations=args.group, max_completion_length=args.completion_tokens, max_steps=args.steps,
        learning_rate=1e-6, beta=0.0, temperature=1.0, use_cpu=args.device == "cpu", bf16=False, report_to="none",
        save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True,
        gradient_checkpointing=args.trl_gradient_checkpointing,
        generation_kwargs={"min_new_tokens": args.completion_tokens},
    )
    ds = Dataset.from_dict({"prompt": [PROMPTS[i % args.prompts] for i in range(n * args.steps)]})
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds,
                          processing_class=tok, callbacks=[Clock()])
    gen_times: list[float] = []
    inner = trainer._generate_and_score_completions  # TRL's generation (+ rewards) part of a step

    def timed_generation(*a, **k):
        t0 = time.perf_counter()
        out = inner(*a, **k)
        gen_times.append(time.perf_counter() - t0)
        return out

    trainer._generate_and_score_completions = timed_generation
    trainer.train()
    return {"steps": [{"step_s": t, "gen_s": g} for t, g in zip(times, gen_times, strict=False)], "completion_tokens_seen": lengths,
            **peak_memory_mb(), "trl_version": __import__("trl").__version__}


# --------------------------------------------------------------------------- driver


def child(framework: str, model: str, args: argparse.Namespace, prec: str = "fp32") -> dict:
    cmd = [sys.executable, __file__, "--child", framework, "--models", model, "--precision", prec,
           "--prompts", str(args.prompts), "--group", str(args.group),
           "--completion-tokens", str(args.completion_tokens), "--steps", str(args.steps),
           "--micro-batch-tokens", str(args.micro_batch_tokens), "--device", args.device]
    if args.trl_gradient_checkpointing:
        cmd.append("--trl-gradient-checkpointing")
    if args.score_pass:
        cmd.append("--score-pass")
    p = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if p.returncode != 0:
        return {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"rc {p.returncode}",
                "stderr_tail": p.stderr[-2000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def med(steps: list[dict], key: str) -> float:
    xs = [s[key] for s in (steps[1:] if len(steps) > 1 else steps)]  # drop the warm-up step
    return statistics.median(xs)


MEMORY = ("peak_rss_mb", "cuda_peak_mb", "cuda_reserved_mb")


def summarize_agentrl(a: dict, limits: dict | None = None) -> dict:
    gen, score, upd = med(a["steps"], "gen_s"), med(a["steps"], "score_s"), med(a["steps"], "update_s")
    s = a["steps"][-1]
    tok_s = (s["train_tokens"] + s["score_tokens"]) / (score + upd)
    out = {}
    if "matmul_params" in a:
        gflops = 6 * a["matmul_params"] * s["train_tokens"] / upd / 1e9  # forward 2N, backward 4N a token
        step_s = gen / (s["completion_tokens"] / a["decode_batch"])  # one decode step of the whole batch
        out = {"precision": a.get("variant", a["precision"]), "update_gflops": gflops,
               "decode_tokens_per_s": s["completion_tokens"] / gen}
        if limits:
            out["frac_of_peak"] = gflops / limits["matmul_peak_gflops"][a["precision"]]
            bounds = {"bandwidth": a["weight_bytes"] / (limits["copy_bandwidth_gbs"] * 1e9),
                      "compute": 2 * a["matmul_params"] * a["decode_batch"]
                      / (limits["matmul_peak_gflops"]["fp32"] * 1e9)}
            out["decode_bound"] = max(bounds, key=bounds.get)
            out["decode_bound_step_s"] = bounds[out["decode_bound"]]
            out["decode_frac_of_bound"] = out["decode_bound_step_s"] / step_s
    return {**out, "gen_s": gen, "score_s": score, "update_s": upd, "step_s": gen + score + upd,
            "update_tokens_per_s": tok_s,
            "completion_tokens": s["completion_tokens"], "train_tokens": s["train_tokens"],
            "trainable_params": a.get("trainable_params"), **{k: a.get(k) for k in MEMORY}}


def summarize(a: dict, t: dict | None, lora: dict | None = None, limits: dict | None = None,
              extra: dict[str, dict] | None = None) -> dict:
    out: dict = {}
    if "steps" in a:
        out["agentrl"] = summarize_agentrl(a, limits)
    for prec, raw in (extra or {}).items():
        if "steps" in raw:
            out[f"agentrl_{prec}"] = summarize_agentrl(raw, limits)
    if lora is not None and "steps" in lora:
        out["agentrl_lora"] = summarize_agentrl(lora, limits)
    if t and "steps" in t and t["steps"]:
        trl_gen = med(t["steps"], "gen_s") if "gen_s" in t["steps"][0] else float("nan")
        out["trl"] = {"step_s": med(t["steps"], "step_s"), "gen_s": trl_gen,
                      "update_s": med(t["steps"], "step_s") - trl_gen,
                      **{k: t.get(k) for k in MEMORY},
                      "completion_tokens": t["completion_tokens_seen"][-1] if t["completion_tokens_seen"] else None,
                      "version": t["trl_version"]}
        if "agentrl" in out:
            out["trl_over_agentrl_step"] = out["trl"]["step_s"] / out["agentrl"]["step_s"]
    return out


def previous_trl(path: Path, model: str) -> tuple[dict | None, dict | None]:
    """The TRL row of ``model`` in the JSON at ``path`` (a run with TRL), marked as such, and its raw data."""
    if not path.exists():
        return None, None
    old = json.loads(path.read_text())
    r = old.get("results", {}).get(model, {})
    trl = r.get("summary", {}).get("trl")
    if trl is None:
        return None, None
    if trl.get("previous_run"):  # already carried over once: keep its provenance
        return trl, r.get("trl_raw")
    same_run = {k: r["summary"][k] for k in ("agentrl", "trl_over_agentrl_step") if k in r["summary"]}
    marked = {**trl, "previous_run": True,
              "measured_with": {"loadavg_before": old.get("loadavg_before"), "loadavg_after": old.get("loadavg_after"),
                                "config": old.get("config"), "platform": old.get("platform"), **same_run}}
    return marked, r.get("trl_raw")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-random,smollm2-135m")
    ap.add_argument("--lora-models", default="smollm2-135m",
                    help="models (of --models) also run with trainable: lora; '' for none")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (GRPO G)")
    ap.add_argument("--completion-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="steps per run; the first is warm-up")
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (then CUDA's peak memory is recorded)")
    ap.add_argument("--no-trl", action="store_true", help="agentrl only; keep the previous JSON's TRL rows")
    ap.add_argument("--score-pass", action="store_true",
                    help="run the old-logprob scoring pass although one optimizer step does not need it")
    ap.add_argument("--trl-gradient-checkpointing", action="store_true",
                    help="TRL's own default; off here because agentrl does not recompute activations")
    ap.add_argument("--precisions", default="fp32,bf16",
                    help="train.precision of each agentrl row (the first is the row TRL is compared with)")
    ap.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)  # a child's own
    ap.add_argument("--quick", action="store_true", help="tiny model, 2x4x16, 2 steps")
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    ap.add_argument("--child", choices=["agentrl", "agentrl-lora", "trl"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.models, args.lora_models, args.group, args.completion_tokens, args.steps = (
            "tiny-random", "", 4, 16, 2)
    if args.child:
        child_args = argparse.Namespace(**{**vars(args), "model": args.models})
        result = (run_trl(child_args) if args.child == "trl"
                  else run_agentrl(child_args, lora=args.child == "agentrl-lora"))
        print(json.dumps(result))
        return

    load_before = os.getloadavg()
    lora_models = {m for m in args.lora_models.split(",") if m}
    precisions = [p for p in args.precisions.split(",") if p]
    results = {}
    for model in args.models.split(","):
        limits = cpu_limits(model) if args.device == "cpu" else None
        a = child("agentrl", model, args, precisions[0])
        extra = {p: child("agentrl", model, args, p) for p in precisions[1:]}
        lora = child("agentrl-lora", model, args) if model in lora_models else None
        t = None if args.no_trl else child("trl", model, args)
        results[model] = {"summary": summarize(a, t, lora, limits, extra), "limits": limits,
                          "agentrl_raw": a, "agentrl_lora_raw": lora, "trl_raw": t,
                          **{f"agentrl_{p}_raw": raw for p, raw in extra.items()}}
        if args.no_trl:
            kept, raw = previous_trl(Path(args.out), model)
            if kept is not None:
                results[model]["summary"]["trl"], results[model]["trl_raw"] = kept, raw
    report = {"config": {k: v for k, v in vars(args).items() if k not in ("child", "out")},
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
              "cpu_count": os.cpu_count(), "platform": platform.platform(), "cpu": cpu_features(),
              "results": results}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")

    def mb(x: float | None) -> str:
        return f"{x:>10.0f}" if x is not None else f"{'—':>10}"

    print(f"{'model':<14}{'framework':<14}{'gen s':>8}{'score s':>9}{'update s':>10}{'step s':>9}"
          f"{'upd tok/s':>11}{'peak RSS MB':>12}{'CUDA MB':>10}")
    for model, r in results.items():
        s = r["summary"]
        rows = [("agentrl", f"agentrl {precisions[0]}", "agentrl_raw")]
        rows += [(f"agentrl_{p}", f"agentrl {p}", f"agentrl_{p}_raw") for p in precisions[1:]]
        for key, label, raw in (*rows, ("agentrl_lora", "agentrl LoRA", "agentrl_lora_raw")):
            if key in s:
                x = s[key]
                print(f"{model:<14}{label:<14}{x['gen_s']:>8.2f}{x['score_s']:>9.2f}{x['update_s']:>10.2f}"
                      f"{x['step_s']:>9.2f}{x['update_tokens_per_s']:>11.0f}{x['peak_rss_mb']:>12.0f}"
                      f"{mb(x['cuda_peak_mb'])}")
            elif r[raw] is not None:
                print(f"{model:<14}{label:<14} failed: {r[raw].get('error')}")
        if "trl" in s:
            x = s["trl"]
            label = "trl (prev)" if x.get("previous_run") else "trl"
            print(f"{model:<14}{label:<14}{x['gen_s']:>8.2f}{'':>9}{x['update_s']:>10.2f}{x['step_s']:>9.2f}{'':>11}"
                  f"{x['peak_rss_mb']:>12.0f}{mb(x.get('cuda_peak_mb'))}")
            if "trl_over_agentrl_step" in s:
                print(f"{'':<14}TRL step / agentrl step = {s['trl_over_agentrl_step']:.2f}x")
            elif x.get("previous_run") and "trl_over_agentrl_step" in x["measured_with"]:
                print(f"{'':<14}TRL step / agentrl step = {x['measured_with']['trl_over_agentrl_step']:.2f}x "
                      f"(both from the previous run, load {x['measured_with']['loadavg_before']})")
        elif r["trl_raw"] is not None:
            print(f"{model:<14}{'trl':<14} failed: {r['trl_raw'].get('error')}")
    for model, r in results.items():
        lim = r["limits"]
        if not lim:
            continue
        peak = lim["matmul_peak_gflops"]
        print(f"\n{model}: matmul peak fp32 {peak['fp32']:.0f} GFLOP/s, bf16 {peak['bf16']:.0f} GFLOP/s; "
              f"copy {lim['copy_bandwidth_gbs']:.1f} GB/s")
        print(f"{'row':<18}{'upd tok/s':>11}{'GFLOP/s':>9}{'of peak':>9}{'dec tok/s':>11}{'of bound':>10}")
        for key, x in r["summary"].items():
            if isinstance(x, dict) and "frac_of_peak" in x:
                print(f"{key:<18}{x['update_tokens_per_s']:>11.0f}{x['update_gflops']:>9.0f}"
                      f"{x['frac_of_peak']:>9.0%}{x['decode_tokens_per_s']:>11.0f}{x['decode_frac_of_bound']:>10.0%} ({x['decode_bound']})")
    print(f"load average before {load_before}, after {report['loadavg_after']}; wrote {args.out}")


if __name__ == "__main__":
    main()
