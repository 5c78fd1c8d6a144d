"""The viewer's one HTML page, for the server and for ``--static``.

The page is ``static/viewer.js`` and ``static/viewer.css`` inlined into one
HTML document, so it needs no asset from anywhere. What differs between the
two modes is where the data comes from:

- server (``agentrl view RUN``): the page asks ``api/run`` for the index and
  ``api/tree/<i>`` for a tree when it opens one;
- static (``agentrl view RUN --static out.html``): the index and every tree
  are JSON inside ``<script type="application/json">`` elements. The browser
  does not parse those until the page asks for one, so opening a file of
  thousands of trees parses only the index.

JSON is escaped for a script element: every ``<`` becomes ``\\u003c``, so no
text from a run (model output, observations) can close the element. A lone
surrogate (what ``json.loads`` makes of ``"\\ud800"`` in a harness message or a
web page) is written as its ``\\u`` escape, since no UTF-8 encoder writes it raw.
A value nested deeper than 100 levels (a tool call's arguments can nest as deep
as the JSON parser reads) is written as its JSON text, with a note.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections.abc import Iterable, Iterator
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from ..allocator_options import recorded_allocator
from .curves import curve_panels
from .payload import credit_spec, tree_payload
from .run import Run
from .tokens import Decoder

__all__ = ["render_page", "run_index", "tree_data", "write_static"]


_MAX_NESTING = 100  # levels of the page's data kept as data; deeper values become their JSON text


_SCALARS = frozenset({int, float, str, bool, type(None)})


class _Text(str):
    """JSON text already written, queued between the values it separates (``_json_text``)."""


def _json_text(x: Any) -> str:
    """``x`` as compact JSON (non-finite numbers as null), with a stack of its own instead of
    recursion: a value from a run can nest as deep as the JSON parser reads (~995 levels)."""
    out: list[str] = []
    todo: list[Any] = [x]
    while todo:
        v = todo.pop()
        if type(v) is _Text:
            out.append(v)
        elif isinstance(v, dict):
            seq: list[Any] = [_Text("{")]
            for j, (k, item) in enumerate(v.items()):
                seq += [_Text(("," if j else "") + json.dumps(str(k)) + ":"), item]
            todo += reversed([*seq, _Text("}")])
        elif isinstance(v, list | tuple):
            seq = [_Text("[")]
            for j, item in enumerate(v):
                seq += [_Text(","), item] if j else [item]
            todo += reversed([*seq, _Text("]")])
        elif isinstance(v, float) and not math.isfinite(v):
            out.append("null")
        else:
            out.append(json.dumps(v, ensure_ascii=False))
    return "".join(out)


def _scalar(v: Any) -> Any:
    """A number, text, bool or None as JSON.parse reads it: NaN and infinities as None."""
    return None if type(v) is float and not math.isfinite(v) else v


def _clean(x: Any) -> Any:
    """A copy of ``x`` that ``json.dumps`` writes and ``JSON.parse`` reads: NaN and infinities
    to None (JSON.parse refuses them), keys as text, and a value nested deeper than
    ``_MAX_NESTING`` levels as its JSON text with a note (a tool call's arguments can nest
    ~995 levels: recursion here, and in ``json.dumps``, stopped at ~490). A stack, not
    recursion, walks the containers; plain values are copied where they are met."""
    root: list[Any] = [None]
    todo: list[tuple[Any, Any, Any, int]] = [(x, root, 0, 0)]  # (container or value, into, key, its depth)
    while todo:
        v, into, key, depth = todo.pop()
        if type(v) in _SCALARS:
            into[key] = _scalar(v)
        elif isinstance(v, dict | list | tuple) and depth >= _MAX_NESTING and v:
            into[key] = f"(nested past {_MAX_NESTING} levels: shown as its JSON text) {_json_text(v)}"
        elif isinstance(v, dict):
            into[key] = copy = {}
            for k, item in v.items():
                if type(item) in _SCALARS:
                    copy[str(k)] = _scalar(item)
                else:  # a place kept for it, so the keys keep their order
                    copy[str(k)] = None
                    todo.append((item, copy, str(k), depth + 1))
        elif isinstance(v, list | tuple):
            into[key] = copy = [_scalar(item) if type(item) in _SCALARS else None for item in v]
            todo += [(item, copy, j, depth + 1) for j, item in enumerate(v) if type(item) not in _SCALARS]
        elif isinstance(v, float) and not math.isfinite(v):  # a float subclass (numpy's float64)
            into[key] = None
        else:
            into[key] = v
    return root[0]


_SURROGATE = re.compile("[\ud800-\udfff]")


def to_json(data: Any) -> str:
    """JSON for the page: finite numbers only, ``<`` escaped (safe inside a script element),
    lone surrogates escaped (the text encodes to UTF-8)."""
    text = json.dumps(_clean(data), ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def run_index(run: Run, tokenizer_note: str = "") -> dict[str, Any]:
    """What the page loads first: the table's rows, totals, curves and what the run is."""
    rows = [s.to_dict() for s in run.summaries]
    episodes = sum(s.episodes for s in run.summaries)
    failed = sum(s.failed for s in run.summaries)
    ok = episodes - failed
    rewards = sum(s.mean_reward * (s.episodes - s.failed) for s in run.summaries)
    cfg = run.config
    train = cfg.get("train") or {}
    distill = train.get("distill") or {}
    spec = credit_spec(cfg)
    about = {
        "source": str(run.path),
        "env": (cfg.get("env") or {}).get("id"),
        "model": (cfg.get("policy") or {}).get("model"),
        "allocator": recorded_allocator(cfg.get("rollout") or {})[0]
        or next((s.allocator for s in run.summaries if s.allocator), None),
        "credit": spec.method if train else None,
        "distillation teacher": distill.get("teacher") if distill else None,
        "tokens": tokenizer_note or None,
        "config": "; ".join(run.config_problems) or None,  # a config beside the trees that did not parse
        "metrics": run.metrics_note or None,  # a metrics.jsonl (or lines of it) that could not be read
    }
    return {
        "title": run.title(),
        "about": about,
        "totals": {"trees": len(run), "episodes": episodes, "failed": failed,
                   "truncated": sum(s.truncated for s in run.summaries),
                   "success_rate": sum(s.successes for s in run.summaries) / ok if ok else 0.0,
                   "mean_reward": rewards / ok if ok else 0.0},
        "steps": run.steps(),
        "trees": rows,
        "curves": curve_panels(run.metrics),
        "skipped": run.skipped[:20], "skipped_count": run.skipped_count,  # a few named, all counted
        "waiting": not len(run) and not run.metrics,  # no step yet: the served page asks again
    }


def tree_data(run: Run, index: int, decode: Decoder | None) -> dict[str, Any]:
    """The page's data for tree ``index`` (``payload.tree_payload`` with the run's config)."""
    tree = run.tree(index)
    cfg = run.config
    report = tree.meta.get("allocation_report") or run.batch_report(index, tree)
    return tree_payload(tree, credit_spec(cfg), decode, recorded_allocator(cfg.get("rollout") or {})[1], report)


@cache
def _asset(name: str) -> str:
    return resources.files("agentrl.viewer").joinpath("static", name).read_text(encoding="utf-8")


def _page_parts(index: dict[str, Any] | None, trees: Iterable[tuple[int, dict[str, Any]]]) -> Iterator[str]:
    """The page in pieces: head, the data elements one a piece (static mode), the tail."""
    head, tail = _TEMPLATE.split("{data}")
    yield head.format(css=_asset("viewer.css"), mode="static" if index is not None else "server")
    if index is not None:
        yield f'<script type="application/json" id="run-data">{to_json(index)}</script>'
        for i, payload in trees:
            yield f'\n<script type="application/json" id="tree-{i}">{to_json(payload)}</script>'
    yield tail.format(js=_asset("viewer.js"))


def render_page(index: dict[str, Any] | None = None, trees: dict[int, dict[str, Any]] | None = None) -> str:
    """The HTML page. With ``index`` (and ``trees``) the data is inside it (static mode);
    without, the page fetches it from the server it was served by."""
    return "".join(_page_parts(index, sorted((trees or {}).items())))


def _drawable(run: Run, n: int, decode: Decoder | None,
              failed: list[str] | None) -> Iterator[tuple[int, dict[str, Any]]]:
    """The first ``n`` trees' page data; a tree that cannot be drawn (it indexed, but does not
    parse or its values do not fit it) becomes ``{"error": why}``, which the page shows when
    it is opened, and is named in ``failed``: one such tree must not cost the others."""
    for i in range(n):
        try:
            yield i, tree_data(run, i, decode)
        except Exception as e:  # a newer writer's field, a file changed since it was indexed
            why = f"{type(e).__name__}: {e}"[:500]
            if failed is not None:
                failed.append(f"tree {i} ({run.refs[i].file.name}, byte {run.refs[i].offset}): {why}")
            yield i, {"error": f"tree {i} could not be drawn: {why}"}


def write_static(run: Run, out: str | Path, decode: Decoder | None, tokenizer_note: str = "",
                 limit: int | None = None, failed: list[str] | None = None) -> Path:
    """Write the self-contained page of ``run`` to ``out`` (atomically); ``limit`` keeps
    the first trees only (the table still lists every tree). Trees are parsed and
    written one at a time, so a run of any size takes the memory of its largest tree.
    A tree that cannot be drawn is named in ``failed`` (and on the page, when opened)."""
    n = len(run) if limit is None else min(limit, len(run))
    index = run_index(run, tokenizer_note)
    if n < len(run):
        index["about"]["note"] = f"this file holds the first {n} of {len(run)} trees"
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a name of this writer's own: two writers of one page must not share (and truncate) one file
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            for part in _page_parts(index, _drawable(run, n, decode, failed)):
                fh.write(part)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return path


_TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>agentrl viewer</title>
<style>{css}</style>
</head>
<body data-mode="{mode}">
<header>
  <h1 id="title">agentrl viewer</h1>
  <nav>
    <button data-view="run" class="active">Run</button>
    <button data-view="tree" data-needs-tree disabled>Tree</button>
    <button data-view="tokens" data-needs-tree disabled>Tokens</button>
    <button data-view="curves">Curves</button>
    <button data-view="compare">Compare</button>
  </nav>
</header>
<main>
<section id="view-run">
  <div id="run-cards" class="cards"></div>
  <div id="run-about" class="muted small" style="margin-bottom:8px"></div>
  <div class="row">
    <input id="f-text" type="search" placeholder="filter: seed, family, instruction, reason" size="36">
    <select id="f-step"></select>
    <select id="f-family"></select>
    <select id="f-outcome">
      <option value="">all outcomes</option>
      <option value="all">every episode succeeded</option>
      <option value="some">some succeeded</option>
      <option value="none">none succeeded</option>
      <option value="failed">has failed episodes</option>
      <option value="truncated">has truncated episodes</option>
      <option value="branched">has branch points</option>
    </select>
    <button id="prev-page">&#9664;</button><span id="pager-info" class="muted"></span><button id="next-page">&#9654;</button>
  </div>
  <table id="run-table" class="grid"></table>
</section>
<section id="view-tree" hidden>
  <div class="row"><button id="prev-tree">&#9664; tree</button><button id="next-tree">tree &#9654;</button>
    <b id="tree-title"></b></div>
  <div id="tree-instruction" class="small" style="margin-bottom:4px"></div>
  <div id="tree-credit" class="muted small" style="margin-bottom:8px"></div>
  <div class="split"><div id="tree-canvas"></div><aside id="node-detail"></aside></div>
</section>
<section id="view-tokens" hidden>
  <div id="token-head" style="margin-bottom:6px"></div>
  <div class="row"><span id="token-modes" class="row"></span><span id="token-legend"></span></div>
  <div id="token-view"></div>
</section>
<section id="view-curves" hidden><div id="curves" class="curves"></div></section>
<section id="view-compare" hidden>
  <div id="compare-controls" class="row"></div>
  <div id="compare-body"></div>
</section>
</main>
<div id="tok-tip" hidden></div>
{data}
<script>{js}</script>
</body>
</html>
"""
