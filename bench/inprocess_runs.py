"""Memory across in-process runs: RSS after each of N training runs with a teacher, in one process.

``bench/learning.py`` runs a method's seeds one after another in one process;
each run must leave the next the memory it found. Here N identical GRPO + OPD
runs (a distillation teacher, and a KL reference model) train one after
another through ``agentrl.train.train`` on ``agentrl/GuessNumber-v0``. After
each run the bench records, without forcing a collection itself:

- the process's resident memory (``VmRSS``) and the run's peak (``VmHWM``);
- how many transformers models are still alive (found through ``gc``), which
  must be 0: ``train`` closes the trainer (``Trainer.close``), which lets go
  of the student, the reference, the teacher, the optimizer and the caches.

The model is a random Llama with the SmolLM2 tokenizer, built once in a
temporary folder (``--hidden``, ``--layers``; the default, 4 layers of 256,
has 15M parameters, so a leaked run would hold about 0.35 GB: student,
its gradients, reference, teacher, AdamW's two moments). The student and the teacher are
that same folder. A warm-up run first loads what a run imports once per
process; the RSS it leaves is the baseline.

Prints a table and writes ``inprocess_runs.json``.

    python bench/inprocess_runs.py [--runs 5] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from agentrl.models import load_tokenizer
from agentrl.train.config import load_train_config
from agentrl.train.trainer import train

ENV = "agentrl/GuessNumber-v0"


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _live_models() -> int:
    from transformers import PreTrainedModel

    with warnings.catch_warnings():  # isinstance on torch's lazy modules warns of their deprecations
        warnings.simplefilter("ignore")
        return sum(isinstance(o, PreTrainedModel) for o in gc.get_objects())


def _random_model(folder: Path, hidden: int, layers: int) -> Path:
    """A random Llama of the given size with the SmolLM2 tokenizer, saved as a model folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    load_tokenizer("smollm2-135m").save_pretrained(folder)
    return folder


def _cfg(model: str, out: Path, steps: int) -> Any:
    return load_train_config(None, [
        f"policy.model={model}", "policy.backend=hf", f"env.id={ENV}", "env.kwargs={high: 4, max_turns: 3}",
        "rollout.max_turns=3", "rollout.group_size=4", "rollout.max_context_tokens=256",
        "sampling.max_new_tokens=4", "train.tasks_per_step=2", "train.minibatch_size=8",
        "train.micro_batch_tokens=2048", f"train.steps={steps}", "train.evaluation.episodes=2",
        f"train.distill={{teacher: '{model}'}}", "train.loss.kl_coef=0.1", "train.output.tensorboard=true",
        "train.checkpointing.export_hf=false", "train.output.plot=false", "train.output.save_trees=0", f"train.output.dir={out}"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="the 2-layer tiny model, 2 runs of 1 step (a smoke test)")
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = ap.parse_args()
    if args.quick:
        args.runs, args.steps, args.hidden, args.layers = 2, 1, 64, 2
    torch.set_num_threads(1)
    load_at_start = os.getloadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="agentrl-inprocess-bench-") as tmp:
        model = str(_random_model(Path(tmp) / "model", args.hidden, args.layers))
        train(_cfg(model, Path(tmp) / "warm", 1), progress=False)  # imports, templates, first allocations
        baseline = _status_mb("VmRSS")
        for i in range(1, args.runs + 1):
            t0 = time.perf_counter()
            train(_cfg(model, Path(tmp) / f"run{i}", args.steps), progress=False)
            rows.append({"run": i, "wall_s": round(time.perf_counter() - t0, 2),
                         "rss_mb": round(_status_mb("VmRSS"), 1), "peak_rss_mb": round(_status_mb("VmHWM"), 1),
                         "models_alive": _live_models()})
    result = {"bench": "inprocess_runs", "env": ENV, "model": f"random Llama, {args.layers} x {args.hidden}",
              "baseline_rss_mb": round(baseline, 1), "rows": rows,
              "rss_growth_mb": round(rows[-1]["rss_mb"] - rows[0]["rss_mb"], 1),
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                          "load_avg_at_start": load_at_start, "load_avg_at_end": os.getloadavg()},
              "quick": args.quick, "args": {k: v for k, v in vars(args).items() if k != "out"}}
    print(f"GRPO + OPD runs (teacher and KL reference) in one process; baseline RSS {baseline:.0f} MB")
    print(f"{'run':>4} {'wall s':>7} {'RSS MB':>7} {'peak MB':>8} {'models alive':>12}")
    for r in rows:
        print(f"{r['run']:>4} {r['wall_s']:>7} {r['rss_mb']:>7} {r['peak_rss_mb']:>8} {r['models_alive']:>12}")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
