"""Core data types: chat messages and tool schemas (pydantic, at the edges) and
rollout trees (slotted dataclasses, in the hot path).

A ``RolloutTree`` holds the turns of one task. Each ``Node`` is one turn: the
context tokens added just before the action (the rendered observation delta and
generation prompt), the action tokens exactly as sampled, their behaviour
logprobs, and what the env answered. A linear rollout is a tree with one child
per node; a root-to-leaf path is an ``Episode``, and the episodes of one tree
(one task) are its ``EpisodeGroup``, built once a training step.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "SUCCESS_REWARD",
    "Episode",
    "EpisodeGroup",
    "Message",
    "Node",
    "RolloutTree",
    "ToolCall",
    "ToolSpec",
    "read_trees",
    "succeeded",
    "write_trees",
]


class ToolCall(BaseModel):
    """One call of a tool, as parsed from model text or sent by an OpenAI client."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(default="", description="Call id, echoed in the tool message that answers it.")
    name: str = Field(description="Name of the tool to call.")
    arguments: dict[str, Any] = Field(default_factory=dict, description="Parsed JSON arguments.")


class Message(BaseModel):
    """One chat message, in the shape chat templates and the OpenAI API expect."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"] = Field(description="Who speaks.")
    content: str = Field(default="", description="Text of the message.")
    tool_calls: list[ToolCall] | None = Field(default=None, description="Calls an assistant made.")
    tool_call_id: str | None = Field(default=None, description="For role=tool: the call answered.")
    name: str | None = Field(default=None, description="For role=tool: the tool's name.")

    def to_template(self) -> dict[str, Any]:
        """The plain dict that ``tokenizer.apply_chat_template`` takes."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class ToolSpec(BaseModel):
    """What the model is told about a tool: name, description and JSON-schema parameters."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Tool name the model calls.")
    description: str = Field(default="", description="What the tool does, for the model.")
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="JSON schema of the arguments object.",
    )

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``tools=[...]`` entry for this tool."""
        return {"type": "function", "function": self.model_dump()}


# The one success rule (``Node.success``): the env's ``info["success"]`` when it reports one,
# else a termination whose last reward reaches this. An env with partial credit, or rewards
# on another scale, reports ``info["success"]`` itself: success is the task's, not the run's.
SUCCESS_REWARD = 1.0


def succeeded(info: dict[str, Any], terminated: bool, reward: float) -> bool:
    """The success rule, on a last turn's fields (``Node.success``; a viewer reads it off plain dicts)."""
    if "success" in info:
        return bool(info["success"])
    return terminated and reward >= SUCCESS_REWARD


@dataclass(slots=True)
class Node:
    """One turn of a rollout.

    ``context_ids`` are the tokens appended to the context just before the action
    (for a root: the whole rendered opening prompt; later: the rendered delta of
    the last observation plus the generation prompt). ``action_ids`` are the
    sampled tokens, exactly as sampled, with their behaviour ``logprobs``.
    ``observation`` is the env's text answer to the action. ``snapshot`` is a
    handle into ``RolloutTree.snapshots`` (live env states are process-local and
    not serialized). ``error`` records why an episode failed at this turn.

    A ``partial`` node holds the first tokens of an action that its children
    continue (a segment-level fork inside a turn): it has no env step, and an
    ``Episode`` joins it with its child into one turn. A child's
    ``context_ids`` is empty then.

    ``info`` is what the env returned for this step, and only that. What the
    engine records about a turn has a field of its own, so that no env can
    overwrite it: ``top1`` (the top-1 probability of each action token, when
    the allocator asked for top logprobs), ``expert_action`` (what the env's
    expert would have done in the state this turn acted in, or
    ``expert_action_error`` saying why there is none), ``open`` (a leaf
    paused by ``max_turns``, that an allocator may continue) and
    ``admissible`` (the actions this turn's reply was constrained to spell,
    ``rollout.constrain: admissible``; None: sampled freely). The trainer
    rebuilds its masks from them (``policy.constrain``), so they are kept
    here, not in ``info``, whose per-step lists are dropped.
    """

    id: int = -1
    parent: int | None = None
    children: list[int] = field(default_factory=list)
    context_ids: list[int] = field(default_factory=list)
    action_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    version: int = 0
    action_text: str = ""
    observation: str = ""
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    finish_reason: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    snapshot: str | None = None
    error: str | None = None
    partial: bool = False
    top1: list[float] = field(default_factory=list)
    expert_action: str | None = None
    expert_action_error: str | None = None
    open: bool = False
    admissible: list[str] | None = None

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated

    @property
    def success(self) -> bool:
        """Whether the episode that ends at this node succeeded: ``info["success"]``
        when the env reports it, else terminated with a reward of at least
        ``SUCCESS_REWARD`` (1.0) on this last turn; partial credit below it is
        no success.

        A truncated episode did not succeed, whatever its reward: the env never
        said the task was done.
        """
        return succeeded(self.info, self.terminated, self.reward)

    def to_dict(self) -> dict[str, Any]:
        """The fields as they are, not copied: ``asdict``'s deep copy took two stack frames a level
        of ``info`` and failed at about 500 levels, where ``json`` writes about 990."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Node:
        """A node from ``to_dict``'s output. Files written before the engine's
        annotations had fields of their own keep them in ``info``; they move to
        their fields (only when the field itself is absent, so that an env's own
        ``info`` key of the same name stays in ``info``)."""
        unknown = set(data) - _NODE_FIELDS
        if unknown:
            raise ValueError(f"unknown Node fields: {sorted(unknown)}")
        moved = [k for k in _ENGINE_ANNOTATIONS if k not in data and k in data.get("info", {})]
        if moved:
            info = dict(data["info"])  # the caller's dict is not changed
            annotations = {k: info.pop(k) for k in moved}
            data = {**data, **annotations, "info": info}
        return cls(**data)


@dataclass(slots=True)
class Episode:
    """A root-to-leaf path of a tree, flattened into one token sequence.

    ``loss_mask`` is 1 on action tokens, 0 on context tokens. ``logprobs`` and
    ``versions`` are aligned with ``input_ids`` (0.0 and -1 on context tokens).
    ``turn_spans[k]`` is the half-open ``(start, end)`` of turn k's action tokens.
    ``nodes[k]`` is the node that ended turn k (its env step); partial nodes of
    a segment fork are joined into the turn they start. A turn sampled under
    ``rollout.constrain: admissible`` has its action list in ``nodes[k].admissible``
    (``policy.constrain.episode_allowed`` turns it into per-token masks).
    """

    nodes: list[Node]
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    turn_spans: list[tuple[int, int]]

    @classmethod
    def from_path(cls, nodes: list[Node]) -> Episode:
        ids: list[int] = []
        mask: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        spans: list[tuple[int, int]] = []
        turns: list[Node] = []
        start: int | None = None
        for node in nodes:
            ids += node.context_ids
            mask += [0] * len(node.context_ids)
            lps += [0.0] * len(node.context_ids)
            vers += [-1] * len(node.context_ids)
            if start is None:
                start = len(ids)
            ids += node.action_ids
            mask += [1] * len(node.action_ids)
            lps += node.logprobs
            vers += [node.version] * len(node.action_ids)
            if not node.partial:
                spans.append((start, len(ids)))
                turns.append(node)
                start = None
        return cls(turns, ids, mask, lps, vers, spans)

    @property
    def rewards(self) -> list[float]:
        return [n.reward for n in self.nodes]

    @property
    def total_reward(self) -> float:
        return sum(self.rewards)

    @property
    def num_turns(self) -> int:
        return len(self.nodes)

    @property
    def error(self) -> str | None:
        return next((n.error for n in self.nodes if n.error), None)

    @property
    def success(self) -> bool:
        """``Node.success`` of the last turn; an empty episode did not succeed."""
        return bool(self.nodes) and self.nodes[-1].success


@dataclass(slots=True)
class RolloutTree:
    """The turns of one task, as a tree of ``Node``s keyed by id.

    Several roots are allowed: they are first turns sampled from the same
    opening context. ``meta`` holds the task: env id, seed, instruction.
    """

    meta: dict[str, Any] = field(default_factory=dict)
    nodes: dict[int, Node] = field(default_factory=dict)
    roots: list[int] = field(default_factory=list)
    snapshots: dict[str, Any] = field(default_factory=dict, repr=False)

    def add(self, node: Node, parent: int | None = None) -> Node:
        """Insert ``node`` under ``parent`` (None for a root) and give it an id."""
        node.id = len(self.nodes)
        node.parent = parent
        if parent is None:
            self.roots.append(node.id)
        else:
            self.nodes[parent].children.append(node.id)
        self.nodes[node.id] = node
        return node

    def path(self, node_id: int) -> list[Node]:
        """Nodes from a root down to ``node_id``."""
        out = []
        cur: int | None = node_id
        while cur is not None:
            out.append(self.nodes[cur])
            cur = self.nodes[cur].parent
        return out[::-1]

    def turn_nodes(self, node_id: int) -> list[Node]:
        """The nodes that hold the action of the turn ending at ``node_id``: the
        partial nodes of segment forks above it, top first, then the node."""
        out = [self.nodes[node_id]]
        while out[0].parent is not None and self.nodes[out[0].parent].partial:
            out.insert(0, self.nodes[out[0].parent])
        return out

    def turn_parent(self, node_id: int) -> int | None:
        """The node that ended the turn before ``node_id``'s turn (partial nodes
        walked through), whose state that turn acted in; None for a first turn."""
        return self.turn_nodes(node_id)[0].parent

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes.values() if not n.children]

    def episodes(self) -> Iterator[Episode]:
        """Every root-to-leaf path, in leaf id order."""
        for leaf in self.leaves():
            yield Episode.from_path(self.path(leaf.id))

    def to_dict(self) -> dict[str, Any]:
        """Plain data. A context shared by siblings (branches) is written once:
        later siblings carry ``context_from`` (the first sibling's id) instead."""
        out = []
        for n in self.nodes.values():
            d = n.to_dict()
            siblings = self.roots if n.parent is None else self.nodes[n.parent].children
            first = next((s for s in siblings if self.nodes[s].context_ids == n.context_ids), n.id)
            if first != n.id and n.context_ids:
                d["context_ids"], d["context_from"] = None, first
            out.append(d)
        return {"meta": self.meta, "roots": self.roots, "nodes": out}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutTree:
        refs = {d["id"]: d.get("context_from") for d in data["nodes"]}
        nodes = {d["id"]: Node.from_dict({k: v for k, v in d.items() if k != "context_from"})
                 for d in data["nodes"]}
        for i, src in refs.items():
            if src is not None:  # shared, not copied, as the engine holds it
                nodes[i].context_ids = nodes[src].context_ids
        return cls(meta=data.get("meta", {}), nodes=nodes, roots=list(data["roots"]))

    def to_json(self) -> str:
        """One line of JSON: UTF-8 text as it is, or ``\\u`` escapes where the tree
        holds a lone surrogate (a file written as UTF-8 could not hold it)."""
        data = self.to_dict()
        try:
            text = json.dumps(data, ensure_ascii=False)
        except RecursionError:  # an env's info nested past what json writes: that info, not the tree
            data = {**data, "meta": _writable_meta(data["meta"]),
                    "nodes": [_writable_info(d) for d in data["nodes"]]}
            text = json.dumps(data, ensure_ascii=False)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = json.dumps(data)
        return text

    @classmethod
    def from_json(cls, line: str) -> RolloutTree:
        return cls.from_dict(json.loads(line))


@dataclass(slots=True)
class EpisodeGroup:
    """The episodes of one tree (a group: one task), built once, in leaf order.

    ``episodes[i]`` is the root-to-leaf path ending at leaf ``leaf_ids[i]``. Credit,
    the no-signal check and distillation all read these, never rebuilding them.
    """

    tree: RolloutTree
    episodes: list[Episode]
    leaf_ids: list[int]

    @classmethod
    def of(cls, tree: RolloutTree | EpisodeGroup) -> EpisodeGroup:
        """``tree``'s episodes (a group is returned as it is)."""
        if isinstance(tree, EpisodeGroup):
            return tree
        leaves = [leaf.id for leaf in tree.leaves()]
        return cls(tree, [Episode.from_path(tree.path(i)) for i in leaves], leaves)

    def by_leaf(self) -> dict[int, Episode]:
        """Each episode under the id of the leaf it ends at."""
        return dict(zip(self.leaf_ids, self.episodes, strict=True))


_NODE_FIELDS = frozenset(f.name for f in fields(Node))
# Written into ``info`` by older versions of the engine; fields of ``Node`` now.
_ENGINE_ANNOTATIONS = ("top1", "expert_action", "expert_action_error", "open")


def _writable_info(node: dict[str, Any]) -> dict[str, Any]:
    """``node`` with its ``info`` replaced by a note when ``json`` cannot nest that deep."""
    try:
        json.dumps(node["info"])
    except RecursionError:
        return {**node, "info": {"error": "info was too deeply nested to write as JSON (RecursionError)"}}
    return node


def _writable_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with each value ``json`` cannot nest that deep replaced by a note."""
    out = {}
    for k, v in meta.items():
        try:
            json.dumps(v)
            out[k] = v
        except RecursionError:
            out[k] = "meta value was too deeply nested to write as JSON (RecursionError)"
    return out


def write_trees(path: str | Path, trees: Iterable[RolloutTree], append: bool = False) -> int:
    """Write trees as JSONL, one tree a line. Returns how many were written."""
    n = 0
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for tree in trees:
            f.write(tree.to_json() + "\n")
            n += 1
    return n


def read_trees(path: str | Path) -> list[RolloutTree]:
    """Read a JSONL file written by ``write_trees``."""
    with open(path, encoding="utf-8") as f:
        return [RolloutTree.from_json(line) for line in f if line.strip()]
