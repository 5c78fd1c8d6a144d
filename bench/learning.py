"""Learning curves: held-out success against env steps, five methods at one sample budget.

Every method starts from the same warm start, trains on the same task seeds
(``train.tasks_per_step`` tasks a step, ``rollout.group_size`` leaves a task),
with the same learning rate, sampling seeds and held-out evaluation:

- ``grpo``: independent episodes, trajectory-level GRPO advantages;
- ``gigpo``: independent episodes, GiGPO (episode advantage plus the
  step-level advantage of anchor-state groups, from the env's ``state_key``);
- ``tree``: TreePO-style segment trees (``segment_tree``: depth 3, width 2,
  one-turn segments, so 8 leaves a task) with TreeRL tree advantages (a
  turn's value against the root's and against its parent's);
- ``grpo_opd``: GRPO plus step-wise on-policy distillation: a teacher scores
  the student's own turns and ``weight * (log p_teacher - log p_student)`` is
  added to each action token's advantage. The teacher is a stronger SFT
  checkpoint of the same model (more expert episodes: 64 for GuessNumber;
  twice the preset's elsewhere), or with ``--teacher oracle`` the env's
  privileged planner as a one-hot teacher whose action labels the student's
  first turn off it in each episode (``signal: forward_kl``, DAgger on the
  student's own states);
- ``grpo_opsd`` (a fifth, beyond the four asked for): GRPO plus privileged
  self-distillation: the teacher is the student's own current weights, given
  the env's privileged text (GuessNumber's secret) as a system message.

The budget is equal in leaves (episodes). Trees share their first turns, so
they play fewer env steps for the same leaves; the x axis is cumulative env
steps actually played, so the plot shows both effects. Held-out success is
greedy on seeds disjoint from SFT and RL seeds, every ``--eval-every`` steps.
Every run starts from the same weights on the same held-out seeds, so step 0
is evaluated once (by the warm start's SFT, or by the first run) and shared
(``train.evaluation.start: false`` in the other runs).

Presets (``--env``):

- ``guess_number`` (default): GuessNumber 1..16 with 4 guesses, SmolLM2-135M,
  the setting of ``make run`` (``examples/train_guess_number.yaml``, less its
  distillation teacher), the same warm start (``--sft-episodes`` expert
  episodes). It fits on 2 CPU cores.
- ``alfworld_easy``: ``examples/train_alfworld_easy.yaml``, the setting of
  ``make run-alfworld``: pick-and-place in rooms of six receptacles, where the object
  must be searched for; the warm start is SFT on the observation-consistent
  expert, the OPD teacher the same SFT with twice the episodes. On 2 cores
  both SFTs take longer than the RL runs: ``--warm-start`` and ``--teacher``
  take models exported earlier (``agentrl sft`` with the preset), and the
  JSON records which. The recipe compiles its bf16 passes since 2026-12-06
  (``train.compile: auto``); the recorded ``learning_alfworld_easy*.json``
  ran uncompiled, and ``--set train.compile=false`` repeats them.
- ``webshop_easy``: ``examples/train_webshop_easy.yaml``: a 1,000-product
  shop, five results a page, the instruction on the search page only.

    python bench/learning.py                       # GuessNumber, 5 methods (about 30 min on 2 cores)
    python bench/learning.py --seeds 0,1,2         # each method from 3 sampling seeds: mean +- se
    python bench/learning.py --methods grpo,gigpo --steps 4
    python bench/learning.py --env alfworld_easy --seeds 0,1,2   # grpo, gigpo, tree, grpo_opd
    python bench/learning.py --env alfworld_easy --warm-start runs/sft64/hf --teacher runs/sft128/hf
    python bench/learning.py --quick               # tiny random model, 2 steps: a smoke test
    python bench/learning.py --deterministic       # re-runs repeat bit for bit (slower on hf)
    python bench/learning.py --env alfworld_easy --steps 9 --eval-every 3 --eval-episodes 64 --lr 2e-5 \
        --methods grpo --seeds 0 --resume --out bench/learning_alfworld_easy_9steps.json
                                                   # one run at a time, into one JSON (see below)

``--resume`` builds one comparison over several invocations, sessions or processes: it keeps
``--work-dir`` (the SFTs exported there are reused) and the runs recorded in ``--out``, runs only
the methods and seeds not recorded yet, and writes each run to ``--out`` as it finishes. It refuses
to add to a JSON made with another env, steps, config or warm start (the weights' SHA-256), so one
JSON never mixes settings. Two such benches may run side by side on the same files: locks guard the
SFTs and the JSON.

Writes ``bench/learning.json`` and ``bench/learning.png`` (GuessNumber), or
``bench/learning_<env>.json`` and ``.png``. GiGPO's runs also report how many
steps fell into anchor-state groups of two or more (``anchor``): the first
turn of a group always shares its opening state, so the later turns are the
ones that count.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve a shared CPU

import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PRESETS = {
    "guess_number": ROOT / "examples" / "train_guess_number.yaml",
    "alfworld_easy": ROOT / "examples" / "train_alfworld_easy.yaml",
    "webshop_easy": ROOT / "examples" / "train_webshop_easy.yaml",
}
METHODS = ("grpo", "gigpo", "tree", "grpo_opd", "grpo_opsd")
DEFAULT_METHODS = {"guess_number": METHODS}  # elsewhere: the four without privileged self-distillation
# What the runs recorded in one JSON share (``--resume`` refuses to mix others): the env, steps,
# the config every run trains with, where the warm start and the OPD teacher come from, OPD's weight.
IDENTITY = ("env", "base_model", "steps", "config", "warm_start_from", "teacher_from", "opd_weight")
ANCHOR_KEYS = ("anchor/steps", "anchor/steps_in_groups_of_2plus", "anchor/later_steps",
               "anchor/later_steps_in_groups_of_2plus")


def method_overrides(method: str, teacher: str | None, opd_weight: float) -> dict[str, Any]:
    """What a method changes in the shared config (nested keys)."""
    if method == "grpo":
        return {"train": {"credit": "grpo"}}
    if method == "gigpo":
        return {"train": {"credit": "gigpo"}}
    if method == "tree":
        return {"train": {"credit": "tree"},
                "rollout": {"allocator": {"name": "segment_tree", "depth": 3, "width": 2, "segment_turns": 1}}}
    if method == "grpo_opd":
        if teacher is None:
            raise ValueError("grpo_opd needs a teacher checkpoint")
        if teacher in ("expert", "oracle"):  # a scripted one-hot teacher: its action labels the student's
            # first turn off it in each episode (DAgger, on the student's own states)
            return {"train": {"credit": "grpo", "distill": {"teacher": teacher, "signal": "forward_kl",
                                                            "weight": opd_weight}}}
        return {"train": {"credit": "grpo", "distill": {"teacher": teacher, "weight": opd_weight}}}
    if method == "grpo_opsd":
        return {"train": {"credit": "grpo", "distill": {"teacher": "self", "privileged": True,
                                                         "weight": opd_weight}}}
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out.get(k) or {}, v) if isinstance(v, dict) and isinstance(out.get(k), dict | None) else v
    return out


def run_config(data: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Train one config (in this process) and return ``train``'s summary."""
    from agentrl.train.config import TrainRunConfig
    from agentrl.train.trainer import train

    cfg = TrainRunConfig.model_validate(merge(data, {"train": {"output": {"dir": str(out_dir)}}}))
    return train(cfg, overwrite=True, progress=sys.stderr.isatty())


def warm_start(base: dict[str, Any], work: Path, name: str, sft: dict[str, Any], eval_cfg: dict[str, Any],
               reuse: bool = False) -> tuple[str, dict[str, float], dict[str, float], float]:
    """SFT only (``train.steps=0``) into ``work/<name>-<config hash>``; the exported model folder,
    held-out success and mean reward before and after, and the seconds the SFT took. With ``reuse``
    (``--resume``), the SFT of the same config exported there earlier is taken as it is; a lock
    makes two benches sharing ``work`` run it once, and an SFT of other settings has its own folder."""
    data = merge(base, {"sft": sft, "train": {"steps": 0, "checkpointing": {"export_hf": True},
                                              "output": {"tensorboard": False, "plot": False},
                                              "evaluation": eval_cfg}})
    data = json.loads(json.dumps(data))
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]
    out_dir = work / f"{name}-{digest}"
    record = work / f"{out_dir.name}.json"
    work.mkdir(parents=True, exist_ok=True)
    with locked(work / f".{out_dir.name}.lock"):
        if reuse and record.exists():
            done = read_json(record)
            if done["config"] == data and Path(done["hf"], "config.json").exists():
                return done["hf"], done["phases"], done["phase_rewards"], done["seconds"]
        t0 = time.perf_counter()
        summary = run_config(data, out_dir)
        hf = Path(summary["checkpoint"]) / "hf"
        if not (hf / "config.json").exists():
            raise RuntimeError(f"the warm start exported no model at {hf}")
        seconds = round(time.perf_counter() - t0, 1)
        write_json(record, {"config": data, "hf": str(hf), "phases": summary["phases"],
                            "phase_rewards": summary["phase_rewards"], "seconds": seconds})
    return str(hf), summary["phases"], summary["phase_rewards"], seconds


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SystemExit(f"{path} is not a bench JSON ({e}); move it away, or run without --resume") from None


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Whole or not at all: a bench stopped mid-write leaves the old file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock on ``path`` (created) for the block: benches sharing a work dir or a JSON wait."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def weights_sha256(model: str) -> str | None:
    """A digest of a model folder's weight files: the runs recorded in one JSON started from the
    same weights. ``None`` for a model that is not a folder here (a hub id: its name is its identity)."""
    if not Path(model).is_dir():
        return None
    h = hashlib.sha256()
    files = sorted(p for p in Path(model).iterdir() if p.suffix in (".safetensors", ".bin"))
    if not files:
        raise FileNotFoundError(f"no weight files (.safetensors, .bin) in {model}")
    for p in files:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def claimed(path: Path):
    """Yield whether this bench holds ``path``'s lock (taken without waiting) for the block: two
    benches given the same method and seed run it once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def curve(metrics: Path, start_success: float, start_reward: float | None = None) -> list[dict[str, float]]:
    """``[{step, env_steps, episodes, success, reward}]``: held-out success (and mean episode
    reward, WebShop's score) at step 0 and at every evaluation."""
    points = [{"step": 0, "env_steps": 0, "episodes": 0, "success": start_success, "reward": start_reward}]
    env_steps = episodes = 0
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if row.get("phase") == "rl":
            env_steps += row.get("rollout/env_steps", 0)
            episodes += row.get("rollout/episodes", 0)
        if "eval/success" in row and row.get("phase") in ("rl", "end"):
            if points[-1]["step"] == row["step"]:
                continue
            points.append({"step": row["step"], "env_steps": env_steps, "episodes": episodes,
                           "success": row["eval/success"], "reward": row.get("eval/reward")})
    return points


def step_stats(metrics: Path) -> dict[str, Any]:
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    rl = [r for r in rows if r.get("phase") == "rl"]
    mean = lambda k: sum(r.get(k, 0.0) for r in rl) / max(len(rl), 1)  # noqa: E731
    anchor = {k.split("/", 1)[1]: sum(r.get(k, 0) for r in rl) for k in ANCHOR_KEYS if any(k in r for r in rl)}
    return {"anchor": anchor, "rollout_success_mean": mean("rollout/success"),
            "env_steps": sum(r.get("rollout/env_steps", 0) for r in rl),
            "generated_tokens": sum(r.get("rollout/generated_tokens", 0) for r in rl),
            "episodes": sum(r.get("rollout/episodes", 0) for r in rl),
            "rollout_s": sum(r.get("time/rollout_s", 0.0) for r in rl),
            "train_s": sum(r.get("time/train_s", 0.0) + r.get("time/old_logprobs_s", 0.0) for r in rl)}


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's runs (one a seed): the mean curve with its standard error, mean stats, and the runs.

    The standard error is over the RL seeds only: every seed starts from the same
    warm start and is evaluated on the same held-out tasks, so step 0's is 0."""
    n = len(runs)
    steps = [p["step"] for p in runs[0]["curve"]]
    for r in runs:
        if [p["step"] for p in r["curve"]] != steps:
            raise ValueError(f"seed {r['seed']} was evaluated at steps {[p['step'] for p in r['curve']]}, "
                             f"seed {runs[0]['seed']} at {steps}")

    def mean(xs: list[float]) -> float:
        return round(sum(xs) / n, 4)

    def se(xs: list[float]) -> float:  # standard error of the mean across seeds (0 for one seed)
        if n < 2:
            return 0.0
        m = sum(xs) / n
        return round((sum((x - m) ** 2 for x in xs) / (n - 1) / n) ** 0.5, 4)

    points = []
    for k, p in enumerate(runs[0]["curve"]):
        succ = [r["curve"][k]["success"] for r in runs]
        rew = [r["curve"][k].get("reward") for r in runs]
        points.append({"step": p["step"], "env_steps": mean([r["curve"][k]["env_steps"] for r in runs]),
                       "episodes": mean([r["curve"][k]["episodes"] for r in runs]), "success": mean(succ),
                       "success_se": se(succ),
                       **({"reward": mean(rew), "reward_se": se(rew)} if None not in rew else {})})
    finals = [r["final_success"] for r in runs]
    if None in finals:  # a run without a final evaluation (train.evaluation.episodes=0)
        finals = []
    stats = {k: mean([r[k] for r in runs]) for k in ("rollout_success_mean", "env_steps", "generated_tokens",
                                                      "episodes", "rollout_s", "train_s")}
    anchor = {k: sum(r["anchor"].get(k, 0) for r in runs) for k in runs[0]["anchor"]}
    if anchor.get("later_steps"):
        anchor["later_frac_in_groups_of_2plus"] = round(anchor["later_steps_in_groups_of_2plus"]
                                                        / anchor["later_steps"], 4)
    return {"curve": points, "anchor": anchor, "final_success": mean(finals) if finals else None,
            "final_success_se": se(finals) if finals else None, **stats,
            "wall_s": round(sum(r["wall_s"] for r in runs), 1), "seeds": [r["seed"] for r in runs], "runs": runs}


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def plot(results: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for method, r in results.items():
        pts = r["curve"]
        x, y = [p["env_steps"] for p in pts], [p["success"] for p in pts]
        (line,) = ax.plot(x, y, marker="o", label=method)
        if len(r.get("seeds", [])) > 1:  # the mean over seeds, +- its standard error
            ax.fill_between(x, [v - p["success_se"] for v, p in zip(y, pts, strict=True)],
                            [v + p["success_se"] for v, p in zip(y, pts, strict=True)],
                            color=line.get_color(), alpha=0.15)
    ax.set_xlabel("env steps played (cumulative)")
    ax.set_ylabel("held-out success (greedy)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", choices=sorted(PRESETS), default="guess_number")
    ap.add_argument("--methods", default=None, help="comma-separated; default: all five on "
                    "guess_number, grpo,gigpo,tree,grpo_opd elsewhere")
    ap.add_argument("--steps", type=int, default=8, help="RL steps per method")
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--eval-episodes", type=int, default=48)
    ap.add_argument("--sft-episodes", type=int, default=24, help="expert episodes of the warm start (default: guess_number 24, elsewhere the preset's)")
    ap.add_argument("--sft-epochs", type=int, default=2, help="epochs of the warm start")
    ap.add_argument("--teacher-sft-episodes", type=int, default=64, help="expert episodes of the OPD teacher")
    ap.add_argument("--opd-weight", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=2e-4, help="RL learning rate (make run's too; an "
                    "older make run's 5e-5 left greedy success flat over 8 steps)")
    ap.add_argument("--seeds", default="0", help="comma-separated train.seed values: every method runs "
                    "once a seed (its sampling streams and update order); the curves are their mean")
    ap.add_argument("--warm-start", default=None, help="an exported model (an hf/ folder) to start every "
                    "method from instead of running the preset's SFT; the first run evaluates it")
    ap.add_argument("--teacher", default=None, help="an exported model for grpo_opd's teacher instead of "
                    "the preset's SFT with twice the episodes; 'oracle' (the env's privileged planner) or "
                    "'expert' (its observation-consistent expert): a one-hot teacher whose action labels "
                    "the student's first turn off it in each episode (signal forward_kl)")
    ap.add_argument("--warm-start-reward", type=float, default=None, help="with --warm-start-success: "
                    "the mean episode reward of that evaluation")
    ap.add_argument("--warm-start-success", type=float, default=None, help="with --warm-start: its "
                    "held-out success measured earlier on the same seeds and settings (its `agentrl sft` "
                    "run's after-SFT evaluation); step 0 is then not evaluated again")
    ap.add_argument("--deterministic", action="store_true", help="rollout.deterministic=true: a re-run "
                    "gives the same curves, bit for bit, on the same machine and thread count")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run, as agentrl train --set takes it "
                         "(e.g. train.loss.agg=seq-mean-token-mean); repeatable")
    ap.add_argument("--quick", action="store_true", help="tiny random model, 2 steps, 8 eval episodes")
    ap.add_argument("--resume", action="store_true", help="keep --work-dir and the runs recorded in --out: "
                    "an SFT exported there earlier with the same config is reused, and a method and seed "
                    "recorded with the same config and warm start is not run again (each finished run is "
                    "written at once). Two benches may share --out and --work-dir: a lock guards both")
    ap.add_argument("--work-dir", default="runs/bench_learning")
    ap.add_argument("--out", default=None, help="default: bench/learning.json for guess_number, "
                    "bench/learning_<env>.json otherwise")
    args = ap.parse_args()
    if args.methods is None:
        args.methods = ",".join(DEFAULT_METHODS.get(args.env, METHODS[:4]))
    if args.out is None:
        name = "learning" if args.env == "guess_number" else f"learning_{args.env}"
        args.out = str(Path(__file__).with_name(name + ".json"))
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        method_overrides(m, "x", 1.0)  # unknown names fail before any training
    base = yaml.safe_load(PRESETS[args.env].read_text())
    (base["train"].get("output") or {}).pop("dir", None)
    base["train"].pop("distill", None)  # the preset's own teacher (make run's): each method sets its own
    eval_cfg = {"every": args.eval_every, "episodes": args.eval_episodes}
    if args.quick:
        base = merge(base, {"policy": {"model": "tiny-random"}, "train": {"top_k_layers": 1}})
        args.steps, eval_cfg = 2, {"every": 1, "episodes": 8}
        args.sft_episodes, args.teacher_sft_episodes = 4, 8
    base = merge(base, {"train": {"steps": args.steps, "optimizer": {"lr": args.lr},
                                  "output": {"tensorboard": False}, "checkpointing": {"export_hf": False},
                                  "evaluation": eval_cfg}})
    if args.deterministic:
        base = merge(base, {"rollout": {"deterministic": True}})
    if args.set:  # a variant of every method (the JSON's config records it)
        from agentrl.config import apply_overrides

        base = apply_overrides(base, args.set)
    work = Path(args.work_dir)
    if work.exists() and not args.resume:
        shutil.rmtree(work)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    sft_base = dict(base.get("sft") or {})
    if args.env == "guess_number":  # the weak warm start; the teacher gets the make-run SFT
        warm_sft = {**sft_base, "episodes": args.sft_episodes, "seed_start": 0, "epochs": args.sft_epochs}
        teacher_sft = {**sft_base, "episodes": args.teacher_sft_episodes, "seed_start": 0, "epochs": 2}
    else:  # the preset's warm start (or --sft-episodes given); the teacher sees twice the expert episodes
        if "--sft-episodes" in sys.argv:
            sft_base["episodes"] = args.sft_episodes
        warm_sft = sft_base
        teacher_sft = {**sft_base, "episodes": 2 * int(sft_base.get("episodes", 0) or 0)}
    if args.warm_start_success is not None and not args.warm_start:
        ap.error("--warm-start-success goes with --warm-start")
    seeds = [int(x) for x in args.seeds.split(",") if x]
    if not seeds or len(set(seeds)) != len(seeds):
        ap.error(f"--seeds needs distinct seeds, got {args.seeds!r}")

    # What every run recorded in one JSON shares: checked (--resume) before any SFT runs
    cfg_used = merge(base, {"policy": {"model": "<warm start>"}, "sft": {"episodes": 0, "task_seeds": None}})
    identity = json.loads(json.dumps({
        "env": args.env, "base_model": base["policy"]["model"], "steps": args.steps, "config": cfg_used,
        "warm_start_from": args.warm_start or warm_sft, "teacher_from": args.teacher or teacher_sft,
        "opd_weight": args.opd_weight}))
    lock = out.with_name(f".{out.name}.lock")
    if args.resume:
        with locked(lock):
            recorded_runs(out, identity)

    if args.warm_start:  # made earlier (say by `agentrl sft` with the preset): its success comes from the runs
        warm, phases, rewards = args.warm_start, {"start": None, "after_sft": args.warm_start_success}, {}
        warm_sft, seconds = {"model": args.warm_start, "success_given": args.warm_start_success is not None}, 0.0
    else:
        warm, phases, rewards, seconds = warm_start(base, work, "warm_start", warm_sft, eval_cfg, reuse=args.resume)
    warm_success = phases["after_sft"]
    warm_reward = args.warm_start_reward if args.warm_start else rewards.get("after_sft")
    report: dict[str, Any] = {"base_model_success": phases["start"],
                              "warm_start": {"sft": warm_sft, "success": warm_success,
                                             "weights_sha256": weights_sha256(warm), "seconds": seconds}}
    teacher = args.teacher
    if teacher:
        report["teacher"] = {"model": teacher}
    elif "grpo_opd" in methods:
        teacher, phases, _, seconds = warm_start(base, work, "teacher", teacher_sft, eval_cfg, reuse=args.resume)
        report["teacher"] = {"sft": teacher_sft, "success": phases["after_sft"], "seconds": seconds}
    if teacher and teacher not in ("expert", "oracle"):
        report["teacher"]["weights_sha256"] = weights_sha256(teacher)

    start = merge(base, {"policy": {"model": warm}, "sft": {"episodes": 0, "task_seeds": None}})
    report.update(identity)
    recorded: dict[str, dict[int, dict[str, Any]]] = {}
    if args.resume:
        with locked(lock):
            recorded = recorded_runs(out, report)
        if warm_success is None and recorded:  # a given warm start, evaluated by an earlier run
            warm_success = report["warm_start"]["success"]
            warm_reward = next(iter(next(iter(recorded.values())).values()))["curve"][0].get("reward")
    wrote = False
    for m in methods:
        for seed in seeds:
            with claimed(work / m / f".seed{seed}.lock") as mine:
                if args.resume and mine:  # recorded by another bench since this one started?
                    with locked(lock):
                        recorded = recorded_runs(out, report)
                if seed in recorded.get(m, {}) or not mine:
                    print(f"{m} seed {seed}: " + (f"recorded in {out} by an earlier run" if mine else
                                                  "being run by another bench") + ", not run here", flush=True)
                    continue
                run = one_run(m, seed, start, teacher, args.opd_weight, work, warm_success, warm_reward)
            if warm_success is None:  # a given warm start: every run's step 0
                warm_success = report["warm_start"]["success"] = run["curve"][0]["success"]
                warm_reward = run["curve"][0].get("reward")
            print(f"{m} seed {seed}: held-out success {run['curve'][0]['success']:.3f} -> "
                  f"{_num(run['final_success'])} in {run['wall_s']:.0f} s", flush=True)
            with locked(lock):  # another bench may have recorded runs meanwhile
                try:
                    if args.resume:
                        recorded = recorded_runs(out, report)
                except SystemExit:  # another bench replaced the JSON: keep this run beside it
                    orphan = out.with_name(f"{out.stem}.{m}-seed{seed}.run.json")
                    write_json(orphan, {**report, "method": m, "run": run})
                    print(f"{out} changed under this bench; its {m} seed {seed} run is in {orphan}", file=sys.stderr)
                    raise
                recorded.setdefault(m, {})[seed] = run
                write_report(out, report, recorded, plot_it=not args.quick)
                wrote = True
    if args.resume:
        with locked(lock):
            recorded = recorded_runs(out, report)
    if not recorded:
        print("no run recorded")
        return
    results = {m: aggregate([r[s] for s in sorted(r)]) for m, r in sorted(recorded.items(), key=method_order)}

    per_method = ", ".join(f"{m} {r['seeds']}" for m, r in results.items())
    print(f"\nmean over seeds (per method: {per_method})")
    print(f"{'method':<10}{'start':>7}{'final':>7}{'+-se':>7}{'best':>7}{'env steps':>11}{'episodes':>10}"
          f"{'gen tokens':>12}{'rollout s':>11}{'train s':>9}")
    for m, r in results.items():
        best = max(p["success"] for p in r["curve"])
        print(f"{m:<10}{r['curve'][0]['success']:>7.3f}{_num(r['final_success']):>7}{_num(r['final_success_se']):>7}"
              f"{best:>7.3f}{r['env_steps']:>11.0f}{r['episodes']:>10.0f}{r['generated_tokens']:>12.0f}"
              f"{r['rollout_s']:>11.0f}{r['train_s']:>9.0f}")
    for m, r in results.items():
        a = r["anchor"]
        if a.get("later_steps"):
            print(f"{m}: {a['later_steps_in_groups_of_2plus']} of {a['later_steps']} steps after the first "
                  f"turn fell into anchor-state groups of 2 or more ({a['later_frac_in_groups_of_2plus']:.1%}); "
                  f"{a['steps_in_groups_of_2plus']} of {a['steps']} counting the first turns")
    if wrote:
        print(f"wrote {out}" + ("" if args.quick else f" and {out.with_suffix('.png')}"))


def one_run(method: str, seed: int, start: dict[str, Any], teacher: str | None, opd_weight: float, work: Path,
            warm_success: float | None, warm_reward: float | None) -> dict[str, Any]:
    """Train ``method`` from the warm start with ``train.seed=seed``: its curve and step stats."""
    t0 = time.perf_counter()
    # every run starts from the same weights on the same greedy held-out seeds: evaluate them once
    shared = {"evaluation": {"start": False}} if warm_success is not None else {}
    cfg = merge(start, merge(method_overrides(method, teacher, opd_weight), {"train": {"seed": seed, **shared}}))
    summary = run_config(cfg, work / method / f"seed{seed}")
    metrics = Path(summary["metrics"])
    return {"seed": seed, "curve": curve(metrics, summary["phases"].get("start", warm_success),
                                         summary["phase_rewards"].get("start", warm_reward)),
            "final_success": summary["phases"].get("end"), **step_stats(metrics),
            "wall_s": round(time.perf_counter() - t0, 1)}


def method_order(item: tuple[str, Any]) -> int:
    return METHODS.index(item[0]) if item[0] in METHODS else len(METHODS)


def recorded_runs(out: Path, report: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """``{method: {seed: run}}`` already in ``out`` (``--resume``). They must come from the same
    ``IDENTITY`` settings and the same warm start weights (and teacher weights, for grpo_opd's), or
    mixing them would be meaningless: a ``SystemExit`` names what differs. The earlier teacher is kept
    in ``report`` when this run has none."""
    if not out.exists():
        return {}
    old = read_json(out)
    checks = [(key, old.get(key), report[key]) for key in IDENTITY]
    if "warm_start" in report:  # else checked before the warm start is made: a bench with other
        # settings stops before its SFT runs
        checks.append(("warm start's weights", (old.get("warm_start") or {}).get("weights_sha256"),
                       report["warm_start"]["weights_sha256"]))
    if "grpo_opd" in old.get("results", {}) and "teacher" in report:
        checks.append(("teacher's weights", (old.get("teacher") or {}).get("weights_sha256"),
                       report["teacher"].get("weights_sha256")))
    for what, was, now in checks:
        if was != now:
            raise SystemExit(f"--resume: {out} holds runs made with another {what}; move it away, or run "
                             f"without --resume to start over")
    if "warm_start" not in report:
        return {}
    if "teacher" not in report and "teacher" in old:
        report["teacher"] = old["teacher"]
    if report["warm_start"]["success"] is None:
        report["warm_start"]["success"] = old["warm_start"]["success"]
    return {m: {r["seed"]: r for r in res["runs"]} for m, res in old.get("results", {}).items()}


def write_report(out: Path, report: dict[str, Any], recorded: dict[str, dict[int, dict[str, Any]]],
                 plot_it: bool) -> None:
    """Write every recorded run (each method's mean over its seeds) to ``out`` and its plot: called after
    each run, so a stopped bench keeps what it finished."""
    results = {m: aggregate([r[s] for s in sorted(r)]) for m, r in sorted(recorded.items(), key=method_order)}
    seeds = sorted({s for r in recorded.values() for s in r})
    cfg = report["config"]
    full = {**report, "methods": list(results), "seeds": seeds, "results": results,
            "wall_s": round(sum(r["wall_s"] for r in results.values()) + report["warm_start"]["seconds"]
                            + (report.get("teacher") or {}).get("seconds", 0.0), 1),
            "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                        "loadavg_end": os.getloadavg()}}
    if plot_it:
        png = out.with_suffix(".png")
        counts = sorted({len(r["seeds"]) for r in results.values()})
        plot(results, png, f"{report['env']}: {report['base_model']}, "
                           f"{'/'.join(map(str, counts))} seed(s), {report['steps']} steps x "
                           f"{cfg['train']['tasks_per_step']} tasks x {cfg['rollout']['group_size']} leaves, "
                           f"eval {cfg['train']['evaluation']['episodes']} greedy")
        full["plot"] = png.name
    write_json(out, full)

if __name__ == "__main__":
    main()
