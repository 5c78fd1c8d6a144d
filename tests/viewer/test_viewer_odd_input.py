"""The viewer against trees a live trainer or an odd writer leaves: values nested as deep as
the JSON parser allows, saved token values that do not fit their tree, a tokenizer that is
still loading when a tree is opened, and requests a page never sends.

Each test names the input and the outcome; the server is tested at the HTTP level.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from agentrl.viewer import Run, ViewerServer, write_static

from .conftest import fork_tree


def _get(url: str, timeout: float = 10) -> tuple[int, dict]:
    """``(status, JSON body)`` of a GET, error answers included."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _nested(depth: int) -> object:
    value: object = "bottom"
    for _ in range(depth):
        value = {"a": [value]} if depth % 2 else {"a": value}
    return value


def _write_lines(path: Path, trees: list[dict]) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in trees))
    return path


def test_a_tool_call_argument_nested_900_levels_is_drawn_not_a_server_error(tmp_path):
    """The page's JSON cleaner recursed twice a level: arguments nested past ~490 levels (the
    parser reads ~995) made the tree a 500 and ``--static`` named it undrawable."""
    t = fork_tree().to_dict()
    t["nodes"][1]["info"]["tool_calls"][0]["arguments"] = _nested(900)
    run = Run(_write_lines(tmp_path / "trees.jsonl", [t]))
    assert len(run) == 1 and run.skipped == []
    server = ViewerServer(run, port=0).start()
    try:
        status, body = _get(server.url + "api/tree/0")
    finally:
        server.close()
    assert status == 200, body
    (call,) = next(n for n in body["nodes"] if n["id"] == 1)["tool_calls"]
    shown = json.dumps(call["arguments"])
    assert "nested past" in shown and shown.count("bottom") == 1  # the deep part as text, not lost
    assert shown.count('\\"a\\"') + shown.count('"a"') == 900
    failed: list[str] = []
    write_static(run, tmp_path / "v.html", None, failed=failed)
    assert failed == []
