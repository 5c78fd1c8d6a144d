"""``agentrl report RUN [RUN_B]``: a Markdown report with PNG plots, of one run or two side by side.

It reads what a run folder holds (``agentrl.viewer.run``: trees, ``metrics.jsonl``,
the config) and writes ``report.md`` and its plots (matplotlib, Agg) into one
folder. Each section says where its numbers come from, and says so when the
run lacks them instead of leaving a blank plot:

- **learning curves**: rollout success and reward per step, with the held-out
  evaluations (``eval/*``) as points; the held-out success of each phase;
- **success per task family**: over the run's trees (family: ``meta["family"]``
  or the env's ``task_type``, else the env id);
- **tokens and turns per episode**: their distributions over the trees, and
  their means per step from the metrics;
- **branch budget** (where a tree allocator ran): the share of the budget that
  branches got against fresh episodes. In leaves it is exact: a tree's fresh
  episodes are its roots, every other leaf came from a branch. In turns and
  action tokens a node counts as fresh while it lies on its root's first-grown
  path (the lowest id child at every node) and as branch otherwise, which
  credits a segment tree's first continuation of a paused leaf to the fresh
  episode;
- **teacher-student divergence per turn** (where distillation ran): from the
  saved per-token values (``meta["token_values"]``, see
  ``agentrl.viewer.payload``), the mean of ``log pi_student - log pi_teacher``
  on the action tokens of each turn, the sampled-token estimate of the reverse
  KL; else TurnOPD's per-turn divergence mass from the newest checkpoint
  (``distill_turn_mass``); else the per-step ``distill/reverse_kl`` curve.

Text from a run (env ids, models, families from the env's info, folder and file
names) is written as text: in report.md with no HTML, link or table cell break
left in it (``_md``), and in the plots with mathtext off (``$`` is a dollar).
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..allocator_options import recorded_allocator
from ..credit_options import recorded_credit
from ..types import RolloutTree
from .curves import series
from .payload import saved_values
from .run import Run, step_order

__all__ = ["RunFacts", "gather", "write_report"]

FLAT_ALLOCATORS = ("", "independent", "pilot_commit")  # no branches: every leaf is a fresh episode
_PHASES = (("start", "start (base model)"), ("sft", "after SFT"), ("end", "end"))


# --------------------------------------------------------------------------- what a run holds


@dataclass
class RunFacts:
    """The numbers the report draws, gathered from one run."""

    name: str
    run: Run
    rows: list[dict[str, Any]]
    config: dict[str, Any]
    family: dict[str, list[int]] = field(default_factory=dict)  # family -> [successes, episodes]
    turns: list[int] = field(default_factory=list)  # per episode
    tokens: list[int] = field(default_factory=list)  # action tokens per episode
    budget: dict[Any, dict[str, float]] = field(default_factory=dict)  # step -> fresh/branch counts
    divergence: dict[Any, dict[int, list[float]]] = field(default_factory=dict)  # step -> turn -> values
    allocators: set[str] = field(default_factory=set)
    unread: list[str] = field(default_factory=list)  # trees that indexed but could not be read, and why

    @property
    def distilled(self) -> bool:
        return bool((self.config.get("train") or {}).get("distill")) or any(
            k.startswith("distill/") for r in self.rows for k in r) or bool(self.divergence)

    @property
    def branched(self) -> bool:
        return any(a not in FLAT_ALLOCATORS for a in self.allocators)


def _fresh_nodes(tree: RolloutTree) -> set[int]:
    """Nodes on each root's first-grown path: the lowest id child at every node."""
    out = set()
    for r in tree.roots:
        cur: int | None = r
        while cur is not None:
            out.add(cur)
            kids = tree.nodes[cur].children
            cur = min(kids) if kids else None
    return out


def _text(x: Any) -> str:
    """``str(x)`` that matplotlib and UTF-8 can write: a lone surrogate (``"\\ud800"`` in
    JSON, or a folder name that is not UTF-8) becomes ?."""
    return str(x).encode("utf-8", "replace").decode("utf-8")


def _tree_facts(f: RunFacts, tree: RolloutTree, step: Any) -> None:
    fam = _text(tree.meta.get("family") or next(
        (tree.nodes[r].info.get("task_type") for r in tree.roots if tree.nodes[r].info.get("task_type")), "")
        or tree.meta.get("env") or "?")
    counts = f.family.setdefault(fam, [0, 0])
    for leaf in tree.leaves():
        path = tree.path(leaf.id)
        f.turns.append(sum(not n.partial for n in path))
        f.tokens.append(sum(len(n.action_ids) for n in path))
        if not any(n.error for n in path):
            counts[0] += leaf.success
            counts[1] += 1
    f.allocators.add(str(tree.meta.get("allocator", "")))
    fresh = _fresh_nodes(tree)
    b = f.budget.setdefault(step, defaultdict(float))
    leaves = len(tree.leaves())
    b["fresh_leaves"] += len(tree.roots)
    b["branch_leaves"] += leaves - len(tree.roots)
    for n in tree.nodes.values():
        kind = "fresh" if n.id in fresh else "branch"
        b[f"{kind}_turns"] += not n.partial
        b[f"{kind}_tokens"] += len(n.action_ids)
    saved = saved_values(tree)  # entries that do not fit the tree are left out (the page names them)
    if saved is not None:  # every trained episode's values; teacher log-probs where a teacher scored
        for leaf, vals in saved.values.items():
            teacher, student = vals.get("teacher"), vals.get("student")
            if teacher is None:
                continue
            per_turn = f.divergence.setdefault(step, defaultdict(list))
            path = tree.path(leaf)
            student = student or [x for n in path for x in n.logprobs]
            i, turn, acc = 0, 0, []
            for n in path:
                k = len(n.action_ids)  # a token the update masked out (null) has no signal
                acc += [s - t for s, t in zip(student[i:i + k], teacher[i:i + k], strict=False)
                        if s is not None and t is not None]
                i += k
                if not n.partial:
                    if acc:
                        per_turn[turn].append(sum(acc) / len(acc))
                    turn, acc = turn + 1, []


def gather(path: str | Path, name: str | None = None) -> RunFacts:
    """Read one run (a folder or a trees file) into ``RunFacts``."""
    run = Run(path)
    f = RunFacts(_text(name or run.path.name), run, run.metrics, run.config)
    for s in run.summaries:
        try:
            tree = run.tree(s.index)
        except Exception as e:  # a newer writer's field, a file changed since indexing: the rest still count
            f.unread.append(f"tree {s.index} ({s.file}): {type(e).__name__}: {e}"[:300])
            continue
        _tree_facts(f, tree, s.step)
    f.budget = {k: dict(v) for k, v in f.budget.items()}
    return f


# --------------------------------------------------------------------------- plots

STYLES = ("-", "--")


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _int_x(ax: Any) -> None:
    """Steps and turns are whole numbers: no 1.25 on their axis."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _own_tmp(out: Path, name: str, suffix: str = "") -> Path:
    """A temporary name of this writer's own beside ``out/name``: two reports written into one
    folder at once must not share one (the second renamed a file the first had moved)."""
    return out / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp{suffix}"


def _save(fig: Any, out: Path, name: str) -> str:
    path = out / name
    tmp = _own_tmp(out, name, ".png")  # savefig picks the format from the suffix
    try:
        fig.tight_layout()
        fig.savefig(tmp, dpi=90)
        os.replace(tmp, path)
    except BaseException:  # Ctrl-C, a full disk: no half-written plot left in the folder
        tmp.unlink(missing_ok=True)
        raise
    finally:
        _plt().close(fig)
    return name


def _plot_curves(runs: list[RunFacts], out: Path) -> str | None:
    panels = (("success", "rollout/success", "eval/success"), ("reward", "rollout/reward", "eval/reward"))
    if not any(series(f.rows, k) for f in runs for _, *keys in panels for k in keys):
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, (title, train_key, eval_key) in zip(axes, panels, strict=True):
        for k, f in enumerate(runs):
            c = f"C{k}"
            tr, ev = series(f.rows, train_key), series(f.rows, eval_key)
            if tr:
                ax.plot(*zip(*tr, strict=True), STYLES[k % 2], color=c, label=f"{f.name}: rollouts")
            if ev:
                ax.plot(*zip(*ev, strict=True), "o", mfc="white", color=c, label=f"{f.name}: held-out")
        ax.set_title(title)
        ax.set_xlabel("step")
        _int_x(ax)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    return _save(fig, out, "learning_curves.png")


def _plot_families(runs: list[RunFacts], out: Path) -> str | None:
    fams = sorted({k for f in runs for k in f.family})
    if not fams:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(fams) * len(runs)), 3.2))
    width = 0.8 / len(runs)
    for k, f in enumerate(runs):
        rates = [f.family[x][0] / f.family[x][1] if f.family.get(x, [0, 0])[1] else 0.0 for x in fams]
        ax.bar([i + k * width for i in range(len(fams))], rates, width, label=f.name, color=f"C{k}")
    ax.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(fams))], fams, rotation=20, fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("success rate")
    ax.legend(fontsize=7)
    return _save(fig, out, "family_success.png")


_MAX_BINS = 100


def _turn_bins(turns: list[int]) -> range:
    """Histogram edges for turn counts: a bin per count up to 100; past that, 100 bins of a
    whole number of turns each (a bin per count of a 20,000-turn episode took a minute)."""
    top = max(turns) + 1
    width = max(1, math.ceil(top / _MAX_BINS))
    return range(0, top + 1) if width == 1 else range(0, _MAX_BINS * width + 1, width)


def _plot_lengths(runs: list[RunFacts], out: Path) -> str | None:
    per_step = [(f, series(f.rows, "rollout/turns"), _tokens_per_episode(f.rows)) for f in runs]
    if not any(f.turns for f in runs) and not any(t or k for _, t, k in per_step):
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.2))
    for k, f in enumerate(runs):
        c = f"C{k}"
        if f.turns:
            axes[0].hist(f.turns, bins=_turn_bins(f.turns), alpha=0.55, color=c, label=f.name)
            axes[1].hist(f.tokens, bins=20, alpha=0.55, color=c, label=f.name)
        _, turns, toks = per_step[k]
        if turns:
            axes[2].plot(*zip(*turns, strict=True), STYLES[k % 2], color=c, label=f.name)
        if toks:
            axes[3].plot(*zip(*toks, strict=True), STYLES[k % 2], color=c, label=f.name)
    titles = ("turns per episode (trees)", "action tokens per episode (trees)",
              "mean turns per step (metrics)", "mean action tokens per step (metrics)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title, fontsize=9)
        if "tokens per episode" not in title:
            _int_x(ax)
        ax.grid(alpha=0.3)
        if ax.lines or ax.patches:
            ax.legend(fontsize=7)
    return _save(fig, out, "episode_lengths.png")


def _tokens_per_episode(rows: list[dict[str, Any]]) -> list[tuple[float, float]]:
    eps = dict(series(rows, "rollout/episodes"))
    return [(s, v / eps[s]) for s, v in series(rows, "rollout/action_tokens") if eps.get(s)]


def _plot_budget(runs: list[RunFacts], out: Path) -> str | None:
    shown = [f for f in runs if f.branched and f.budget]
    if not shown:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.2))
    for ax, unit in zip(axes, ("leaves", "turns", "tokens"), strict=True):
        labels, fresh, branch = [], [], []
        for f in shown:
            for step, b in sorted(f.budget.items(), key=lambda kv: step_order(kv[0])):
                total = b.get(f"fresh_{unit}", 0) + b.get(f"branch_{unit}", 0)
                labels.append(f"{f.name}\nstep {step}" if step is not None else f.name)
                fresh.append(b.get(f"fresh_{unit}", 0) / total if total else 0)
                branch.append(b.get(f"branch_{unit}", 0) / total if total else 0)
        xs = range(len(labels))
        ax.bar(xs, fresh, label="fresh episodes", color="C0")
        ax.bar(xs, branch, bottom=fresh, label="branches", color="C1")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylim(0, 1)
        ax.set_title(f"share of {unit}", fontsize=9)
        ax.legend(fontsize=7)
    return _save(fig, out, "branch_budget.png")


def _turn_mass(f: RunFacts) -> list[float]:
    got = f.run.checkpoint_state.get("distill_turn_mass")
    return [float(x) for x in got] if isinstance(got, list) else []


def _plot_divergence(runs: list[RunFacts], out: Path) -> tuple[str | None, list[str]]:
    shown = [f for f in runs if f.distilled]
    if not shown:
        return None, []
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    notes = []
    for k, f in enumerate(shown):
        if f.divergence:
            steps = sorted(f.divergence, key=step_order)
            for j, step in enumerate(dict.fromkeys([steps[0], steps[-1]])):
                turns = sorted(f.divergence[step])
                ax.plot([t + 1 for t in turns], [sum(v) / len(v) for v in (f.divergence[step][t] for t in turns)],
                        STYLES[j % 2], marker="o", color=f"C{k}", label=f"{f.name}, step {step}")
            notes.append(f"{f.name}: mean log pi_student - log pi_teacher on each turn's action tokens, "
                         "from the saved per-token values")
        elif mass := _turn_mass(f):
            ax.bar([t + 1 + 0.4 * k for t in range(len(mass))], mass, 0.4, color=f"C{k}", label=f.name)
            notes.append(f"{f.name}: TurnOPD's per-turn divergence mass from the newest checkpoint "
                         "(the saved trees carry no teacher log-probs)")
        elif kl := series(f.rows, "distill/reverse_kl"):
            ax.plot(*zip(*kl, strict=True), STYLES[k % 2], color=f"C{k}", label=f"{f.name}: per step")
            notes.append(f"{f.name}: per turn is not recorded (its saved trees carry no teacher log-probs: "
                         "saved by an older trainer, or train.output.save_trees=0; no TurnOPD statistics); the "
                         "plot shows distill/reverse_kl per step instead, x = step")
    if not ax.lines and not ax.patches:
        _plt().close(fig)
        return None, notes + ["distillation ran, but nothing per turn or per step was recorded"]
    ax.set_xlabel("turn (or step, where noted)")
    _int_x(ax)
    ax.set_ylabel("teacher-student divergence")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, out, "distill_per_turn.png"), notes


# --------------------------------------------------------------------------- the Markdown


def _md(text: Any) -> str:
    """Run text as Markdown text: one line (a newline ends a table row), ``\\ [ ] |``
    escaped (no link, no cell break), ``< > &`` as entities (no HTML), a lone surrogate as ?."""
    s = re.sub(r"([\\\[\]|])", r"\\\1", " ".join(str(text).split()))
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _text(s)


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:.{digits}f}" if isinstance(x, float) else _md(x)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(_md(h) for h in header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return out + [""]


def _phase(rows: list[dict[str, Any]], phase: str) -> float | None:
    got = [r["eval/success"] for r in rows if r.get("phase") == phase and "eval/success" in r]
    if phase == "end" and not got:
        got = [r["eval/success"] for r in rows if "eval/success" in r][-1:]
    return got[-1] if got else None


def _about(f: RunFacts) -> list[Any]:
    cfg, train = f.config, f.config.get("train") or {}
    rl = [r for r in f.rows if r.get("phase") == "rl"]
    wall = sum(v for r in f.rows for k, v in r.items() if k.startswith("time/") and isinstance(v, int | float))
    succ = series(rl, "rollout/success")
    return [
        (cfg.get("env") or {}).get("id") or next((s.env for s in f.run.summaries if s.env), "–"),
        (cfg.get("policy") or {}).get("model", "–"),
        recorded_allocator(cfg.get("rollout") or {})[0] or ", ".join(sorted(a for a in f.allocators if a)) or "–",
        recorded_credit(train)[0] if train else "–",
        (train.get("distill") or {}).get("teacher", "–") if train.get("distill") else "–",
        len(rl), len(f.run), len(f.turns),
        f"{succ[0][1]:.3f} → {succ[-1][1]:.3f}" if succ else "–",
        _fmt(_phase(f.rows, "start")), _fmt(_phase(f.rows, "sft")), _fmt(_phase(f.rows, "end")),
        f"{wall:.0f}" if wall else "–",
    ]


_ABOUT = ["env", "model", "allocator", "credit", "distillation teacher", "RL steps", "trees", "episodes in trees",
          "rollout success (first → last step)", "held-out: start", "held-out: after SFT", "held-out: end",
          "seconds logged"]


def _markdown(runs: list[RunFacts], plots: dict[str, str | None], notes: list[str]) -> str:
    names = [f.name for f in runs]
    title = " vs ".join(names)
    md = [f"# Run report: {_md(title)}", "",
          "Written by `agentrl report`; every number comes from the run folder" +
          (" of each run" if len(runs) > 1 else "") + ": `metrics.jsonl`, its trees and its config.", ""]
    md += _table(["", *names], [[k, *(a[i] for a in (_about(f) for f in runs))] for i, k in enumerate(_ABOUT)])
    for f in runs:
        if f.run.skipped:
            md += [_md(f"{f.name}: {f.run.skipped_note} (their trees are left out)."), ""]
        if f.unread:
            n = len(f.unread)
            md += [_md(f"{f.name}: {n} tree{'s' if n > 1 else ''} could not be read (left out): "
                       + "; ".join(f.unread[:5]) + (f" and {n - 5} more" if n > 5 else "")), ""]
    md += ["## Learning curves", ""]
    if plots["curves"]:
        md += [f"![learning curves]({plots['curves']})", "",
               "Lines: the step's rollouts (`rollout/success`, `rollout/reward`). Points: held-out "
               "evaluations (`eval/*`), on task seeds disjoint from training.", ""]
    else:
        md += ["No `metrics.jsonl` rows with rollout or held-out success (a run of `agentrl rollout` "
               "has none; `agentrl train` writes them).", ""]
    md += ["## Success per task family", ""]
    fams = sorted({k for f in runs for k in f.family})
    if fams:
        md += [f"![success per family]({plots['families']})", ""]
        md += _table(["family", *[f"{n}: success (episodes)" for n in names]],
                     [[x, *(f"{f.family[x][0] / f.family[x][1]:.3f} ({f.family[x][1]})" if f.family.get(x, [0, 0])[1]
                            else "–" for f in runs)] for x in fams])
        md += ["Over every episode of the run's trees that did not fail; the family is the task's "
               "`task_type` where the env reports one, else the env id.", ""]
    else:
        md += ["The run holds no trees. `agentrl rollout` writes `trajectories.jsonl`; a training run "
               "holds trees once the trainer saves them (`trees/step-*.jsonl`).", ""]
    md += ["## Tokens and turns per episode", ""]
    if plots["lengths"]:
        md += [f"![tokens and turns]({plots['lengths']})", ""]
        md += _table(["", *names], [
            ["mean turns (trees)", *(sum(f.turns) / len(f.turns) if f.turns else None for f in runs)],
            ["mean action tokens (trees)", *(sum(f.tokens) / len(f.tokens) if f.tokens else None for f in runs)],
            ["max turns (trees)", *(max(f.turns) if f.turns else None for f in runs)]])
    else:
        md += ["Neither trees nor per-step turn counts in this run.", ""]
    md += ["## Branch budget", ""]
    if plots["budget"]:
        md += [f"![branch budget]({plots['budget']})", ""]
        rows = []
        for f in runs:
            if not f.branched:
                continue
            tot = defaultdict(float)
            for b in f.budget.values():
                for k, v in b.items():
                    tot[k] += v
            share = lambda u, t=tot: t[f"branch_{u}"] / (t[f"branch_{u}"] + t[f"fresh_{u}"]) \
                if t[f"branch_{u}"] + t[f"fresh_{u}"] else None  # noqa: E731
            rows.append([f.name, ", ".join(sorted(a for a in f.allocators if a)),
                         share("leaves"), share("turns"), share("tokens")])
        md += _table(["run", "allocator", "branch share of leaves", "of turns", "of action tokens"], rows)
        md += ["Leaves: exact (a tree's fresh episodes are its roots). Turns and tokens: a node counts "
               "as fresh while it lies on its root's first-grown path.", ""]
    elif not any(len(f.run) for f in runs):
        md += ["The run holds no trees, and the share of the budget is counted on them (allocator: "
               + _md(", ".join(recorded_allocator(f.config.get("rollout") or {})[0] or "not recorded" for f in runs))
               + ").", ""]
    else:
        md += ["No tree allocator ran (" + _md(", ".join(sorted({a or "none recorded" for f in runs
                                                                for a in f.allocators})))
               + "): every episode was a fresh one.", ""]
    md += ["## Teacher-student divergence per turn", ""]
    if plots["divergence"]:
        md += [f"![divergence per turn]({plots['divergence']})", ""]
    if notes:
        md += [f"- {_md(n)}" for n in notes] + [""]
    if not plots["divergence"] and not notes:
        md += ["Distillation did not run (`train.distill` is null).", ""]
    return "\n".join(md)


def write_report(paths: list[str | Path], out: str | Path | None = None) -> Path:
    """Write ``report.md`` and its PNGs for one run, or two side by side; returns the .md path.

    ``out`` defaults to ``RUN/report`` (one run) or ``RUN_A/report-vs-<B>`` (two).
    """
    if not 1 <= len(paths) <= 2:
        raise ValueError(f"give one run or two, not {len(paths)}")
    names = [Path(p).name or str(p) for p in paths]
    if len(names) == 2 and names[0] == names[1]:
        names = [str(Path(p)) for p in paths]
    runs = [gather(p, n) for p, n in zip(paths, names, strict=True)]
    for p, f in zip(paths, runs, strict=True):  # else a report of dashes, from a mistyped folder
        if not len(f.run) and not f.run.metrics:
            raise FileNotFoundError(f"{p} holds no trees and no metrics.jsonl: not a run folder")
    base = runs[0].run.root
    folder = Path(out) if out else base / ("report" if len(runs) == 1 else f"report-vs-{Path(paths[1]).name}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file there or on the path, no permission
        raise OSError(f"cannot make the report folder {folder}: {e.strerror or e}") from None
    with _plt().rc_context({"text.parse_math": False}):  # a family named $\\x$ is text, not mathtext
        div, notes = _plot_divergence(runs, folder)
        plots = {"curves": _plot_curves(runs, folder), "families": _plot_families(runs, folder),
                 "lengths": _plot_lengths(runs, folder), "budget": _plot_budget(runs, folder), "divergence": div}
    md = folder / "report.md"
    tmp = _own_tmp(folder, "report.md")
    try:
        tmp.write_text(_markdown(runs, plots, notes) + "\n", encoding="utf-8")
        os.replace(tmp, md)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return md
