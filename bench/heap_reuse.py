"""What keeping freed memory in the heap (``agentrl.heap``) buys make run's SFT update.

The update of ``examples/train_alfworld_easy.yaml``'s SFT on the first
``--episodes`` expert episodes (packed rows of ``train.micro_batch_tokens``,
minibatches of 8, AdamW), run ``--epochs`` times in one process; the first
epoch is warm-up and the rest are reported. Each cell is its own process, as
``agentrl`` runs: ``train.precision`` fp32 and bf16 (bf16 only on a CPU or GPU
that multiplies it natively, ``cpu_has_native_bf16``), each with
``AGENTRL_KEEP_FREED_MEMORY`` 0 and 1; a precision ``+compile`` (``bf16+compile``)
also runs the decoder layers compiled (``train.compile: true``, ``agentrl.train.compiled``). ``--rounds`` repeats the cells, the
order of 0 and 1 swapped in odd rounds, so drift in the machine's load lands
on both sides (the committed JSON ran one round, 0 first). Prints a table, writes
``bench/heap_reuse.json``: tokens/s per epoch and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(precision: str, episodes: int, epochs: int, model_name: str | None) -> dict:
    """One cell: the SFT update's tokens/s per epoch under ``precision``, and peak RSS."""
    import resource

    import torch
    import yaml

    from agentrl.heap import keep_freed_memory
    from agentrl.models import load_model
    from agentrl.train.batch import samples_from_credit, train_on_samples
    from agentrl.train.compiled import compile_mode
    from agentrl.train.config import TrainRunConfig
    from agentrl.train.loss import StepLoss
    from agentrl.train.model import make_optimizer, make_scheduler
    from agentrl.train.model import precision as run_precision
    from agentrl.train.sft import expert_trees

    precision, _, compiled = precision.partition("+")  # bf16+compile: train.compile true
    kept = keep_freed_memory()
    cfg = TrainRunConfig.model_validate(yaml.safe_load((ROOT / "examples/train_alfworld_easy.yaml").read_text()))
    model, tokenizer = load_model(model_name or cfg.policy.model)
    trees = expert_trees(cfg.env.id, tokenizer, cfg, list(range(episodes)))
    samples = samples_from_credit([(ep, [float(m) for m in ep.loss_mask]) for t in trees for ep in t.episodes()])
    optimizer = make_optimizer(model, cfg.sft.lr, cfg.train.optimizer)
    scheduler = make_scheduler(optimizer, cfg.train.optimizer, epochs * len(samples))
    rates = []
    for epoch in range(epochs):
        t0 = time.perf_counter()
        with run_precision(precision), compile_mode(compiled == "compile"):
            st = train_on_samples(model, optimizer, scheduler, samples, StepLoss(), fields=(), epochs=1,
                                  minibatch_size=cfg.sft.minibatch_size, max_tokens=cfg.train.micro_batch_tokens,
                                  max_grad_norm=cfg.train.optimizer.max_grad_norm, per_token=True,
                                  pad_id=tokenizer.pad_token_id or 0, temperature=1.0,
                                  generator=torch.Generator().manual_seed(epoch))
        rates.append(st["train/tokens"] / (time.perf_counter() - t0))
    return {"keep_freed_memory": kept, "tokens_per_epoch": st["train/tokens"], "tokens_per_s": rates,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=3, help="epochs per cell; the first is warm-up")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--model", default=None, help="the recipe's (smollm2-135m) unless given")
    ap.add_argument("--quick", action="store_true", help="tiny-random, 4 episodes, 2 epochs, fp32")
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.model, args.episodes, args.epochs, args.rounds, args.precisions = "tiny-random", 4, 2, 1, "fp32"
    if args.child:
        print(json.dumps(child(args.child, args.episodes, args.epochs, args.model)))
        return

    import torch

    from agentrl.train.model import cpu_has_native_bf16

    precisions = [p for p in args.precisions.split(",") if not p.startswith("bf16") or cpu_has_native_bf16()]
    cells: dict[str, list[float]] = {}
    raw: list[dict] = []
    for r in range(args.rounds):
        for prec in precisions:
            for keep in (("0", "1") if r % 2 == 0 else ("1", "0")):  # each order in turn
                env = {**os.environ, "AGENTRL_KEEP_FREED_MEMORY": keep, "AGENTRL_CPU_BF16": "1",
                       "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
                cmd = [sys.executable, __file__, "--child", prec, "--episodes", str(args.episodes),
                       "--epochs", str(args.epochs), *(["--model", args.model] if args.model else [])]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                res = json.loads(out.stdout.strip().splitlines()[-1])
                res.update(round=r, precision=prec, keep=keep == "1")
                raw.append(res)
                cells.setdefault(f"{prec} keep={keep}", []).extend(res["tokens_per_s"][1:])
                print(f"round {r} {prec} keep={keep}: {[round(x, 1) for x in res['tokens_per_s']]} tokens/s, "
                      f"peak RSS {res['peak_rss_mb']:.0f} MB", flush=True)
    summary = {}
    print(f"\n| precision | freed memory | tokens/s (median of {args.rounds * (args.epochs - 1)}) | "
          "peak RSS MB | gain |\n|---|---|---|---|---|")
    for prec in precisions:
        base = statistics.median(cells[f"{prec} keep=0"])
        for keep in ("0", "1"):
            med = statistics.median(cells[f"{prec} keep={keep}"])
            rss = max(x["peak_rss_mb"] for x in raw if x["precision"] == prec and x["keep"] == (keep == "1"))
            summary[f"{prec}_keep_{keep}"] = {"tokens_per_s_median": med, "peak_rss_mb": rss,
                                              "gain": med / base}
            print(f"| {prec} | {'kept in the heap' if keep == '1' else 'returned (glibc default)'} | "
                  f"{med:.1f} | {rss:.0f} | {med / base:.2f}x |")
    Path(args.out).write_text(json.dumps({
        "config": {k: v for k, v in vars(args).items() if k != "child"}, "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
        "loadavg_after": list(os.getloadavg()), "summary": summary, "raw": raw}, indent=1) + "\n")


if __name__ == "__main__":
    main()
