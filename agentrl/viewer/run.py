"""A run on disk, read the way the viewer and the report need it: trees by index, on demand.

A *run* is a folder, or one trees JSONL file (``agentrl.types.write_trees``).
In a folder these are read, each only when present:

    RUN/trajectories.jsonl              the trees of ``agentrl rollout``
    RUN/trees*.jsonl                    any trees file at the top
    RUN/trees/*.jsonl                   trees per training step, e.g. trees/step-000001.jsonl
    RUN/summary.json                    ``agentrl rollout``'s summary (env, model, allocator)
    RUN/metrics.jsonl                   ``agentrl train``'s rows, one a step
    RUN/config.json, RUN/config.yaml    a run config beside the trees
    RUN/checkpoints/step-*/state.json   the trainer's config, from its newest checkpoint

Opening a run reads every trees file once, line by line, and keeps the byte
offset of each tree and a ``TreeSummary`` (reward, success, turns, failures
by reason): plain data, small enough for a table of thousands of trees. A
whole ``RolloutTree`` is parsed only when ``Run.tree(i)`` asks for it.

A tree's step is ``meta["step"]`` when the writer put one there, else the
number in its file's name (``step-000012.jsonl``), else None.

A run can change while it is looked at: a training run adds a step's trees
file and a metrics row, a resumed run or a new ``agentrl rollout`` replaces a
file whole, a config is edited. Each tree's line is indexed with its CRC-32, and
``Run.tree(i)`` refuses (``RunChanged``) a line that is no longer the one indexed,
instead of parsing what now lies at its bytes as tree i; ``Run.changed()`` says
whether any file above changed since the run was opened, and
``Run.reopen()`` indexes it again, reading only the trees files that changed
(the server does so on each page load of a run still being written).

A line whose node links do not make a tree (a cycle, a child or root that is
not there, a child that names another parent, a node no root reaches) is
skipped with its reason, like a torn line (``check_links``): everything that
walks a tree, here, in the payload and in the page, may then assume it ends.
"""

from __future__ import annotations

import json
import os
import re
import threading
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from ..types import RolloutTree, succeeded

__all__ = ["BadFields", "BadLinks", "Run", "RunChanged", "TreeRef", "TreeSummary", "check_links", "open_run", "step_order",
           "summarize_tree_dict"]

_STEP = re.compile(r"step[-_]?(\d+)")
_NAMED_SKIPS = 100  # skipped lines named one by one; the rest are counted


@dataclass(slots=True, frozen=True)
class TreeRef:
    """Where tree ``index`` of a run lies: its file, byte range and the line's CRC-32."""

    index: int
    file: Path
    offset: int
    length: int
    crc: int = 0


@dataclass(slots=True)
class TreeSummary:
    """One tree (one task's group) in a row of numbers; see ``summarize_tree_dict``."""

    index: int
    file: str
    step: int | str | None
    task: int | str | None
    seed: int | str | None
    env: str
    family: str
    allocator: str
    instruction: str
    episodes: int
    successes: int
    failed: int
    truncated: int
    mean_reward: float
    mean_turns: float
    action_tokens: int
    nodes: int
    branch_points: int
    reasons: dict[str, int] = field(default_factory=dict)

    @property
    def success_rate(self) -> float:
        ok = self.episodes - self.failed
        return self.successes / ok if ok > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "success_rate": self.success_rate}


def _short(value: Any, limit: int = 120) -> Any:
    """A summary field as the table shows it: an int or None as it is, anything else as
    at most ``limit`` characters of its text (a run's meta can hold whole documents)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    return str(value)[:limit]


def step_order(step: Any) -> tuple[bool, bool, float, str]:
    """A sort key for tree steps: numbers in order, then the text a tree's meta gave as its
    step (a summary keeps it as text), then None; numbers and text do not compare."""
    number = isinstance(step, int | float) and not isinstance(step, bool)
    return step is None, not number, step if number else 0, "" if number else str(step)


def _reason(text: str) -> str:
    """A failure reason without its details, so that alike failures count together
    (as ``agentrl.rollout.summary`` counts them)."""
    return text.split(":")[0].split(" after ")[0][:80]


def node_info(node: dict[str, Any]) -> dict[str, Any]:
    """A node dict's ``info`` as a mapping: ``{}`` for none, and a value of another type (a
    list from a foreign writer or a hand edit) kept whole under a key that says so, so
    that what reads ``info`` (``.get``) works and the page still shows what was there."""
    info = node.get("info")
    if info is None:
        return {}
    return info if isinstance(info, dict) else {f"info (a {type(info).__name__}, not a mapping)": info}


def _mapping_infos(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with every node's ``info`` a mapping (``node_info``); as it is when all are."""
    if all(isinstance(n.get("info", {}), dict) for n in data["nodes"]):
        return data
    return {**data, "nodes": [{**n, "info": node_info(n)} for n in data["nodes"]]}


def task_family(meta: dict[str, Any], nodes: list[dict[str, Any]]) -> str:
    """The task's family: ``meta["family"]``, else the env's ``task_type`` or ``family``
    in its first step's info (ALFWorld-v0 reports ``task_type``), else ``""``."""
    if meta.get("family"):
        return str(meta["family"])
    for n in nodes[:1]:
        info = node_info(n)
        for key in ("task_type", "family"):
            if info.get(key):
                return str(info[key])
    return ""


class RunChanged(ValueError):
    """A tree's file changed since the run was indexed (replaced, rewritten, cut short)."""


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """What tells a file changed: its inode, size and modification time (None: not there)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class BadLinks(ValueError):
    """A tree's node links do not make a tree (``check_links``)."""


def check_links(data: dict[str, Any]) -> None:
    """Raise ``BadLinks`` unless ``data``'s node links make a forest: each node is reached
    from ``roots`` exactly once, through ``children``, names the node it hangs under as its
    ``parent``, and takes its context (``context_from``) from a node of the tree."""
    nodes = {n["id"]: n for n in data["nodes"]}
    if len(nodes) != len(data["nodes"]):
        raise BadLinks("node links: two nodes share an id")
    seen: set[Any] = set()
    stack: list[tuple[Any, Any]] = [(r, None) for r in data["roots"]]
    while stack:
        nid, parent = stack.pop()
        if nid not in nodes:
            raise BadLinks(f"node links: node {nid!r} is linked to but not in the tree")
        if nid in seen:
            raise BadLinks(f"node links: node {nid!r} is reached twice (a cycle, or two parents)")
        if nodes[nid].get("parent") != parent:
            raise BadLinks(f"node links: node {nid!r} names parent {nodes[nid].get('parent')!r} "
                           f"but hangs under {parent!r}")
        seen.add(nid)
        stack += [(c, nid) for c in nodes[nid].get("children") or []]
        src = nodes[nid].get("context_from")
        if src is not None and src not in nodes:
            raise BadLinks(f"node links: node {nid!r} takes its context from {src!r}, not in the tree")
    if len(seen) < len(nodes):
        raise BadLinks(f"node links: {len(nodes) - len(seen)} node(s) no root reaches")


_INT = frozenset({int})
_NUMBERS = frozenset({int, float, type(None)})  # a logprob JSON wrote as null (NaN) is None
_FIELD_KINDS: dict[str, tuple[str, Any]] = {  # a node field the viewer reads: (what it must be, the check)
    **dict.fromkeys(("context_ids", "action_ids"), (
        "a list of token ids", lambda v: isinstance(v, list) and set(map(type, v)) <= _INT)),
    **dict.fromkeys(("logprobs", "entropies", "top1"), (
        "a list of numbers", lambda v: isinstance(v, list) and set(map(type, v)) <= _NUMBERS)),
    **dict.fromkeys(("action_text", "observation", "finish_reason"), ("text", lambda v: isinstance(v, str))),
    **dict.fromkeys(("error", "expert_action", "expert_action_error", "snapshot"), (
        "text or null", lambda v: v is None or isinstance(v, str))),
    **dict.fromkeys(("terminated", "truncated", "partial", "open"), (
        "true or false", lambda v: isinstance(v, bool) or v in (0, 1) and type(v) is int)),
    "reward": ("a number", lambda v: type(v) in (int, float)),
    "version": ("a whole number", lambda v: type(v) is int),
    "admissible": ("a list or null", lambda v: v is None or isinstance(v, list)),
}


class BadFields(ValueError):
    """A node's field is not of the kind a tree's is (``check_fields``)."""


def check_fields(data: dict[str, Any]) -> None:
    """Raise ``BadFields``, naming the node and field, unless each node field the viewer
    reads is of its kind (``_FIELD_KINDS``; a field left out takes ``Node``'s default)
    and each partial node has a child (an episode of partial nodes only has no turn)."""
    for n in data["nodes"]:
        for name, (kind, ok) in _FIELD_KINDS.items():
            shared = name == "context_ids" and n.get(name) is None and n.get("context_from") is not None
            if name in n and not shared and not ok(n[name]):
                got = n[name]
                raise BadFields(f"node {n.get('id')!r}: {name} is a {type(got).__name__}, not {kind}")
        if n.get("partial") and not n.get("children"):  # split_node gives a partial node its continuation
            raise BadFields(f"node {n.get('id')!r}: partial (a turn's first tokens) but nothing continues it")


def summarize_tree_dict(data: dict[str, Any], index: int = 0, file: str = "",
                        step: int | None = None) -> TreeSummary:
    """The numbers of one tree, from its JSON dict (no ``RolloutTree`` is built).

    Episodes are root-to-leaf paths. A failed episode (an ``error`` on its path)
    counts in ``failed`` with its reason and is left out of ``mean_reward``, as
    ``agentrl.rollout.summarize`` does; a truncated one counts in ``truncated``
    with its ``truncation_reason`` (or ``finish_reason=length``).
    """
    check_links(data)
    check_fields(data)
    meta = data.get("meta") or {}
    nodes = {n["id"]: n for n in data.get("nodes", [])}
    leaves = [n for n in nodes.values() if not n.get("children")]
    successes = failed = truncated = tokens = 0
    rewards: list[float] = []
    turns: list[int] = []
    reasons: Counter[str] = Counter()
    for leaf in leaves:
        path, cur = [], leaf
        while cur is not None:
            path.append(cur)
            cur = nodes.get(cur["parent"]) if cur.get("parent") is not None else None
        error = next((n["error"] for n in reversed(path) if n.get("error")), None)
        turns.append(sum(not n.get("partial") for n in path))
        tokens += sum(len(n.get("action_ids") or []) for n in path)
        if error:
            failed += 1
            reasons[f"failed: {_reason(error)}"] += 1
            continue
        rewards.append(sum(float(n.get("reward", 0.0)) for n in path))
        info = node_info(leaf)
        successes += succeeded(info, bool(leaf.get("terminated")), float(leaf.get("reward", 0.0)))
        if leaf.get("truncated"):
            truncated += 1
            why = info.get("truncation_reason") or (
                "finish_reason=length" if leaf.get("finish_reason") == "length" else "env limit")
            reasons[f"truncated: {_reason(str(why))}"] += 1
    branch_points = sum(len(n.get("children") or []) > 1 for n in nodes.values())
    branch_points += len(data.get("roots", [])) > 1
    env = meta.get("env", "")
    return TreeSummary(
        index=index, file=file, step=_short(meta.get("step", step)), task=_short(meta.get("task")),
        seed=_short(meta.get("seed", meta.get("session_seed"))),
        env=_short(env.get("env_id", "") if isinstance(env, dict) else env),
        family=_short(task_family(meta, [nodes[r] for r in data.get("roots", []) if r in nodes])),
        allocator=_short(meta.get("allocator", "")), instruction=str(meta.get("instruction", ""))[:300],
        episodes=len(leaves), successes=successes, failed=failed, truncated=truncated,
        mean_reward=sum(rewards) / len(rewards) if rewards else 0.0,
        mean_turns=sum(turns) / len(turns) if turns else 0.0, action_tokens=tokens,
        nodes=len(nodes), branch_points=branch_points, reasons=dict(reasons))


def _loads(line: bytes) -> Any:
    """``json.loads(line)``; from a fresh thread's stack when the caller's is too deep for it.

    json's parser counts its caller's frames against the recursion limit, so whether a
    line nested ~980 levels parses depended on who asked: it indexed when the run was
    opened and raised when a server thread asked for the tree. A fresh thread starts at
    depth 0, so a line parses (or not) the same wherever it is read.
    """
    try:
        return json.loads(line)
    except RecursionError:
        got: list[Any] = []
        failed: list[BaseException] = []

        def parse() -> None:
            try:
                got.append(json.loads(line))
            except BaseException as e:  # noqa: BLE001 (handed to the caller's thread, raised there)
                failed.append(e)

        worker = threading.Thread(target=parse, name="agentrl-viewer-parse")
        worker.start()
        worker.join()
        if failed:
            raise failed[0] from None
        return got[0]


def _step_of(path: Path) -> int | None:
    m = _STEP.search(path.stem)
    return int(m.group(1)) if m else None


def tree_files(path: Path) -> list[Path]:
    """The trees files of a run folder (see the module docstring), steps in order."""
    if path.is_file():
        return [path]
    files = [path / "trajectories.jsonl"] if (path / "trajectories.jsonl").is_file() else []
    files += sorted(p for p in path.glob("trees*.jsonl") if p.is_file())
    if (path / "trees").is_dir():
        files += sorted((p for p in (path / "trees").glob("*.jsonl") if p.is_file()),
                        key=lambda p: (_step_of(p) is None, _step_of(p) or 0, p.name))
    return files


class Run:
    """One run: an index of its trees (read on demand), its metrics and its config."""

    def __init__(self, path: str | Path, previous: Run | None = None):
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"no run at {self.path}: give a run folder or a trees JSONL file")
        self.root = self.path if self.path.is_dir() else self.path.parent
        self.files = tree_files(self.path)
        # stamped before reading: a file written while it is read shows as changed
        self._stamps = self._stamp_all(self.files)
        self.refs: list[TreeRef] = []
        self.summaries: list[TreeSummary] = []
        self.skipped: list[str] = []  # the first lines that are not trees (a torn last line), by file:line
        self.skipped_count = 0  # all of them: a file of another format skips every line
        self.config_problems: list[str] = []  # config files beside the trees that did not parse
        self._reports: dict[Path, dict[str, Any] | None] = {}
        self._spans: dict[Path, tuple[int, int, list[str], int]] = {}  # file: its trees' range, its skips
        for f in self.files:
            start, skips, count = len(self.refs), len(self.skipped), self.skipped_count
            if previous is None or not previous._reuse(self, f):
                self._index(f)
            self._spans[f] = (start, len(self.refs), self.skipped[skips:], self.skipped_count - count)
        self._first: dict[Path, int] = {}  # each file's first tree: the engine writes a batch's report on it
        for r in self.refs:
            self._first.setdefault(r.file, r.index)

    def reopen(self) -> Run:
        """The run as it is on disk now; a trees file whose stamp (inode, size, mtime) did
        not change keeps its index, renumbered, instead of being read and parsed again."""
        return Run(self.path, previous=self)

    def _reuse(self, into: Run, file: Path) -> bool:
        """Put this run's index of ``file`` into ``into`` if the file did not change since."""
        stamp = self._stamps.get(file)
        if file not in self._spans or stamp is None or stamp != into._stamps.get(file):
            return False
        start, end, skips, count = self._spans[file]
        for ref, summary in zip(self.refs[start:end], self.summaries[start:end], strict=True):
            i = len(into.refs)
            into.refs.append(replace(ref, index=i))
            into.summaries.append(replace(summary, index=i))
        for where in skips:
            into._skip(where)
        into.skipped_count += count - len(skips)  # those counted, not named
        return True

    def _index(self, file: Path) -> None:
        step = _step_of(file)
        name = str(file.relative_to(self.root)) if file.is_relative_to(self.root) else file.name
        offset = 0
        try:
            with open(file, "rb") as fh:
                for lineno, line in enumerate(fh, 1):
                    start, offset = offset, offset + len(line)
                    if not line.strip():
                        continue
                    try:
                        data = _loads(line)
                        summary = summarize_tree_dict(data, len(self.refs), name, step)
                    except (BadLinks, BadFields) as e:
                        self._skip(f"{name}:{lineno} ({e})")
                        continue
                    # not a tree's JSON; nested too deep (RecursionError); a number past float (OverflowError)
                    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError):
                        self._skip(f"{name}:{lineno}")
                        continue
                    self.refs.append(TreeRef(len(self.refs), file, start, len(line), zlib.crc32(line)))
                    self.summaries.append(summary)
        except OSError as e:  # deleted since listed (old steps pruned), no permission: the rest still show
            self._skip(f"{name} (unreadable: {type(e).__name__}: {e.strerror or e})")

    def _skip(self, where: str) -> None:
        self.skipped_count += 1
        if len(self.skipped) < _NAMED_SKIPS:
            self.skipped.append(where)

    def __len__(self) -> int:
        return len(self.refs)

    def _stamp_all(self, files: list[Path]) -> dict[Path, tuple[int, int, int] | None]:
        return {f: _stamp(f) for f in [*files, *self._side_files()]}

    def sources(self) -> list[Path]:
        """The files the run is read from: its trees files and the side files (config,
        summary, metrics, newest checkpoint state), those that are there."""
        return [*self.files, *(p for p in self._side_files() if p.exists())]

    def _side_files(self) -> list[Path]:
        """The files besides the trees that the index reads: the config files, ``summary.json``,
        and in a folder ``metrics.jsonl`` and the newest checkpoint's ``state.json``."""
        side = [self.root / name for name in ("config.json", "config.yaml", "config.yml", "summary.json")]
        if self.path.is_dir():
            side.append(self.root / "metrics.jsonl")
            side += self._checkpoint_states()[-1:]
        return side

    def _checkpoint_states(self) -> list[Path]:
        """The checkpoints' ``state.json`` files, oldest step first (by number: a name past
        step 999,999 has more digits, and sorts before older ones as text)."""
        if not self.path.is_dir():
            return []
        states = self.root.glob("checkpoints/step-*/state.json")
        # a name with no step number (not the trainer's) sorts first: never taken for the newest
        return sorted(states, key=lambda p: (_step_of(p.parent) is not None, _step_of(p.parent) or 0, p.parent.name))

    def stamp_of(self, index: int) -> tuple[int, int, int] | None:
        """The stamp (inode, size, mtime; None: gone) of tree ``index``'s file now: what
        tells a copy of the tree made before is still the tree on disk."""
        return _stamp(self.refs[index].file)

    def changed(self) -> bool:
        """Whether a trees file, ``metrics.jsonl``, a config file, ``summary.json`` or the
        newest checkpoint's state was added, removed, replaced or written since the run was
        opened (a stat of each: cheap enough to ask on every index)."""
        try:
            files = tree_files(self.path)
        except OSError:
            return True
        return self._stamp_all(files) != self._stamps

    def batch_report(self, index: int, tree: RolloutTree | None = None) -> dict[str, Any] | None:
        """The allocation report of tree ``index``'s batch: the engine writes it on the
        first tree of a batch, i.e. of its file. Read once a file (``--static`` asks for
        every tree's); ``tree``, tree ``index`` already parsed, spares a second parse when
        it is the file's first. A first tree that does not parse gives None: it is shown as
        undrawable when opened itself, and must not make the rest of its file so."""
        file = self.refs[index].file
        if file not in self._reports:
            try:
                first = tree if tree is not None and index == self._first[file] else self.tree(self._first[file])
            except RunChanged:  # the file changed: every tree of it is refused the same way
                raise
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError):
                first = None
            got = first.meta.get("allocation_report") if first is not None else None
            self._reports[file] = got if isinstance(got, dict) else None
        return self._reports[file]

    @property
    def skipped_note(self) -> str:
        """``skipped N unreadable line(s): file:line, ...`` (a torn last line, from a kill mid-write), or ""."""
        n = self.skipped_count
        if not n:
            return ""
        shown = ", ".join(self.skipped[:5]) + (f" and {n - 5} more" if n > 5 else "")
        return f"skipped {n} unreadable line{'s' if n > 1 else ''}: {shown}"

    def tree(self, index: int) -> RolloutTree:
        """Tree ``index``, parsed from its file now."""
        ref = self.refs[index]
        try:
            with open(ref.file, "rb") as fh:
                fh.seek(ref.offset)
                line = fh.read(ref.length)
        except FileNotFoundError:
            raise RunChanged(f"{ref.file} was deleted since the run was indexed: reload the page, "
                             "or open the run again") from None
        if zlib.crc32(line) != ref.crc:  # whatever lies there now is not tree ``index``
            raise RunChanged(f"{ref.file} changed since the run was indexed (its line of tree {index} "
                             "is not there any more): reload the page, or open the run again")
        data = _loads(line)
        check_links(data)
        return RolloutTree.from_dict(_mapping_infos(data))

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """The rows of ``metrics.jsonl`` (empty without one, or when it cannot be read)."""
        return self._metrics[0]

    @property
    def metrics_note(self) -> str:
        """Why ``metrics.jsonl`` or some of its lines were not read, or ""."""
        return self._metrics[1]

    @cached_property
    def _metrics(self) -> tuple[list[dict[str, Any]], str]:
        return read_metrics_rows(self.root / "metrics.jsonl") if self.path.is_dir() else ([], "")

    @cached_property
    def summary(self) -> dict[str, Any]:
        """``summary.json`` of ``agentrl rollout`` (empty without one)."""
        return _read_json(self.root / "summary.json") or {}

    @cached_property
    def config(self) -> dict[str, Any]:
        """The run config as plain data: ``config.json``/``config.yaml`` beside the trees,
        else the newest checkpoint's, else what ``summary.json`` tells; ``{}`` without any."""
        for name in ("config.json", "config.yaml", "config.yml"):
            p = self.root / name
            if p.is_file():
                got = _read_config(p)
                if isinstance(got, dict):
                    return self._sections_as_mappings(got, name)
                # a hand-edited file with an error in it: named (config_problems), not fatal
                self.config_problems.append(f"{name} not read ({got})")
        got = self.checkpoint_state.get("config")
        if isinstance(got, dict):
            return self._sections_as_mappings(got, "the checkpoint's config")
        s = self.summary
        out: dict[str, Any] = {}
        if s.get("model"):
            out["policy"] = {"model": s["model"], "backend": s.get("backend")}
        if s.get("env"):
            out["env"] = {"id": s["env"]}
        if s.get("allocator"):
            out["rollout"] = {"allocator": s["allocator"]}
        return out

    def _sections_as_mappings(self, config: dict[str, Any], where: str) -> dict[str, Any]:
        """``config`` less the sections the viewer reads that are not mappings (a hand-written
        ``env: x``), each named in ``config_problems``: the page, --static and the report read
        them as mappings, and one such section raised out of all three."""
        out = dict(config)
        for key in _SECTIONS:
            if out.get(key) is not None and not isinstance(out[key], dict):
                self.config_problems.append(f"{where}: {key} not read (a {type(out[key]).__name__}, "
                                            "not a mapping)")
                del out[key]
        for section, key, kind, what in _KEYS:  # the keys inside them the viewer reads as one kind
            got = (out.get(section) or {}).get(key)
            if got is not None and not isinstance(got, kind):
                self.config_problems.append(f"{where}: {section}.{key} not read (a {type(got).__name__}, "
                                            f"not {what})")
                out[section] = {k: v for k, v in out[section].items() if k != key}
        return out

    @cached_property
    def checkpoint_state(self) -> dict[str, Any]:
        """``state.json`` of the newest checkpoint (``{}`` without one): the step, the
        config, and what the trainer keeps across a resume (e.g. ``distill_turn_mass``)."""
        states = self._checkpoint_states()
        got = _read_json(states[-1]) if states else None
        return got if isinstance(got, dict) else {}

    def steps(self) -> list[int | None]:
        """The distinct steps of the run's trees, in order (None for trees without one)."""
        seen = dict.fromkeys(s.step for s in self.summaries)
        return sorted(seen, key=step_order)

    def title(self) -> str:
        cfg = self.config
        env = (cfg.get("env") or {}).get("id") or next((s.env for s in self.summaries if s.env), "")
        model = Path(str((cfg.get("policy") or {}).get("model", "")))
        parts = model.parts
        if "checkpoints" in parts[1:]:  # a run's exported checkpoint: name the run
            model = Path(parts[parts.index("checkpoints") - 1], *parts[parts.index("checkpoints"):])
        return " / ".join(x for x in (self.path.name, env, str(model) if parts else "") if x)


_SECTIONS = ("env", "policy", "rollout", "sampling", "train", "sft")  # the config sections the viewer reads
_KEYS = (("train", "distill", dict, "a mapping"), ("train", "credit_options", dict, "a mapping"),
         ("rollout", "allocator_options", dict, "a mapping"), ("env", "id", str, "a name"))  # keys read as mappings (.get, dict()) or joined as text (the title)


_CONFIG_VALUES = 100_000  # values a config may expand to; a run's real config holds a few hundred


def _expands_past(x: Any, limit: int) -> bool:
    """Whether ``x`` holds more than ``limit`` values counted as a walk meets them: a value
    YAML aliases share is counted once per place it is used, as ``str`` and JSON write it."""
    todo, seen = [x], 0
    while todo:
        v = todo.pop()
        seen += 1
        if seen > limit:
            return True
        if isinstance(v, dict):
            todo += v.values()
            seen += len(v)  # the keys
        elif isinstance(v, list | tuple | set):
            todo += v
    return False


def _read_config(path: Path) -> dict[str, Any] | str:
    """A config file's mapping, or why there is none (a syntax error, not a mapping, YAML
    aliases that expand past ``_CONFIG_VALUES`` values: 400 bytes can hold 10 million)."""
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            got = json.loads(text)
        else:
            import yaml

            got = yaml.safe_load(text)
    except Exception as e:  # unreadable, a JSON or YAML syntax error (yaml.YAMLError), nested too deep
        return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    if _expands_past(got, _CONFIG_VALUES):
        return f"it expands to over {_CONFIG_VALUES:,} values (YAML aliases)"
    return got if isinstance(got, dict) else f"a {type(got).__name__}, not a mapping"


def read_metrics_rows(path: Path) -> tuple[list[dict[str, Any]], str]:
    """``(rows, note)`` of a ``metrics.jsonl``: ``train.metrics.read_metrics``'s rows, and
    why none or some were not read. The file is the trainer's, but what lies at its path
    is not the viewer's to trust: a folder there must not cost the page its run, and the
    lines ``read_metrics`` skips (not JSON, nested past the parser) are named."""
    import warnings

    from ..train.metrics import read_metrics

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows = read_metrics(path)
    except OSError as e:  # a folder at the path, no permission, deleted since listed
        return [], f"metrics.jsonl not read ({type(e).__name__}: {e.strerror or e})"
    skipped = [f"metrics.jsonl:{m.group(1)}" for w in caught
               if (m := re.search(r":(\d+): skipped a line", str(w.message)))]
    if not skipped:
        return rows, ""
    shown = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
    return rows, f"skipped {len(skipped)} metrics line(s) that are not metrics rows: {shown}"


def _read_json(path: Path) -> Any:
    """A JSON file's value, or None: not there, unreadable, not JSON, or nested too deep."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None


def open_run(path: str | Path) -> Run:
    """``Run(path)``: a run folder or a trees JSONL file."""
    return Run(path)
