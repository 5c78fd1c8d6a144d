"""The viewer against what a user meets: a tokenizer that takes its time, a run with a tree
this code cannot draw, a run still being written, an IPv6 loopback, huge trees.

Each test names the input and the outcome; the server is tested at the HTTP level.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from agentrl.types import write_trees
from agentrl.viewer import Run, ViewerServer

from .conftest import fork_tree


def _json(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def test_the_run_index_is_served_while_the_tokenizer_still_loads(tmp_path, monkeypatch):
    """The index waited for the tokenizer: the table stayed blank for as long as transformers
    took to import and load (seconds), or for ever for a load that hung. A tree waits for it
    a bounded time, then comes with token ids only."""
    from agentrl.viewer import server as server_module

    monkeypatch.setattr(server_module, "_TOKENIZER_WAIT_S", 0.5)
    write_trees(tmp_path / "trees.jsonl", [fork_tree()])
    loaded = threading.Event()

    def slow_decoder():
        loaded.wait(30)
        return (lambda ids: {i: f"t{i}" for i in ids}), "tokenizer of slow"

    server = ViewerServer(Run(tmp_path / "trees.jsonl"), port=0, load_decoder=slow_decoder).start()
    try:
        t0 = time.monotonic()
        index = _json(server.url + "api/run", timeout=5)
        assert time.monotonic() - t0 < 3
        assert index["totals"]["trees"] == 1 and "loading" in index["about"]["tokens"]
        assert _json(server.url + "api/tree/0", timeout=5)["vocab"] == {}  # ids only, not yet texts
        loaded.set()
        deadline = time.monotonic() + 10
        while _json(server.url + "api/run")["about"]["tokens"] != "tokenizer of slow":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert _json(server.url + "api/tree/0")["vocab"]["10"] == "t10"  # the ids-only tree was not kept
    finally:
        loaded.set()
        server.close()


def _run_with_an_undrawable_tree(tmp_path):
    """Three trees; the middle one indexes (its numbers add up) but does not parse into a
    ``RolloutTree``: a node field this version does not know (a newer writer's)."""
    bad = fork_tree(2).to_dict()
    bad["nodes"][0]["written_by_a_newer_version"] = 1
    lines = [json.dumps(fork_tree(1).to_dict()), json.dumps(bad), json.dumps(fork_tree(3).to_dict())]
    (tmp_path / "trees.jsonl").write_text("\n".join(lines) + "\n")
    return Run(tmp_path / "trees.jsonl")


def test_a_static_page_keeps_every_tree_it_can_draw_and_names_the_one_it_cannot(tmp_path):
    """One tree that indexed but did not parse raised out of write_static: no page at all,
    and a traceback from ``agentrl view --static``."""
    import re

    from agentrl.viewer import write_static

    run = _run_with_an_undrawable_tree(tmp_path)
    failed: list[str] = []
    html = write_static(run, tmp_path / "v.html", None, failed=failed).read_text()
    trees = dict(re.findall(r'<script type="application/json" id="tree-(\d+)">(.*?)</script>', html, re.S))
    assert sorted(trees) == ["0", "1", "2"]
    assert "nodes" in json.loads(trees["0"]) and "nodes" in json.loads(trees["2"])
    assert "written_by_a_newer_version" in json.loads(trees["1"])["error"]  # the page says why, on opening it
    assert len(failed) == 1 and failed[0].startswith("tree 1 ") and "written_by_a_newer_version" in failed[0]


def test_agentrl_view_static_warns_of_a_tree_it_could_not_draw(tmp_path):
    import typer
    from typer.testing import CliRunner

    from agentrl.viewer.cli import register

    app = typer.Typer()
    register(app)
    _run_with_an_undrawable_tree(tmp_path)
    res = CliRunner().invoke(app, ["view", str(tmp_path / "trees.jsonl"), "--static", str(tmp_path / "v.html"),
                                   "--no-tokens"])
    assert res.exit_code == 0, res.output
    assert "1 tree could not be drawn" in res.output and "tree 1 " in res.output


def test_a_tree_whose_file_was_replaced_since_indexing_is_refused_not_shown_as_another(tmp_path):
    """A resumed run redoes a step and replaces its trees file whole; a new ``agentrl rollout``
    into the same folder replaces trajectories.jsonl. Tree i was read from the byte range
    indexed before: a line of the same length there was parsed and shown as tree i, under
    the table row of the tree that was there before."""
    from agentrl.viewer.run import RunChanged

    f = tmp_path / "trajectories.jsonl"
    write_trees(f, [fork_tree(seed=1)])
    run = Run(tmp_path)
    assert run.tree(0).meta["seed"] == 1
    write_trees(tmp_path / "new.jsonl", [fork_tree(seed=2)])  # the same length, another task
    (tmp_path / "new.jsonl").replace(f)
    try:
        got = run.tree(0).meta["seed"]
    except RunChanged as e:
        assert "trajectories.jsonl" in str(e) and "changed" in str(e)
    else:
        raise AssertionError(f"tree 0 was shown from the replaced file: seed {got}, its row says 1")
    assert run.changed()
    assert Run(tmp_path).tree(0).meta["seed"] == 2


def test_the_server_shows_a_run_that_is_still_being_written(tmp_path):
    """The server indexed the run once, at start: a training run's new steps and metrics
    never showed, reload or not, until the viewer was restarted. The index is rebuilt
    when a file changed; a tree asked for under the index the page loaded before is
    refused with 409 (reload), never answered from the new one."""
    (tmp_path / "trees").mkdir()
    write_trees(tmp_path / "trees" / "step-000001.jsonl", [fork_tree(seed=1)])
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/reward": 0.25}) + "\n")
    server = ViewerServer(Run(tmp_path), port=0).start()
    try:
        first = _json(server.url + "api/run")
        assert first["totals"]["trees"] == 1
        gen = first["generation"]
        assert _json(server.url + f"api/tree/0?generation={gen}")["meta"]["seed"] == 1
        write_trees(tmp_path / "trees" / "step-000002.jsonl", [fork_tree(seed=2)])
        with open(tmp_path / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps({"step": 2, "rollout/reward": 0.5}) + "\n")
        now = _json(server.url + "api/run")
        assert now["totals"]["trees"] == 2 and now["steps"] == [1, 2]
        reward = next(p for p in now["curves"] if p["title"] == "reward")["series"][0]["points"]
        assert reward == [[1, 0.25], [2, 0.5]]
        assert now["generation"] != gen
        try:
            urllib.request.urlopen(server.url + f"api/tree/1?generation={gen}", timeout=10)
            raise AssertionError("a tree was answered under an index the page no longer holds")
        except urllib.error.HTTPError as e:
            assert e.code == 409 and "reload" in json.loads(e.read())["error"]
        assert _json(server.url + f"api/tree/1?generation={now['generation']}")["meta"]["seed"] == 2
        assert _json(server.url + "api/run")["generation"] == now["generation"]  # unchanged: not rebuilt
    finally:
        server.close()


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def test_the_server_serves_on_the_ipv6_loopback(tmp_path):
    """``--host ::1`` (named a loopback address by the server's own docstring and the CLI)
    failed: 'Address family for hostname not supported' (the server was IPv4 only), and its
    URL would have read http://::1:PORT/."""
    import pytest

    if not _ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback")
    write_trees(tmp_path / "trees.jsonl", [fork_tree()])
    server = ViewerServer(Run(tmp_path / "trees.jsonl"), host="::1", port=0).start()
    try:
        assert server.url.startswith("http://[::1]:") and server.loopback_only
        assert _json(server.url + "api/run")["totals"]["trees"] == 1
    finally:
        server.close()


def test_the_server_keeps_a_bounded_number_of_bytes_of_trees_not_just_of_trees(tmp_path, monkeypatch):
    """The server kept the last 64 trees' JSON whatever their size: a run of trees with
    megabytes of web-page observations each held 64 of them (hundreds of MB to GBs) for
    as long as it served. The cache is now bounded in bytes too."""
    from agentrl.viewer import server as server_module

    page = "<div>" + "x" * 20_000 + "</div>"
    trees = []
    for k in range(8):
        t = fork_tree(k)
        t.nodes[0].observation = page
        trees.append(t)
    write_trees(tmp_path / "trees.jsonl", trees)
    server = ViewerServer(Run(tmp_path / "trees.jsonl"), port=0)
    one = len(server.tree_json(0))
    monkeypatch.setattr(server_module, "_CACHED_BYTES", 3 * one)
    for i in range(8):
        assert json.loads(server.tree_json(i))["meta"]["seed"] == i
    assert sum(map(len, server._trees.values())) <= 3 * one and list(server._trees) == [5, 6, 7]
    monkeypatch.setattr(server_module, "_CACHED_BYTES", one // 2)  # a tree larger than the bound: not kept
    server._trees.clear()
    server.tree_json(0)
    assert not server._trees
    server.close()


def test_a_file_of_lines_that_are_no_trees_is_counted_not_listed_line_by_line(tmp_path):
    """Every skipped line was kept and sent to the page, which joined them all into one
    line of text: a JSONL file of another format (a dataset, a log) in the run's place
    gave an index of megabytes, each line named. Now the first ones are named, all are
    counted."""
    from agentrl.viewer import run_index
    from agentrl.viewer.page import to_json

    rows = [json.dumps(fork_tree().to_dict())] + [json.dumps({"prompt": "p", "completion": "c"})] * 20_000
    (tmp_path / "trees.jsonl").write_text("\n".join(rows) + "\n")
    run = Run(tmp_path / "trees.jsonl")
    assert len(run) == 1 and run.skipped_count == 20_000
    assert run.skipped[0] == "trees.jsonl:2" and len(run.skipped) <= 100
    assert run.skipped_note.startswith("skipped 20000 unreadable lines: trees.jsonl:2, trees.jsonl:3")
    index = run_index(run)
    assert index["skipped_count"] == 20_000 and len(to_json(index["skipped"])) < 2_000


def test_a_client_that_goes_away_mid_answer_prints_no_traceback(tmp_path, capfd):
    """A reload or a click to the next tree while a big tree was on its way: the write
    failed (broken pipe), the handler tried to send a 500 on the same dead socket, and
    the server printed two tracebacks into the user's terminal."""
    import socket
    import struct

    t = fork_tree()
    t.nodes[0].observation = "x" * 8_000_000  # more than the socket buffers hold
    write_trees(tmp_path / "trees.jsonl", [t])
    server = ViewerServer(Run(tmp_path / "trees.jsonl"), port=0).start()
    host, port = server.httpd.server_address[:2]
    try:
        server.tree_json(0)  # parsed and cached: the request below only writes
        s = socket.create_connection((host, port), timeout=10)
        s.sendall(f"GET /api/tree/0 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        s.recv(1024)  # the answer has started
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # a reset, as a browser that gives up on a page
        time.sleep(1.0)
        assert _json(server.url + "api/run")["totals"]["trees"] == 1  # still serving
    finally:
        server.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err[-1500:]


def test_the_report_of_a_branched_run_whose_steps_are_not_all_numbers_is_written(tmp_path):
    """b85a148 sorted steps with step_order in the index and the divergence plot, but the
    branch-budget plot still sorted int against str: ``agentrl report`` raised TypeError."""
    from agentrl.viewer.report import write_report

    trees = [fork_tree(1), fork_tree(2), fork_tree(3)]
    for t, step in zip(trees, [2, "x", 1], strict=True):
        t.meta["step"] = step
    write_trees(tmp_path / "trees.jsonl", trees)
    md = write_report([tmp_path / "trees.jsonl"], tmp_path / "rep").read_text()
    assert "![branch budget](branch_budget.png)" in md


def test_the_report_leaves_out_a_tree_it_cannot_read_and_says_so(tmp_path):
    """One tree that indexed but did not parse (a newer writer's node field, a file changed
    since indexing) raised out of ``agentrl report``: no report, a traceback."""
    from agentrl.viewer.report import write_report

    _run_with_an_undrawable_tree(tmp_path)
    md = write_report([tmp_path / "trees.jsonl"], tmp_path / "rep").read_text()
    assert "1 tree could not be read" in md and "tree 1 " in md and "written_by_a_newer_version" in md
    table = md.split("## Success per task family", 1)[1].split("## ", 1)[0]
    assert "| pick | 0.500 (4) |" in table  # the two readable trees: 2 of 4 non-failed episodes


def test_a_line_nested_past_the_json_parsers_limit_is_skipped_not_a_crash(tmp_path):
    """json.loads raises RecursionError (no ValueError) on a line nested ~1000 deep: opening
    the run raised out of Run(), so neither the page nor the report came up for any tree."""
    lines = [json.dumps(fork_tree().to_dict()), "[" * 5000 + "]" * 5000, '{"meta": ' * 3000 + "{}" + "}" * 3000]
    (tmp_path / "trees.jsonl").write_text("\n".join(lines) + "\n")
    run = Run(tmp_path / "trees.jsonl")
    assert len(run) == 1 and run.skipped == ["trees.jsonl:2", "trees.jsonl:3"]


class _ByteLevelTokenizer:
    """The two tokens SmolLM2's byte-level BPE splits 😀 (F0 9F 98 80) into, and one whole token:
    ``decode`` of either half alone is U+FFFD, as transformers gives it."""

    pieces = {1: "ĠðŁĺ", 2: "Ģ", 3: "ä¸Ń", 4: "<0xE4>"}  # 4: a sentencepiece byte-fallback piece
    texts = {1: " \ufffd", 2: "\ufffd", 3: "中", 4: "\ufffd"}

    def decode(self, ids):
        return "".join(self.texts[i] for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i] for i in ids]


def test_a_token_that_holds_part_of_a_character_shows_its_bytes_not_a_replacement_mark():
    """Each id was decoded alone: a token holding part of a UTF-8 character (an emoji, most
    CJK text under byte-level BPE) showed as '�', the same mark for every such token, so
    the token view hid what the model sampled. Its bytes are shown now."""
    from agentrl.viewer.tokens import _decoder

    decode = _decoder(_ByteLevelTokenizer())
    assert decode([1, 2, 3, 4]) == {1: " \\xf0\\x9f\\x98", 2: "\\x80", 3: "中", 4: "\\xe4"}


def test_a_trees_payload_holds_each_action_once_not_once_per_episode_through_it():
    """Every episode carried the full text of every action on its path, for the compare
    view's one-line summary (28 characters each): a tree of 32 episodes that share a
    10-turn trunk of long (reasoning) actions sent each trunk action 33 times, 8x the text
    the tree holds."""
    from agentrl.types import Node, RolloutTree
    from agentrl.viewer import tree_payload
    from agentrl.viewer.page import to_json

    text = "think " * 1_700  # ~10 kB, a reasoning model's turn
    t = RolloutTree(meta={"seed": 0})
    parent = None
    for _ in range(10):
        parent = t.add(Node(context_ids=[1], action_ids=[2], logprobs=[-0.1], entropies=[0.1],
                            action_text=text, observation="o"), parent).id
    for _ in range(32):
        t.add(Node(context_ids=[1], action_ids=[2], logprobs=[-0.1], entropies=[0.1], action_text=text,
                   observation="o", terminated=True), parent)
    held = 42 * len(text)
    payload = tree_payload(t)
    assert len(to_json(payload)) < 1.5 * held
    first = payload["episodes"][0]["actions"]
    assert len(first) == 11 and all(text.startswith(a) and 28 <= len(a) < 200 for a in first)


def _wide_tree(leaves: int):
    from agentrl.types import Node, RolloutTree

    def node():
        return Node(context_ids=[1] * 20, action_ids=[2] * 10, logprobs=[-0.1] * 10, entropies=[0.1] * 10,
                    action_text="a", observation="o")

    t = RolloutTree(meta={"seed": 0})
    trunk = None
    for _ in range(5):
        trunk = t.add(node(), trunk).id
    for _ in range(leaves):
        q = trunk
        for _ in range(4):
            q = t.add(node(), q).id
    return t


def test_a_trees_payload_reads_each_episodes_values_once_not_once_per_node(monkeypatch):
    """Each node looked through every episode's values for its own (``n.id in vals`` for
    every leaf): 3,000 leaves of 15,000 nodes took 13 s to draw, quadratic. Counted here
    as lookups into the per-episode values, which must not grow as nodes x leaves."""
    from agentrl.viewer import payload as payload_module

    lookups = [0]

    class Counting(dict):
        def __contains__(self, key):
            lookups[0] += 1
            return super().__contains__(key)

        def __getitem__(self, key):
            lookups[0] += 1
            return super().__getitem__(key)

    real = payload_module.episode_values

    def counted(tree, spec):
        values, note = real(tree, spec)
        return {name: {leaf: Counting(nodes) for leaf, nodes in per.items()} for name, per in values.items()}, note

    monkeypatch.setattr(payload_module, "episode_values", counted)
    tree = _wide_tree(200)
    payload = payload_module.tree_payload(tree)
    assert len(payload["episodes"]) == 200 and all(n["advantage"] is not None for n in payload["nodes"])
    on_paths = sum(len(tree.path(leaf.id)) for leaf in tree.leaves())  # 200 x 9
    assert lookups[0] <= 4 * on_paths, f"{lookups[0]} lookups for {on_paths} (node, episode) pairs"


def test_a_config_beside_the_trees_that_does_not_parse_is_named_not_fatal(tmp_path):
    """A hand-edited config.yaml with a YAML error raised out of Run.config: the index
    (the page's first request) was a 500, and --static and agentrl report raised, for a
    file the viewer reads only to name the run and its credit method."""
    from agentrl.viewer import run_index

    write_trees(tmp_path / "trajectories.jsonl", [fork_tree()])
    (tmp_path / "config.yaml").write_text("train:\n  credit: [grpo\n")
    run = Run(tmp_path)
    assert run.config == {}
    index = run_index(run)
    assert index["totals"]["trees"] == 1
    assert "config.yaml" in index["about"]["config"] and "not read" in index["about"]["config"]


def test_a_negative_static_limit_is_refused_not_a_page_of_minus_one_trees(tmp_path):
    import typer
    from typer.testing import CliRunner

    from agentrl.viewer.cli import register

    app = typer.Typer()
    register(app)
    write_trees(tmp_path / "trees.jsonl", [fork_tree()])
    res = CliRunner().invoke(app, ["view", str(tmp_path / "trees.jsonl"), "--static", str(tmp_path / "v.html"),
                                   "--no-tokens", "--limit", "-1"])
    assert res.exit_code == 2 and not (tmp_path / "v.html").exists(), res.output


def test_a_turn_or_a_curve_of_more_than_125k_values_is_drawn(browser_context, tmp_path):
    """The page took minima and maxima with Math.min(...xs) and gathered logprobs with
    push(...xs): V8 passes each value as an argument and throws RangeError past ~125k, so
    a turn of that many tokens left the token view and the compare view blank (and a
    panel of that many points, its curve). Checked on the page's own functions."""
    from agentrl.viewer import write_static

    write_trees(tmp_path / "trees.jsonl", [fork_tree()])
    page = browser_context.new_page()
    try:
        page.goto(write_static(Run(tmp_path / "trees.jsonl"), tmp_path / "v.html", None).as_uri())
        page.wait_for_selector("body[data-ready='1']", timeout=15_000)
        got = page.evaluate("""() => {
            const n = 200000, big = Array.from({ length: n }, (_, k) => -k / n);
            const acts = big.map((x, k) => ({ ent: k % 7, adv: x, ratio: -x }));
            const t = { episodes: [], nodes: [], roots: [], tokens: { 0: { logprobs: big, entropies: big } } };
            try {
              return [extent(big), tokenScale(acts).ent, stats(t).logprob < 0];
            } catch (e) { return String(e); }
        }""")
        assert got == [[-(199_999 / 200_000), 0], 6, True], got
    finally:
        page.close()


def test_compare_shows_no_change_where_one_side_has_no_number(browser_context, tmp_path):
    """A tree whose every episode failed has no success rate and no mean reward ('–'); the
    compare view still printed a change beside it, null - 0.5 being -0.5 in JavaScript:
    'success rate – (-0.500)'."""
    from agentrl.viewer import write_static

    write_trees(tmp_path / "trees.jsonl", [fork_tree()])
    page = browser_context.new_page()
    try:
        page.goto(write_static(Run(tmp_path / "trees.jsonl"), tmp_path / "v.html", None).as_uri())
        page.wait_for_selector("body[data-ready='1']", timeout=15_000)
        got = page.evaluate("() => [statDelta(null, 0.5), statDelta(0.5, null), statDelta(0.75, 0.5), "
                            "statDelta(0.5, undefined)]")
        assert got == [None, None, 0.25, None]
    finally:
        page.close()


def test_a_compare_link_to_trees_the_run_does_not_hold_opens_the_default_pair(browser_context, tmp_path):
    """A #compare=A,B link kept from a bigger run (or a run since re-indexed) read
    trees[A].env of a tree that is not there: a TypeError, and a blank compare view."""
    from agentrl.viewer import write_static

    write_trees(tmp_path / "trees.jsonl", [fork_tree(1), fork_tree(2)])
    page = browser_context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(write_static(Run(tmp_path / "trees.jsonl"), tmp_path / "v.html", None).as_uri() + "#compare=5,7")
        page.wait_for_selector("body[data-ready='1']", timeout=15_000)
        page.wait_for_selector("#compare-body .col[data-tree='1']", timeout=10_000)
        assert errors == []
    finally:
        page.close()


def test_a_run_opened_again_reads_only_the_files_that_changed(tmp_path, monkeypatch):
    """The server indexes a changed run again on each page load: a training run adds a
    step's file (and a metrics row) every step, and every tree of every step was read
    and parsed again each time. Files whose stamp did not change keep their index."""
    from agentrl.viewer import run as run_module

    (tmp_path / "trees").mkdir()
    write_trees(tmp_path / "trees" / "step-000001.jsonl", [fork_tree(1), fork_tree(2)])
    write_trees(tmp_path / "trees" / "step-000003.jsonl", [fork_tree(5)])
    (tmp_path / "trees" / "step-000003.jsonl").write_text(
        (tmp_path / "trees" / "step-000003.jsonl").read_text() + "{torn\n")
    first = Run(tmp_path)
    parsed: list[int | str | None] = []
    real = run_module.summarize_tree_dict

    def counting(data, *args, **kwargs):
        parsed.append(data["meta"]["seed"])
        return real(data, *args, **kwargs)

    monkeypatch.setattr(run_module, "summarize_tree_dict", counting)
    write_trees(tmp_path / "trees" / "step-000002.jsonl", [fork_tree(3), fork_tree(4)])  # sorts between
    again = first.reopen()
    assert parsed == [3, 4]  # only the new file
    assert [s.seed for s in again.summaries] == [1, 2, 3, 4, 5]
    assert [s.index for s in again.summaries] == [r.index for r in again.refs] == [0, 1, 2, 3, 4]
    assert [again.tree(i).meta["seed"] for i in range(5)] == [1, 2, 3, 4, 5]
    assert again.skipped == ["trees/step-000003.jsonl:2"] and again.skipped_count == 1
    assert not again.changed()
    write_trees(tmp_path / "trees" / "step-000001.jsonl", [fork_tree(9)])  # a resumed step, replaced
    parsed.clear()
    third = again.reopen()
    assert parsed == [9] and [s.seed for s in third.summaries] == [9, 3, 4, 5]
    assert third.tree(0).meta["seed"] == 9 and third.tree(3).meta["seed"] == 5


def test_the_loss_mask_view_marks_the_tokens_the_update_left_out(browser_context, tmp_path):
    """The 'loss mask' colouring showed every action token as trained (its legend: 'action
    (trained)'; its tooltip: 'loss mask 1'), also a token the update masked out (TIP,
    staleness: null in the saved values) and every token of an episode it left out."""
    from agentrl.viewer import write_static

    t = fork_tree()
    t.meta["token_values"] = {"1": {"advantages": [0.5, None, 2.0]},  # node 0's second token masked out
                              "2": {"trained": False, "reason": "MC-GRPO's pivot: no gradient"},
                              "3": {"trained": False, "reason": "failed episode, left out"}}
    write_trees(tmp_path / "trees.jsonl", [t])
    page = browser_context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(write_static(Run(tmp_path / "trees.jsonl"), tmp_path / "v.html", None).as_uri() + "#tokens=0&node=0&leaf=1")
        page.wait_for_selector("body[data-ready='1']", timeout=15_000)
        page.wait_for_selector("#token-view .tok.act")
        colours = page.eval_on_selector_all("#token-view .tok.act", "els => els.map(e => e.style.background)")
        assert len(colours) == 2 and colours[0] != colours[1], colours
        page.hover("#token-view .tok.act >> nth=1")
        assert "left out of the update" in page.inner_text("#tok-tip")
        assert "left out of the update" in page.inner_text("#token-legend")
        page.goto(page.url.split("#")[0] + "#tokens=0&node=2&leaf=2")
        page.wait_for_selector("#token-view .tok.act")
        page.hover("#token-view .tok.act >> nth=0")
        assert "left out of the update" in page.inner_text("#tok-tip")
        assert errors == []
    finally:
        page.close()


def test_two_static_pages_written_to_one_path_at_once_both_finish_whole(tmp_path):
    """Both writers used the one temporary name .v.html.tmp: the second truncated what the
    first was writing, and whichever renamed it second found it gone (FileNotFoundError),
    or the page kept a mix of both."""
    import re

    from agentrl.viewer import write_static

    write_trees(tmp_path / "trees.jsonl", [fork_tree(k) for k in range(300)])
    run_a, run_b = Run(tmp_path / "trees.jsonl"), Run(tmp_path / "trees.jsonl")
    errors: list[BaseException] = []

    def write(run):
        try:
            write_static(run, tmp_path / "v.html", None)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=write, args=(r,)) for r in (run_a, run_b)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert errors == []
    html = (tmp_path / "v.html").read_text()
    assert len(re.findall(r'id="tree-\d+"', html)) == 300 and html.rstrip().endswith("</html>")
    assert not list(tmp_path.glob(".v.html*"))  # no temporary file left behind


def test_two_reports_written_into_one_folder_at_once_both_finish(tmp_path, monkeypatch):
    """Every plot went through one temporary name (.NAME.tmp.png), and report.md through
    .report.md.tmp: two 'agentrl report RUN' at once (measured: 2 of 3 processes) failed with
    FileNotFoundError when the other had renamed the file first."""
    from types import SimpleNamespace

    from agentrl.viewer import report

    monkeypatch.setattr(report, "_plt", lambda: SimpleNamespace(close=lambda fig: None))
    both = threading.Barrier(2)

    class Fig:  # writes its file, then waits for the other writer to have written its own
        def tight_layout(self):
            pass

        def savefig(self, path, dpi):
            Path(path).write_bytes(b"png")
            both.wait(timeout=10)

    errors: list[BaseException] = []

    def save():
        try:
            report._save(Fig(), tmp_path, "plot.png")
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=save) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert errors == [] and (tmp_path / "plot.png").read_bytes() == b"png"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]


def test_a_report_plot_interrupted_mid_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """Ctrl-C while matplotlib wrote a plot left its temporary file in the report folder."""
    from types import SimpleNamespace

    import pytest

    from agentrl.viewer import report

    monkeypatch.setattr(report, "_plt", lambda: SimpleNamespace(close=lambda fig: None))

    class Fig:
        def tight_layout(self):
            pass

        def savefig(self, path, dpi):
            Path(path).write_bytes(b"pn")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        report._save(Fig(), tmp_path, "plot.png")
    assert list(tmp_path.iterdir()) == []


def test_close_of_a_server_never_started_returns(tmp_path):
    """socketserver's shutdown() waits for serve_forever to end; on a server made but never
    started (a notebook, a test, a start that failed) close() waited for ever."""
    write_trees(tmp_path / "trees.jsonl", [fork_tree()])
    server = ViewerServer(Run(tmp_path / "trees.jsonl"), port=0)
    closing = threading.Thread(target=server.close, daemon=True)
    closing.start()
    closing.join(timeout=5)
    assert not closing.is_alive(), "close() of a server never started hung"


def test_a_server_that_cannot_bind_loads_no_tokenizer(tmp_path):
    """The tokenizer thread started before the port was bound: on a busy port, 'agentrl view'
    said so and exited while a daemon thread was still importing transformers."""
    import socket

    import pytest

    write_trees(tmp_path / "trees.jsonl", [fork_tree()])
    called = threading.Event()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(OSError):
            ViewerServer(Run(tmp_path / "trees.jsonl"), port=busy.getsockname()[1],
                         load_decoder=lambda: (called.set(), (None, "x"))[1])
    assert not called.wait(0.5)


def test_a_trees_file_that_cannot_be_read_is_named_and_the_others_are_shown(tmp_path, monkeypatch):
    """A step's file deleted between the folder's listing and its reading (old steps pruned
    while the viewer indexes), or one another user's permissions keep from this one, raised
    out of Run(): the viewer and the report showed nothing of the run."""
    from agentrl.viewer import run as run_module

    (tmp_path / "trees").mkdir()
    write_trees(tmp_path / "trees" / "step-000001.jsonl", [fork_tree(1)])
    write_trees(tmp_path / "trees" / "step-000002.jsonl", [fork_tree(2)])
    real = run_module.tree_files
    monkeypatch.setattr(run_module, "tree_files", lambda path: [*real(path)[:1], tmp_path / "trees" / "gone.jsonl",
                                                                 *real(path)[1:]])
    run = Run(tmp_path)
    assert [s.seed for s in run.summaries] == [1, 2] and run.tree(1).meta["seed"] == 2
    assert run.skipped_count == 1 and run.skipped[0].startswith("trees/gone.jsonl (unreadable: FileNotFoundError")


def test_a_tree_whose_file_was_deleted_since_indexing_says_the_run_changed(tmp_path):
    """Old steps pruned while the page is open: the tree was a 500 'FileNotFoundError', not
    the 409 'reload' of every other change to the run."""
    from agentrl.viewer.run import RunChanged

    (tmp_path / "trees").mkdir()
    write_trees(tmp_path / "trees" / "step-000001.jsonl", [fork_tree(1)])
    server = ViewerServer(Run(tmp_path), port=0).start()
    try:
        (tmp_path / "trees" / "step-000001.jsonl").unlink()
        try:
            server.run.tree(0)
            raise AssertionError("a deleted file's tree was read")
        except RunChanged as e:
            assert "step-000001.jsonl" in str(e)
        import pytest

        with pytest.raises(urllib.error.HTTPError) as got:
            urllib.request.urlopen(server.url + "api/tree/0", timeout=10)
        assert got.value.code == 409 and "reload" in json.loads(got.value.read())["error"]
    finally:
        server.close()


def test_the_first_tree_of_a_file_is_parsed_once_when_drawn(tmp_path, monkeypatch):
    """A tree without its batch's allocation report asked the batch's first tree for it;
    the first tree of a file is that tree, and it was read and parsed a second time (a
    step file of one 20,000-turn tree: twice the wait)."""
    write_trees(tmp_path / "trees.jsonl", [fork_tree(1), fork_tree(2)])
    run = Run(tmp_path / "trees.jsonl")
    parsed: list[int] = []
    real = Run.tree

    def counting(self, index):
        parsed.append(index)
        return real(self, index)

    monkeypatch.setattr(Run, "tree", counting)
    from agentrl.viewer import tree_data

    tree_data(run, 0, None)
    assert parsed == [0]
    tree_data(run, 1, None)
    assert parsed == [0, 1]  # the batch's report (none) is known from tree 0 now


def test_a_config_section_of_the_wrong_type_is_named_not_fatal(tmp_path):
    """A hand-written ``env: x`` (a string where a mapping goes) raised AttributeError out of the
    index, --static and the report, which read the section as a mapping."""
    from agentrl.viewer import run_index
    from agentrl.viewer.report import write_report

    write_trees(tmp_path / "trajectories.jsonl", [fork_tree()])
    (tmp_path / "config.yaml").write_text("env: x\ntrain: 3\nrollout: [a]\npolicy:\n  model: m\n")
    run = Run(tmp_path)
    assert run.config == {"policy": {"model": "m"}}
    index = run_index(run)
    assert index["totals"]["trees"] == 1
    about = index["about"]["config"]
    assert all(f"{k} not read (a {t}, not a mapping)" in about for k, t in (("env", "str"), ("train", "int"),
                                                                          ("rollout", "list")))
    write_report([tmp_path], tmp_path / "report")
    assert (tmp_path / "report" / "report.md").is_file()
