"""Tree-side operations for branching: branch points, segment splits, printing.

A branch point is what a new path needs to start from a node: the env's
snapshot (None when the env cannot snapshot; the engine then replays the
action prefix from a reset), the token context as it stood, ready for the next
action, and the context delta the next node will carry. The engine's episode
player (``agentrl.rollout.episodes``) keeps one per node in
``RolloutTree.snapshots`` when its allocator branches, and does the I/O
(restore, replay); this module only changes and reads trees.

Siblings share their context list: a branch stores the tokens up to its
branch point once (``RolloutTree.to_dict`` writes them once too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..chat import ChatContext
from ..types import Node, RolloutTree

__all__ = ["BranchPoint", "format_tree", "renumber", "split_node"]


@dataclass(slots=True)
class BranchPoint:
    """Where a branch starts: env snapshot (or None: replay), context, next delta, turns so far,
    and the admissible actions the next turn is constrained to (None: none)."""

    env: Any
    ctx: ChatContext
    pending: list[int]
    turns: int
    admissible: list[str] | None = None


def split_node(tree: RolloutTree, node_id: int, at: int) -> Node:
    """Split a node's action after ``at`` tokens, for a segment fork.

    A new partial node takes the node's place: its context and first ``at``
    action tokens. The node keeps the rest of the action, the env step and its
    children, and hangs under the partial node, with an empty context. Ids of
    existing nodes do not change. Returns the partial node.
    """
    node = tree.nodes[node_id]
    if node.partial or not 0 < at < len(node.action_ids):
        raise ValueError(f"cannot split node {node_id} ({len(node.action_ids)} action tokens) at {at}")
    part = Node(context_ids=node.context_ids, action_ids=node.action_ids[:at],
                logprobs=node.logprobs[:at], entropies=node.entropies[:at],
                version=node.version, partial=True, admissible=node.admissible)
    part.id, part.parent = len(tree.nodes), node.parent
    tree.nodes[part.id] = part
    siblings = tree.roots if node.parent is None else tree.nodes[node.parent].children
    siblings[siblings.index(node_id)] = part.id
    node.parent = part.id
    part.children.append(node_id)
    node.context_ids = []
    node.action_ids, node.logprobs = node.action_ids[at:], node.logprobs[at:]
    node.entropies = node.entropies[at:]
    part.top1, node.top1 = node.top1[:at], node.top1[at:]
    return part


def renumber(tree: RolloutTree, first: int, key: Callable[[Node], Any]) -> None:
    """Give the nodes with ids ``first`` and up new ids in the order of ``key``.

    The engine numbers a round's nodes as their turns finish, which follows
    timing; renumbered by a key from the plan (the path's seed stream, then
    its nth node), two runs' trees compare node for node. Ids below ``first``
    stay. Parents, children and roots (the round's nodes were appended last,
    and are sorted), the order of ``tree.nodes`` and snapshot handles
    (``n<id>``) follow.
    """
    new = sorted((n for n in tree.nodes.values() if n.id >= first), key=key)
    remap = {n.id: first + j for j, n in enumerate(new)}
    if all(old == nid for old, nid in remap.items()):
        return

    def fix(ids: list[int]) -> list[int]:
        return [i for i in ids if i < first] + sorted(remap[i] for i in ids if i >= first)

    moved = {}
    for n in new:
        if n.snapshot == f"n{n.id}" and n.snapshot in tree.snapshots:
            moved[f"n{remap[n.id]}"] = tree.snapshots.pop(n.snapshot)
            n.snapshot = f"n{remap[n.id]}"
        n.id = remap[n.id]
    for n in tree.nodes.values():
        if n.parent is not None and n.parent >= first:
            n.parent = remap[n.parent]
        if any(c >= first for c in n.children):
            n.children[:] = fix(n.children)
    tree.roots[:] = fix(tree.roots)
    tree.snapshots.update(moved)
    nodes = sorted(tree.nodes.values(), key=lambda n: n.id)
    tree.nodes.clear()
    tree.nodes.update((n.id, n) for n in nodes)


def _short(text: str, width: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[:width - 1] + "…"


def format_tree(tree: RolloutTree, width: int = 60, text: bool = False) -> str:
    """One line per turn, indented by depth: action, reward, done, branch point, errors; counters last.

    ``text`` adds the task's instruction and, under each turn, the env's observation.
    """
    lines = [f"task seed={tree.meta.get('seed')} env={tree.meta.get('env')} "
             f"allocator={tree.meta.get('allocator', '-')} "
             f"nodes={len(tree.nodes)} leaves={len(tree.leaves())}"]
    if text and tree.meta.get("instruction"):
        lines.append(f"instruction: {_short(tree.meta['instruction'], 4 * width)!r}")

    stack = [(r, 1) for r in reversed(tree.roots)]  # not recursive: episodes can be deeper than Python's limit
    while stack:
        nid, depth = stack.pop()
        n = tree.nodes[nid]
        marks = []
        if len(n.children) > 1:
            marks.append(f"branch x{len(n.children)}")
        if n.partial:
            marks.append(f"segment fork after {len(n.action_ids)} tokens")
        if n.terminated:
            marks.append("terminated")
        elif n.truncated:
            marks.append("truncated" + (f" ({n.info['truncation_reason']})"
                                        if "truncation_reason" in n.info else ""))
        if n.open:
            marks.append("open")
        if n.error:
            marks.append(f"ERROR {_short(n.error, width)}")
        action = "…" + _short(n.action_text, width) if n.partial else _short(n.action_text, width)
        lines.append(f"{'  ' * depth}[{nid}] v{n.version} r={n.reward:g} "
                     f"tok={len(n.action_ids)} {action!r}" + (f"  <{'; '.join(marks)}>" if marks else ""))
        if text and not n.partial:
            lines.append(f"{'  ' * depth}    -> {_short(n.observation, 4 * width)!r}")
        stack += [(c, depth + 1) for c in reversed(n.children)]
    counters = tree.meta.get("counters")
    if counters:
        lines.append("counters: " + ", ".join(f"{k}={v}" for k, v in counters.items()))
    return "\n".join(lines)
