"""The viewer against hostile or odd runs: what it shows comes from model outputs, env
observations, harness messages and config files, none of which it can trust.

Each test names the input and the outcome: no script from a run runs, no tree stalls
or crashes the server, and the server answers only the page's own origin.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from agentrl.types import Node, RolloutTree, write_trees
from agentrl.viewer import Run, ViewerServer, run_index, tree_data, write_static
from agentrl.viewer.page import to_json

from .conftest import fork_tree

# Each way text can break out of where the page puts it: a script element, an
# attribute, a template literal, a JavaScript string (U+2028/U+2029), a comment.
EVIL = ('</script><script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'
        '`${window.__pwned=3}`\u2028\u2029<!--<script>javascript:window.__pwned=4')


def _evil_run(folder: Path) -> Path:
    """A run whose every string the page shows is ``EVIL``: meta, env info, actions,
    observations, tool calls and results, errors, config and metrics keys."""
    t = RolloutTree(meta={"env": EVIL, "seed": EVIL, "task": 0, "allocator": EVIL, "instruction": EVIL,
                          "family": EVIL, "counters": {EVIL: EVIL}, "branch_reasons": {"0": EVIL},
                          "budget": {"spent": EVIL, "total": EVIL, "unit": EVIL}})
    first = t.add(Node(context_ids=[1], action_ids=[2], logprobs=[-0.1], entropies=[0.1], action_text=EVIL,
                       observation=EVIL, expert_action=EVIL,
                       info={EVIL: EVIL, "tool_calls": [{"name": EVIL, "arguments": {EVIL: EVIL}}],
                             "tool_messages": [{"name": EVIL, "content": EVIL}], "parse_errors": [EVIL]}))
    t.add(Node(context_ids=[3], action_ids=[4], logprobs=[-0.1], entropies=[0.1], action_text=EVIL,
               observation=EVIL, truncated=True, info={"truncation_reason": EVIL}), first.id)
    t.add(Node(context_ids=[3], action_ids=[5], logprobs=[-0.1], entropies=[0.1], action_text=EVIL,
               error=EVIL), first.id)
    folder.mkdir(parents=True, exist_ok=True)
    write_trees(folder / "trajectories.jsonl", [t])
    (folder / "config.json").write_text(json.dumps({"env": {"id": EVIL}, "policy": {"model": EVIL}}))
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/reward": 0.5, EVIL: 1.0}) + "\n")
    return folder


def _strings(x: object) -> set[str]:
    if isinstance(x, str):
        return {x}
    if isinstance(x, dict):
        return set(x) | {s for v in x.values() for s in _strings(v)}
    if isinstance(x, list):
        return {s for v in x for s in _strings(v)}
    return set()


def _evil_decoder(ids: list[int]) -> dict[int, str]:
    return {i: EVIL for i in ids}


def test_run_text_cannot_close_the_script_element_it_is_embedded_in(tmp_path):
    html = write_static(Run(_evil_run(tmp_path / "run")), tmp_path / "v.html", _evil_decoder).read_text()
    data = re.findall(r'<script type="application/json" id="([^"]+)">(.*?)</script>', html, re.S)
    assert [name for name, _ in data] == ["run-data", "tree-0"]  # neither was cut short by run text
    for _, text in data:
        assert "<" not in text  # no </script>, no <!--
        assert EVIL in _strings(json.loads(text))  # intact, once parsed
    assert "<img" not in html


def test_run_text_runs_no_script_in_the_static_page_or_the_served_one(browser_context, tmp_path):
    """A real browser clicks through every view of a run made of ``EVIL`` strings."""
    run = Run(_evil_run(tmp_path / "run"))
    static = write_static(run, tmp_path / "v.html", _evil_decoder)
    server = ViewerServer(run, port=0, load_decoder=lambda: (_evil_decoder, EVIL)).start()
    try:
        for url in (static.as_uri(), server.url):
            page = browser_context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
            page.on("dialog", lambda d, errors=errors: (errors.append(f"dialog: {d.message}"), d.dismiss()))
            page.goto(url)
            page.wait_for_selector("body[data-ready='1']", timeout=15_000)
            page.click("tr.tree-row[data-tree='0']")
            for nid in ("prompt", "0", "1", "2"):
                page.click(f"#tree-canvas g.node[data-node='{nid}'] circle")
                if nid != "prompt":
                    page.click("#show-tokens")
                    page.wait_for_selector("#token-view .tok")
                    page.hover("#token-view .tok >> nth=0")
                    page.click("nav button[data-view=tree]")
            page.click("nav button[data-view=curves]")
            page.click("nav button[data-view=compare]")
            assert page.evaluate("window.__pwned") is None, url
            assert EVIL.split("<!--")[0] in page.inner_text("#run-about"), url  # shown as text
            assert errors == [], url
            page.close()
    finally:
        server.close()


def _lone_surrogate_run(folder: Path) -> Path:
    # what json.loads makes of "\ud800" in a harness message or an env's web page: a
    # str Python can hold but no UTF-8 encoder writes
    t = fork_tree()
    t.meta["instruction"] = "buy \ud800 socks"
    t.nodes[1].observation = "page \udfff end"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trajectories.jsonl").write_text(json.dumps(t.to_dict()) + "\n")  # ascii, as the proxy writes
    return folder


def test_a_lone_surrogate_in_a_run_is_shown_not_a_server_error(tmp_path):
    run = Run(_lone_surrogate_run(tmp_path / "run"))
    body = to_json(run_index(run)).encode("utf-8")
    assert json.loads(body)["trees"][0]["instruction"] == "buy \ud800 socks"
    server = ViewerServer(run, port=0).start()
    try:
        for route in ("api/run", "api/tree/0"):
            with urllib.request.urlopen(server.url + route, timeout=10) as r:
                assert r.status == 200
                json.loads(r.read())
    finally:
        server.close()


def test_a_lone_surrogate_in_a_run_still_writes_the_static_page(tmp_path):
    run = Run(_lone_surrogate_run(tmp_path / "run"))
    html = write_static(run, tmp_path / "v.html", None).read_text(encoding="utf-8")
    tree = json.loads(html.split('id="tree-0">', 1)[1].split("</script>", 1)[0])
    assert tree == json.loads(to_json(tree_data(run, 0, None)))
    assert any(n["observation"] == "page \udfff end" for n in tree["nodes"])


def _node(i: int, parent: int | None, children: list[int]) -> dict:
    return {"id": i, "parent": parent, "children": children, "context_ids": [1], "action_ids": [2],
            "logprobs": [-0.1], "entropies": [0.1], "action_text": "a", "observation": "o"}


BAD_LINKS = {
    "a parent cycle": [_node(0, None, [1]), _node(1, 2, [2]), _node(2, 1, [])],
    "a children cycle": [_node(0, None, [1]), _node(1, 0, [0])],
    "a missing child": [_node(0, None, [5])],
    "a missing parent": [_node(0, None, []), _node(1, 9, [])],
    "a child under two parents": [_node(0, None, [2]), _node(1, None, [2]), _node(2, 0, [])],
}


def test_trees_whose_links_make_no_tree_are_skipped_with_the_reason(tmp_path):
    """A parent cycle looped forever (and grew a list without end) while the run was
    indexed; a children cycle did the same when the tree was opened; a missing child
    dropped the server's connection. Run in a child process with a memory cap, so a
    loop fails this test instead of the machine."""
    import subprocess
    import sys

    f = tmp_path / "trees.jsonl"
    lines = [json.dumps(fork_tree().to_dict())]
    lines += [json.dumps({"meta": {"seed": k}, "roots": [0], "nodes": nodes}) for k, nodes in BAD_LINKS.items()]
    f.write_text("\n".join(lines) + "\n")
    code = ("import json, resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
            "from agentrl.viewer import Run, tree_data, write_static\n"
            "run = Run(sys.argv[1]); tree_data(run, 0, None); write_static(run, sys.argv[2], None)\n"
            "print(json.dumps([len(run), run.skipped]))")
    got = subprocess.run([sys.executable, "-c", code, str(f), str(tmp_path / "v.html")],
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr[-2000:]
    n, skipped = json.loads(got.stdout)
    assert n == 1 and len(skipped) == len(BAD_LINKS)
    assert all(s.startswith(f"trees.jsonl:{k} (node links: ") for k, s in enumerate(skipped, 2)), skipped


def test_a_tree_file_changed_after_indexing_gets_an_error_answer_not_a_dropped_connection(tmp_path):
    f = tmp_path / "trees.jsonl"
    write_trees(f, [fork_tree()])
    run = Run(f)
    old = f.read_text()
    bad = json.dumps({"meta": {}, "roots": [0], "nodes": [_node(0, None, [5])]})
    f.write_text(bad.ljust(len(old) - 1) + "\n")  # rewritten in place, same length
    server = ViewerServer(run, port=0).start()
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(server.url + "api/tree/0", timeout=10)
        # refused as changed (its line is not the one indexed), not parsed as tree 0
        assert e.value.code == 409 and "changed since the run was indexed" in json.loads(e.value.read())["error"]
    finally:
        server.close()


def _get(url: str, path: str, host: str | None) -> tuple[int, bytes]:
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    c.putrequest("GET", path, skip_host=True)
    if host is not None:
        c.putheader("Host", host)
    c.endheaders()
    r = c.getresponse()
    return r.status, r.read()


def test_a_loopback_server_answers_only_requests_addressed_to_loopback(tmp_path):
    """DNS rebinding: a web page at evil.example re-points its name at 127.0.0.1 and
    reads http://evil.example:PORT/api/run from the user's own browser (same origin,
    so no CORS rule stops it). The request still says Host: evil.example."""
    f = tmp_path / "trees.jsonl"
    write_trees(f, [fork_tree()])
    server = ViewerServer(Run(f), port=0).start()
    port = server.httpd.server_address[1]
    try:
        for path in ("/", "/api/run", "/api/tree/0"):
            status, body = _get(server.url, path, f"evil.example:{port}")
            assert status == 403 and b"find the gold" not in body, path
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", None):
            assert _get(server.url, "/api/run", host)[0] == 200, host
    finally:
        server.close()


def test_a_static_page_is_written_a_tree_at_a_time(tmp_path):
    """A 100 MB trajectories file (web-page observations) took about 770 MB to write as a
    static page: every tree's payload, then the whole page, were held at once. The
    memory it takes now is that of the largest tree, not of the run."""
    import tracemalloc

    page = ("<div class=product>" + "x" * 80 + "</div>\n") * 250  # 25 kB, as a WebShop page
    trees = []
    for k in range(120):
        t = fork_tree(k)
        t.nodes[0].observation = page
        trees.append(t)
    write_trees(tmp_path / "trees.jsonl", trees)
    run = Run(tmp_path / "trees.jsonl")
    one = len(to_json(tree_data(run, 0, None)))
    tracemalloc.start()
    try:
        html = write_static(run, tmp_path / "v.html", None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert html.stat().st_size > 100 * one  # every tree is in the page
    assert peak < 20 * one, f"writing the page peaked at {peak / 2**20:.1f} MB, {peak / one:.0f} trees' worth"


def test_report_shows_run_text_as_text_and_survives_it(tmp_path):
    """Family names come from env info (``task_type``), env ids and models from the config:
    mathtext (``$...$``) in one crashed ``agentrl report`` in matplotlib; HTML, a link or a
    ``|`` went into report.md raw (a script or a javascript: link for a Markdown renderer
    that passes HTML through; a broken table for any)."""
    from agentrl.viewer.report import write_report

    families = ['<img src=x onerror="alert(1)">', "a|b\nc [click](javascript:alert(1))", r"$\badcmd{$",
                "lone \ud800"]
    with open(tmp_path / "trees.jsonl", "w") as fh:
        for k, fam in enumerate(families):
            t = fork_tree(k)
            t.meta["family"] = fam
            fh.write(json.dumps(t.to_dict()) + "\n")
    (tmp_path / "config.json").write_text(json.dumps({"env": {"id": EVIL}, "policy": {"model": "m|<b>x</b>"}}))
    md = write_report([tmp_path], tmp_path / "rep").read_text(encoding="utf-8")
    assert "<img" not in md and "<script" not in md and "<b>" not in md
    assert "[click](" not in md and r"\[click\](javascript:" in md  # shown, not a link
    table = md.split("## Success per task family", 1)[1].split("## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert len(rows) == 2 + len(families)  # header, rule, one row a family: none broken by | or a newline
    assert all(len(re.split(r"(?<!\\)\|", line)) == 4 for line in rows), rows
    assert (tmp_path / "rep" / "family_success.png").is_file()


def test_an_episode_of_twenty_thousand_turns_is_drawn(browser_context, tmp_path):
    """The page laid a tree out by recursion, one call a turn: a long harness session
    overflowed the browser's stack ("Maximum call stack size exceeded") and drew nothing."""
    t = RolloutTree(meta={"seed": 0})
    parent = None
    for _ in range(20_000):
        parent = t.add(Node(context_ids=[1], action_ids=[2], logprobs=[-0.1], entropies=[0.1], action_text="a",
                            observation="o"), parent).id
    write_trees(tmp_path / "trees.jsonl", [t])
    page = browser_context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(write_static(Run(tmp_path / "trees.jsonl"), tmp_path / "v.html", None).as_uri())
        page.wait_for_selector("body[data-ready='1']", timeout=15_000)
        page.click("tr.tree-row[data-tree='0']")
        page.wait_for_selector("#tree-canvas g.node[data-node='19999']", state="attached", timeout=30_000)
        assert errors == []
    finally:
        page.close()


def test_a_tree_id_that_is_no_index_is_a_404(tmp_path):
    """'²' passes str.isdigit and a 5,000-digit id passes too; int() refused both: a 500."""
    f = tmp_path / "trees.jsonl"
    write_trees(f, [fork_tree()])
    server = ViewerServer(Run(f), port=0).start()
    try:
        for tail in ("%C2%B2", "9" * 5000, "1" * 20, "-1", "x"):
            status, body = _get(server.url, f"/api/tree/{tail}", None)
            assert status == 404 and b"no tree" in body, (tail[:20], status, body[:200])
        assert _get(server.url, "/api/tree/0", None)[0] == 200
    finally:
        server.close()


def test_static_reads_each_batchs_allocation_report_once(tmp_path, monkeypatch):
    """--static asked every tree for its batch's report, found the batch's first tree by
    a scan of the whole index and parsed that tree again: quadratic in trees."""
    trees = [fork_tree(k) for k in range(30)]
    trees[0].meta["allocation_report"] = {"entropy_branch": {"threshold": 0.5}}
    write_trees(tmp_path / "trees.jsonl", trees)
    run = Run(tmp_path / "trees.jsonl")
    parsed: list[int] = []
    real = Run.tree

    def counting(self: Run, index: int) -> RolloutTree:
        parsed.append(index)
        return real(self, index)

    monkeypatch.setattr(Run, "tree", counting)
    write_static(run, tmp_path / "v.html", None)
    assert sorted(parsed) == [0, *range(30)]  # each tree once, the batch's first once more
    assert run.batch_report(29) == {"entropy_branch": {"threshold": 0.5}}


def test_summary_fields_from_meta_are_shortened(tmp_path):
    t = fork_tree()
    t.meta.update(env="e" * 100_000, allocator="a" * 100_000, family="f" * 100_000,
                  task={"doc": "t" * 100_000}, seed="s" * 100_000)
    write_trees(tmp_path / "trees.jsonl", [t])
    row = run_index(Run(tmp_path / "trees.jsonl"))["trees"][0]
    for key in ("env", "allocator", "family", "task", "seed"):
        assert isinstance(row[key], str) and 0 < len(row[key]) <= 120, key
    assert row["task"].startswith("{'doc': 'ttt")
    plain = run_index(Run(_plain_run(tmp_path)))["trees"][0]
    assert (plain["task"], plain["seed"], plain["env"]) == (0, 1, "agentrl/Fake-v0")  # ints stay ints


def _plain_run(tmp_path: Path) -> Path:
    write_trees(tmp_path / "plain.jsonl", [fork_tree()])
    return tmp_path / "plain.jsonl"


def test_idle_connections_take_a_bounded_number_of_threads(tmp_path, monkeypatch):
    """One thread a connection, with no bound and no timeout: 100 connections that send
    nothing held 100 threads for as long as they stayed open. Now at most
    _MAX_CONNECTIONS are served at once, and an idle one is closed after _IDLE_SECONDS."""
    import socket
    import threading

    from agentrl.viewer import server as server_module

    monkeypatch.setattr(server_module, "_IDLE_SECONDS", 1)
    write_trees(tmp_path / "trees.jsonl", [fork_tree()])
    server = ViewerServer(Run(tmp_path / "trees.jsonl"), port=0).start()
    host, port = server.httpd.server_address[:2]
    before = threading.active_count()
    socks = []
    try:
        for _ in range(100):
            socks.append(socket.create_connection((host, port), timeout=10))
        most = 0
        for _ in range(20):
            most = max(most, threading.active_count() - before)
            threading.Event().wait(0.05)
        assert 0 < most <= server_module._MAX_CONNECTIONS
        # the idle connections stay open on the client's side; the server times them out
        with urllib.request.urlopen(server.url + "api/run", timeout=60) as r:
            assert r.status == 200
    finally:
        for s in socks:
            s.close()
        server.close()


def test_close_returns_while_every_connection_slot_is_held(tmp_path, monkeypatch):
    """With every slot held by a connection that sent nothing, the accept loop waited for a
    free slot with no timeout, so close() (which waits for that loop) hung until a
    connection timed out: _IDLE_SECONDS, or for ever for a client that trickles bytes."""
    import socket
    import threading

    from agentrl.viewer import server as server_module

    monkeypatch.setattr(server_module, "_MAX_CONNECTIONS", 2)
    monkeypatch.setattr(server_module, "_IDLE_SECONDS", 120)
    write_trees(tmp_path / "trees.jsonl", [fork_tree()])
    server = ViewerServer(Run(tmp_path / "trees.jsonl"), port=0).start()
    host, port = server.httpd.server_address[:2]
    socks = [socket.create_connection((host, port), timeout=10) for _ in range(4)]
    try:
        threading.Event().wait(0.5)  # the loop takes two and waits for a slot for the third
        closing = threading.Thread(target=server.close, daemon=True)
        closing.start()
        closing.join(timeout=10)
        assert not closing.is_alive(), "close() waited for a connection slot"
    finally:
        for s in socks:
            s.close()


def test_steps_that_are_not_all_numbers_are_listed_not_a_type_error(tmp_path):
    """A tree whose meta step is text ('x', or a float the summary keeps as text since the
    fields were shortened) beside int steps made Run.steps sort str against int: the index
    (the page's first request) failed with a TypeError."""
    trees = [fork_tree(k) for k in range(4)]
    for t, step in zip(trees, [2, "x", 2.5, 1], strict=True):
        t.meta["step"] = step
    write_trees(tmp_path / "trees.jsonl", trees)
    assert run_index(Run(tmp_path / "trees.jsonl"))["steps"] == [1, 2, "2.5", "x"]
