"""What a batch of rollout trees amounts to: success, rewards, tokens, failures; and writing it out."""

from __future__ import annotations

import json
import math
import os
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..types import Episode, Node, RolloutTree, write_trees
from .episodes import COUNTERS

__all__ = ["RESULT_FILES", "check_no_results", "episode_success", "invalid_action_frac", "make_out_dir", "summarize",
           "write_run"]


def episode_success(tree_or_episode: RolloutTree | Episode) -> bool:
    """Success of an ``Episode``, or of a tree's last leaf (a linear tree's one episode)."""
    if isinstance(tree_or_episode, Episode):
        return tree_or_episode.success
    leaves = tree_or_episode.leaves()
    return bool(leaves) and leaves[-1].success


def _reason(error: str) -> str:
    """A failure reason without its details, to count alike failures together."""
    return error.split(":")[0].split(" after ")[0][:80]


def summarize(trees: list[RolloutTree], wall_s: float) -> dict[str, Any]:
    """Success rate, mean reward, turns, tokens, exact counters and failures of a batch.

    Rates are over episodes (root-to-leaf paths). Failed episodes are counted
    with their reasons; ``success_rate`` and ``mean_reward`` cover the rest.
    ``rejected_requests`` counts allocator requests the engine could not play.
    """
    episodes = [ep for t in trees for ep in t.episodes()]
    failed = [ep for ep in episodes if ep.error]
    ok = [ep for ep in episodes if not ep.error]
    action_tokens = sum(sum(ep.loss_mask) for ep in episodes)
    nodes = [n for t in trees for n in t.nodes.values()]
    counts = {k: sum(t.meta.get("counters", {}).get(k, 0) for t in trees) for k in COUNTERS}
    stored = sum(len(n.context_ids) + len(n.action_ids) for t in trees for n in _unique_nodes(t))
    return {
        "tasks": len(trees),
        "episodes": len(episodes),
        "success_rate": sum(ep.success for ep in ok) / max(len(ok), 1),
        "mean_reward": sum(ep.total_reward for ep in ok) / max(len(ok), 1),
        "mean_turns": sum(ep.num_turns for ep in episodes) / max(len(episodes), 1),
        "invalid_action_frac": invalid_action_frac(nodes),
        "action_tokens": action_tokens,
        "tree_tokens": stored,
        "truncated_turns": sum(n.finish_reason == "length" for n in nodes),
        **counts,
        "failed_episodes": len(failed),
        "failure_reasons": dict(Counter(_reason(ep.error or "") for ep in failed)),
        # requests of the allocator that the engine could not play (the allocator's bug)
        "rejected_requests": sum(len(t.meta.get("allocation_report", {}).get("rejected_requests", ()))
                                 for t in trees),
        "wall_s": round(wall_s, 3),
        "generated_tokens_per_s": round(counts["generated_tokens"] / wall_s, 2) if wall_s > 0 else math.nan,
    }


def invalid_action_frac(nodes: list[Node]) -> float | None:
    """The fraction of turns whose env said ``info["invalid_action"]`` (e.g. ALFWorld's
    "Nothing happens."); None when the env does not say."""
    told = [n.info["invalid_action"] for n in nodes if "invalid_action" in (n.info or {})]
    return sum(map(bool, told)) / len(told) if told else None


def _unique_nodes(tree: RolloutTree) -> list[Node]:
    """Nodes, with a context that equals an earlier sibling's counted once (as ``to_dict`` stores it)."""
    out = []
    for n in tree.nodes.values():
        siblings = tree.roots if n.parent is None else tree.nodes[n.parent].children
        first = next(s for s in siblings if tree.nodes[s].context_ids == n.context_ids)
        out.append(n if first == n.id else Node(action_ids=n.action_ids))
    return out


def make_out_dir(out_dir: str | Path, key: str) -> Path:
    """Make ``out_dir`` before a run, or raise ``ConfigError`` naming ``key``: a folder that
    cannot be made (a file there, no permission) otherwise fails the run after its episodes."""
    if not str(out_dir):  # Path("") is the working directory: an unset shell variable, most likely
        raise ConfigError(f"{key} is empty: give the run a folder")
    out = Path(out_dir)
    try:  # no look first: what another process makes or removes meanwhile cannot mislead it
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # exist_ok covers a folder only: a file, or a link to nothing
        what = "a file" if out.is_file() else "a link to nothing" if out.is_symlink() else "no folder"
        raise ConfigError(f"{key}={out} is {what}, not a folder: give the run a folder") from None
    except OSError as e:  # a file on the path, no permission, a read-only filesystem
        raise ConfigError(f"{key}={out}: cannot make the folder: {e.strerror or e}") from None
    return out


RESULT_FILES = ("summary.json", "trajectories.jsonl")
"""What ``write_run`` writes: a folder holding either has a run's results."""


def check_no_results(out_dir: str | Path, key: str, overwrite: bool) -> None:
    """Raise ``ConfigError`` naming ``key`` where ``out_dir`` holds a run's results
    (``RESULT_FILES``) and ``overwrite`` is not given: a second run there replaced them silently.
    Call it holding the folder's run lock, so that no other run writes between."""
    held = [name for name in RESULT_FILES if (Path(out_dir) / name).exists()]
    if held and not overwrite:
        raise ConfigError(f"{key}={out_dir} already holds results ({', '.join(held)}): give another "
                          "folder, or --overwrite to replace them")


def _write_atomically(path: Path, write: Callable[[Path], Any]) -> None:
    """``write(tmp)`` to a temporary file of this call's own, then rename it to ``path``: two runs
    writing one folder (the default ``rollout.out_dir``) each leave a whole file, the last one wins;
    with one shared temporary name, one run's rename failed the other's after all its episodes."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")  # not mkstemp: 0600
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_run(out_dir: str | Path, trees: list[RolloutTree], summary: dict[str, Any]) -> Path:
    """Write ``trajectories.jsonl`` and ``summary.json`` into ``out_dir``, each atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_atomically(out / "trajectories.jsonl", lambda tmp: write_trees(tmp, trees))
    _write_atomically(out / "summary.json", lambda tmp: tmp.write_text(json.dumps(summary, indent=2) + "\n"))
    return out
