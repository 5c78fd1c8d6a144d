"""One rollout tree as the page draws it: nodes, branch reasons, advantages and tokens.

``tree_payload`` turns a ``RolloutTree`` into plain JSON data. Two things in it
are not stored on the tree and are worked out here:

**Advantages.** Training values, when the run saved them, are read from
``tree.meta["token_values"]``: ``{"<leaf id>": {"advantages": [...],
"teacher_logprobs": [...], "student_logprobs": [...]}}``, each list aligned
with the action tokens of the episode that ends at that leaf, root first (the
positions where ``Episode.loss_mask`` is 1; ``null`` on a token the update
masked out). These are what the update used, distillation included; the
trainer writes them (``agentrl.train.token_values``). An episode the update
left out is ``{"trained": false, "reason": ...}``, and its page says so.
An entry that does not fit its tree (no leaf's id, not a mapping, not one number
per action token) is left out and named in the page's credit note
(``saved_values``); with none readable, the advantages are recomputed.
Without them, the advantages are recomputed with
``agentrl.credit.assign_report`` and the run's ``train.credit`` (a run recorded
before its options moved there: ``train.credit_options``) and
``rollout.failed_episodes`` (``grpo`` when the run has no config), one tree a
group; the page says which. A node on several
episodes has one advantage per episode (group methods give each episode its
own); the page shows each and their mean.

**Branch reasons.** The engine records the allocator's name
(``meta["allocator"]``) and its report (``meta["allocation_report"]``, on the
first tree of a batch), not why it picked each node. A reason recorded on the
tree wins: ``meta["branch_reasons"]`` (``{"<node id>": reason}``) or a child's
``info["branch"]["reason"]`` (the harness proxy's retry, edit, compaction,
rerendered).
Else the reason is recomputed from the allocator's own pure scoring function
on the finished tree (``entropy_branch_scores``, ``key_states``), which reads
only the path to each turn, so branches grown later do not change it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..credit_options import recorded_credit
from ..types import Node, RolloutTree

__all__ = ["CreditSpec", "SavedValues", "branch_reasons", "credit_spec", "episode_values", "saved_values",
           "teacher_note", "tree_payload", "untrained_episodes"]

_ACTION_HEAD = 80  # characters of each action an episode's summary keeps
_SHOWN_INFO_SKIP = ("tool_calls", "tool_messages", "parse_errors", "truncation_reason", "branch")
_INFO_LISTS = ("tool_calls", "tool_messages", "parse_errors")  # info keys read as lists


@dataclass(slots=True)
class CreditSpec:
    """How advantages are recomputed for a run without saved training values."""

    method: str = "grpo"
    options: dict[str, Any] = field(default_factory=dict)
    failed: str = "exclude"
    source: str = "no run config: grpo, the trainer's default"


def credit_spec(config: dict[str, Any]) -> CreditSpec:
    """The credit method of a run config (plain data, as ``Run.config`` gives it)."""
    train = config.get("train") or {}
    failed = (config.get("rollout") or {}).get("failed_episodes", "exclude")
    if not train:
        return CreditSpec(failed=failed)
    method, options = recorded_credit(train)
    return CreditSpec(method, options, failed, f"recomputed with train.credit={method}")


# --------------------------------------------------------------------------- advantages


def _spread(tree: RolloutTree, leaf: int, values: list[float | None]) -> dict[int, list[float | None]]:
    """Per-node slices of ``values``, which run along the action tokens of the path to ``leaf``."""
    out, i = {}, 0
    for node in tree.path(leaf):
        out[node.id] = [None if v is None else float(v) for v in values[i:i + len(node.action_ids)]]
        i += len(node.action_ids)
    return out


_SAVED_KEYS = {"advantages": "advantages", "teacher_logprobs": "teacher", "student_logprobs": "student"}


@dataclass(slots=True)
class SavedValues:
    """A tree's ``meta["token_values"]`` as far as it fits the tree (``saved_values``)."""

    values: dict[int, dict[str, list[float | None]]]  # {leaf: {"advantages"|"teacher"|"student": per-token}}
    untrained: dict[int, str]  # {leaf: why the update left it out}
    problems: list[str]  # the entries left out, each with why

    @property
    def readable(self) -> bool:
        return bool(self.values or self.untrained)


_NUMBER_TYPES = frozenset({int, float, type(None)})  # what JSON numbers and null load as (bool is not one)


def _number_list(x: Any) -> bool:
    return isinstance(x, list) and set(map(type, x)) <= _NUMBER_TYPES


def _saved_entry(tree: RolloutTree, key: Any, entry: Any) -> tuple[int, dict[str, Any]] | str:
    """``(leaf, entry)`` if ``entry`` fits leaf ``key`` of ``tree``, else why not."""
    leaf = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 16 else None
    if leaf is None or leaf not in tree.nodes or tree.nodes[leaf].children:
        return f"{str(key)[:40]!r}: not a leaf of this tree"
    if not isinstance(entry, dict):
        return f"leaf {leaf}: a {type(entry).__name__}, not a mapping"
    tokens = sum(len(n.action_ids) for n in tree.path(leaf))
    for name in _SAVED_KEYS:
        got = entry.get(name)
        if got is None:
            continue
        if not _number_list(got):
            return f"leaf {leaf}: {name} is not a list of numbers"
        if len(got) != tokens:  # on other tokens than the update's: not shown at all
            return f"leaf {leaf}: {name} holds {len(got)} values for {tokens} action tokens"
    return leaf, entry


def saved_values(tree: RolloutTree) -> SavedValues | None:
    """The trainer's saved values of ``tree`` (None: none saved). What a trainer wrote can
    still not fit the tree (another writer's format, a hand edit, a bug): an entry that is
    not a leaf's mapping of per-token numbers, one per action token, is left out and named
    in ``problems``, so the page and the report show the rest instead of failing."""
    saved = tree.meta.get("token_values")
    if not saved:
        return None
    if not isinstance(saved, dict):
        return SavedValues({}, {}, [f"token_values is a {type(saved).__name__}, not a mapping"])
    out = SavedValues({}, {}, [])
    for key, entry in saved.items():
        got = _saved_entry(tree, key, entry)
        if isinstance(got, str):
            out.problems.append(got)
        elif got[1].get("trained") is False:
            out.untrained[got[0]] = str(got[1].get("reason") or "left out of the update")
        else:
            out.values[got[0]] = {name: got[1][key] for key, name in _SAVED_KEYS.items()
                                  if got[1].get(key) is not None}
    return out


def _problems_note(saved: SavedValues) -> str:
    shown = "; ".join(saved.problems[:3]) + (f"; and {len(saved.problems) - 3} more" if len(saved.problems) > 3 else "")
    return f"saved values unreadable, left out: {shown}"


def episode_values(tree: RolloutTree, spec: CreditSpec) -> tuple[dict[str, dict[int, dict[int, list[float | None]]]], str]:
    """``({"advantages"|"teacher"|"student": {leaf: {node: per-token}}}, where from)``."""
    saved = saved_values(tree)
    out: dict[str, dict[int, dict[int, list[float | None]]]] = {"advantages": {}, "teacher": {}, "student": {}}
    if saved is not None and saved.readable:
        for leaf, vals in saved.values.items():
            for name, per_token in vals.items():
                out[name][leaf] = _spread(tree, leaf, per_token)
        note = "saved: the values the update used"
        return out, note + (f" ({_problems_note(saved)})" if saved.problems else "")
    unread = f"{_problems_note(saved)}; " if saved is not None else ""
    if spec.method == "none":
        return out, unread + "train.credit=none: no RL advantage (distillation only), and no saved values"
    from ..credit import ESTIMATORS, assign_report

    estimator = ESTIMATORS.get(spec.method)
    if estimator is not None and "reward_fn" in estimator.reads:
        return out, unread + f"{spec.method} needs the run's reward_fn, which a config cannot hold: not recomputed"
    options = {k: v for k, v in spec.options.items() if k != "value_fn"}  # never in a config; old runs
    try:
        report = assign_report([tree], spec.method, failed=spec.failed, **options)
    except (ValueError, TypeError, KeyError) as e:
        return out, unread + f"{spec.method} could not be recomputed: {e}"
    assert estimator is not None  # assign_report knew the method
    for episode, adv in report.items:
        leaf = episode.nodes[-1].id
        actions = [a for a, m in zip(adv, episode.loss_mask, strict=True) if m]
        out["advantages"][leaf] = _spread(tree, leaf, actions)
    note = unread + spec.source
    if estimator.scope == "batch":
        note += " (its statistics span a whole batch; here one tree is the batch)"
    if "value_fn" in estimator.reads:
        note += "; V = 0 (a value head's fit is not saved with the tree)"
    return out, note


def untrained_episodes(tree: RolloutTree) -> dict[int, str]:
    """``{leaf: why}`` for the episodes the update left out, as the trainer saved them."""
    saved = saved_values(tree)
    return saved.untrained if saved is not None else {}


def teacher_note(tree: RolloutTree, has_teacher: bool) -> str:
    """Where the page's teacher - student log-ratio comes from, or why there is none."""
    if has_teacher:
        return "saved: the teacher's and the student's log-probs of the sampled tokens, as the update used them"
    saved = saved_values(tree)
    if saved is not None and saved.readable:
        return "none saved: no teacher scored this run's sampled tokens (no distillation, or DAgger labels)"
    return "not saved with this tree (written by agentrl rollout, or by a trainer that did not save them)"


# --------------------------------------------------------------------------- branch reasons


def _options(fn: Callable[..., Any], options: dict[str, Any]) -> dict[str, Any]:
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    return {k: v for k, v in options.items() if k in names}


def _pilot_note(report: Any, task: Any) -> str:
    """``pilot_commit`` with task ``task``'s pilot pass rate and commitment from the batch's
    allocation report, where the report holds them as the allocator writes them (a list of
    numbers by task, a list of counts); just ``pilot_commit`` otherwise."""
    mine = report.get("pilot_commit") if isinstance(report, dict) else None
    p = mine.get("p") if isinstance(mine, dict) else None
    commit = mine.get("commit") if isinstance(mine, dict) else None
    if not (isinstance(task, int) and isinstance(p, list) and isinstance(commit, list)
            and 0 <= task < min(len(p), len(commit))):
        return "pilot_commit"
    rate = p[task]
    if not isinstance(rate, int | float) or isinstance(rate, bool):
        return "pilot_commit"
    return f"pilot_commit: pilot pass rate {rate:.2f}, {commit[task]} committed"


def _scored_turns(tree: RolloutTree, alloc: str, options: dict[str, Any]) -> dict[int, str]:
    """``{node a scored turn hangs under (-1: the prompt): why}`` from the allocator's own
    scoring function (``entropy_branch``, ``key_state``); ``{}`` for the others."""
    if alloc not in ("entropy_branch", "key_state"):
        return {}
    from ..rollout.allocators import entropy_branch_scores, key_states

    found: dict[int, str] = {}
    if alloc == "entropy_branch":
        scores = entropy_branch_scores(tree, **_options(entropy_branch_scores, options))
        for nid, s in sorted(scores.items(), key=lambda kv: -kv[1]):
            found.setdefault(tree.turn_parent(nid) if tree.turn_parent(nid) is not None else -1,
                             f"entropy rise {s:+.2f} nats at node {nid}'s turn (ARPO/AEPO score above "
                             f"threshold {options.get('threshold', 0.5)})")
    elif alloc == "key_state":
        for p1, nid in key_states(tree, **_options(key_states, options)):
            found.setdefault(tree.turn_parent(nid) if tree.turn_parent(nid) is not None else -1,
                             f"key state: node {nid}'s turn opens with mean top-1 probability {p1:.2f} "
                             f"(below {options.get('top1_threshold', 0.5)}; Spark)")
    return found


def branch_reasons(tree: RolloutTree, allocator_options: dict[str, Any] | None = None,
                   report: dict[str, Any] | None = None) -> dict[str, str]:
    """Why each branch point branched: ``{node id (str) or "prompt": reason}``.

    A branch point is a node with two or more children, or the prompt when the
    tree has two or more roots (fresh episodes).
    """
    options = allocator_options or {}
    alloc = str(tree.meta.get("allocator", ""))
    given = tree.meta.get("branch_reasons")  # a writer's free-form meta: read only as a mapping
    recorded = {str(k): str(v) for k, v in given.items()} if isinstance(given, dict) else {}
    points = [n for n in tree.nodes.values() if len(n.children) >= 2]
    out: dict[str, str] = {}
    if len(tree.roots) > 1:
        why = f"{len(tree.roots)} episodes started from the prompt"
        if alloc == "pilot_commit":
            why += f" ({_pilot_note(report, tree.meta.get('task'))})"
        elif alloc:
            why += f" ({alloc})"
        proxy = [str(tree.nodes[r].info["branch"].get("reason")) for r in tree.roots
                 if isinstance(tree.nodes[r].info.get("branch"), dict)]
        if proxy:  # a harness session's roots: new conversations, side calls, re-rendered replies
            why += "; harness proxy: " + ", ".join(proxy)
        out["prompt"] = why
    unscored = ""
    try:
        found = _scored_turns(tree, alloc, options)
    except (TypeError, ValueError) as e:  # a hand-written option of another type than the scorer takes
        found, unscored = {}, f"its scores could not be recomputed ({type(e).__name__}: {str(e)[:120]})"
    for node in points:
        child_reasons = [str((tree.nodes[c].info.get("branch") or {}).get("reason"))
                         for c in node.children if isinstance(tree.nodes[c].info.get("branch"), dict)]
        k = len(node.children)
        if str(node.id) in recorded:
            why = recorded[str(node.id)]
        elif child_reasons:
            why = "harness proxy: " + ", ".join(child_reasons)
        elif node.partial:
            why = f"segment fork inside the turn after {len(node.action_ids)} tokens ({k} continuations)"
        elif node.id in found:
            why = found[node.id]
        elif alloc == "segment_tree":
            why = f"segment tree: a paused leaf split {k} ways (TreePO)"
        elif alloc == "contrastive":
            why = "contrastive: the branch point ranked first by path and depth decay (CBPO)"
        elif alloc in ("entropy_branch", "key_state"):
            why = f"{alloc}: chosen when the batch was planned" + (
                f"; {unscored}" if unscored else " (no score above threshold now)")
        else:
            why = f"{k} continuations" + (f" ({alloc})" if alloc else "")
        out[str(node.id)] = why
    if "prompt" in out and -1 in found:
        out["prompt"] += "; " + found[-1]
    return out


# --------------------------------------------------------------------------- the payload


def _finite(x: float) -> float | None:
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else None


def _turn_index(tree: RolloutTree) -> dict[int, int]:
    """{node id: turns before it}; a partial node shares its turn's index."""
    index: dict[int, int] = {}
    order = [tree.nodes[r] for r in tree.roots]
    for node in order:
        parent = None if node.parent is None else tree.nodes[node.parent]
        index[node.id] = 0 if parent is None else index[parent.id] + (not parent.partial)
        order += [tree.nodes[c] for c in node.children]
    return index


def _leaves_under(tree: RolloutTree, node_id: int) -> list[int]:
    out, stack = [], [node_id]
    while stack:
        n = tree.nodes[stack.pop()]
        if n.children:
            stack += reversed(n.children)
        else:
            out.append(n.id)
    return out


def _mean(xs: Iterable[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


PerLeaf = dict[int, dict[int, list[float | None]]]  # {leaf: {node: per-token values}}


def _by_node(per_leaf: PerLeaf) -> PerLeaf:
    """``{leaf: {node: values}}`` turned into ``{node: {leaf: values}}``, in one pass: a
    node then reads its own episodes, not every episode of the tree (3,000 leaves of
    15,000 nodes took 9 s the other way)."""
    out: PerLeaf = {}
    for leaf, nodes in per_leaf.items():
        for nid, vals in nodes.items():
            out.setdefault(nid, {})[leaf] = vals
    return out


def _node(tree: RolloutTree, n: Node, depth: int, reasons: dict[str, str],
          adv: dict[int, list[float | None]]) -> dict[str, Any]:
    """One node as the page draws it; ``adv``: its per-token advantages, by leaf."""
    info = n.info or {}
    per_leaf = {leaf: _mean(vals) for leaf, vals in adv.items() if vals}
    per_leaf = {k: v for k, v in per_leaf.items() if v is not None}
    lists = {k: info[k] if isinstance(info.get(k), list) else [] for k in _INFO_LISTS}
    tools = [{"name": c.get("name", ""), "arguments": c.get("arguments", {})}
             for c in lists["tool_calls"] if isinstance(c, dict)]
    results = [{"name": m.get("name") or "", "content": m.get("content", "")}
               for m in lists["tool_messages"] if isinstance(m, dict)]
    # an env's info is free-form: a value not of the kind read above (a count of parse
    # errors) is shown with the rest, as it is
    shown = {k: v for k, v in info.items()
             if k not in _SHOWN_INFO_SKIP or (k in _INFO_LISTS and v is not None and not isinstance(v, list))}
    return {
        "id": n.id, "parent": n.parent, "children": list(n.children), "depth": depth,
        "partial": n.partial, "action": n.action_text, "observation": n.observation,
        "reward": n.reward, "terminated": n.terminated, "truncated": n.truncated, "open": n.open,
        "finish_reason": n.finish_reason, "truncation_reason": info.get("truncation_reason"),
        "error": n.error, "leaf": not n.children, "success": n.success if not n.children else None,
        "version": n.version, "tool_calls": tools, "tool_results": results,
        "parse_errors": list(lists["parse_errors"]), "expert_action": n.expert_action,
        "abandoned": bool(info.get("abandoned")), "continued_by": info.get("continued_by"),
        "side_conversation": bool(info.get("side_conversation")), "info": shown,
        "branch": reasons.get(str(n.id)), "n_action": len(n.action_ids), "n_context": len(n.context_ids),
        "turn": [m.id for m in tree.turn_nodes(n.id)] if not n.partial else [],
        "advantage": _mean(per_leaf.values()), "advantages": {str(k): v for k, v in per_leaf.items()},
    }


def tree_payload(tree: RolloutTree, spec: CreditSpec | None = None,
                 decode: Callable[[list[int]], dict[int, str]] | None = None,
                 allocator_options: dict[str, Any] | None = None,
                 report: dict[str, Any] | None = None) -> dict[str, Any]:
    """The page's data for one tree (JSON-ready).

    ``decode(ids) -> {id: text}`` gives the text of each token id used
    (``None``: the page shows ids). ``report`` is the batch's
    ``meta["allocation_report"]``, which the engine puts on its first tree only.
    """
    spec = spec or CreditSpec()
    values, credit_note = episode_values(tree, spec)
    reasons = branch_reasons(tree, allocator_options, report or tree.meta.get("allocation_report"))
    depth = _turn_index(tree)
    by_node = {name: _by_node(values[name]) for name in ("advantages", "teacher", "student")}
    nodes = [_node(tree, n, depth.get(n.id, 0), reasons, by_node["advantages"].get(n.id, {}))
             for n in sorted(tree.nodes.values(), key=lambda n: n.id)]
    tokens: dict[str, Any] = {}
    used: set[int] = set()
    for n in tree.nodes.values():
        per = {name: {str(leaf): vals for leaf, vals in got.get(n.id, {}).items()} for name, got in by_node.items()}
        tokens[str(n.id)] = {
            "context": n.context_ids, "action": n.action_ids,
            "logprobs": [_finite(x) for x in n.logprobs], "entropies": [_finite(x) for x in n.entropies],
            "top1": [_finite(x) for x in n.top1], **per,
        }
        used.update(n.context_ids)
        used.update(n.action_ids)
    saved = saved_values(tree)
    untrained = saved.untrained if saved is not None else {}
    trained = set(saved.values) if saved is not None else set()
    episodes = []
    for leaf in tree.leaves():
        path = tree.path(leaf.id)
        error = next((x.error for x in path if x.error), None)
        episodes.append({
            "leaf": leaf.id, "path": [x.id for x in path], "turns": sum(not x.partial for x in path),
            "reward": sum(x.reward for x in path), "success": leaf.success and not error, "error": error,
            "truncated": leaf.truncated, "reason": error or leaf.info.get("truncation_reason")
            or ("finish_reason=length" if leaf.truncated and leaf.finish_reason == "length" else None),
            # the compare view's one-line summary (28 characters an action); the whole texts are on
            # the nodes, once: an episode's copy of each made a trunk's text count once per episode
            "actions": [x.action_text[:_ACTION_HEAD] for x in path if not x.partial],
            # None: not known (not saved, or its saved entry did not fit the tree)
            "trained": True if leaf.id in trained else False if leaf.id in untrained else None,
            "untrained_reason": untrained.get(leaf.id),
        })
    has_teacher = any(values["teacher"].values())
    meta = {k: v for k, v in tree.meta.items()
            if k not in ("token_values", "allocation_report", "prefix_groups", "privileged")}
    return {
        "meta": meta, "roots": list(tree.roots), "nodes": nodes, "tokens": tokens,
        "episodes": episodes, "branch_points": reasons,
        "vocab": {str(k): v for k, v in decode(sorted(used)).items()} if decode else {},
        "credit": {"method": spec.method, "note": credit_note,
                   "saved": saved is not None and saved.readable},
        "has_teacher": has_teacher, "teacher_note": teacher_note(tree, has_teacher),
    }
