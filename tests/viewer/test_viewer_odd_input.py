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


def _three_token_tree(token_values: object):
    """``fork_tree`` (leaves 1, 2 and 3, each an episode of 3 action tokens) with ``token_values``."""
    t = fork_tree()
    t.meta["token_values"] = token_values
    return t


def test_saved_token_values_that_do_not_fit_the_tree_are_named_and_the_tree_is_drawn(tmp_path):
    """A trainer-written ``token_values`` entry that is not a leaf's list of numbers (a key that
    is no node id, a list where a mapping belongs, text among the numbers) raised out of the
    payload: the tree's page was a 500. One of the wrong length was spread along the path
    silently, the values then sitting on the wrong tokens."""
    from agentrl.types import write_trees
    from agentrl.viewer.payload import tree_payload

    bad = {"1": {"advantages": [0.5, "x", 2.0]}, "2": [0.1], "leaf-3": {"advantages": [1.0]}}
    write_trees(tmp_path / "trees.jsonl", [_three_token_tree(bad)])
    server = ViewerServer(Run(tmp_path / "trees.jsonl"), port=0).start()
    try:
        status, body = _get(server.url + "api/tree/0")
    finally:
        server.close()
    assert status == 200, body
    note = body["credit"]["note"]
    assert "unreadable" in note and "leaf 1" in note and "leaf 2" in note and "'leaf-3'" in note, note
    assert not body["credit"]["saved"] and body["credit"]["method"] == "grpo"  # recomputed instead
    assert all(e["trained"] is None for e in body["episodes"])  # not known: nothing readable was saved

    # One entry of the wrong length is left out; the others still show, and the note says which.
    p = tree_payload(_three_token_tree({"1": {"advantages": [0.5, 2.0]},
                                        "2": {"advantages": [0.25, 0.75, 1.0]},
                                        "3": {"trained": False, "reason": "failed"}}))
    assert p["credit"]["saved"] and "leaf 1: advantages holds 2 values for 3 action tokens" in p["credit"]["note"]
    assert p["tokens"]["0"]["advantages"] == {"2": [0.25, 0.75]} and p["tokens"]["2"]["advantages"] == {"2": [1.0]}
    assert {e["leaf"]: e["trained"] for e in p["episodes"]} == {1: None, 2: True, 3: False}
    # token_values that is no mapping at all: recomputed, and said so
    p = tree_payload(_three_token_tree([1, 2, 3]))
    assert not p["credit"]["saved"] and "token_values is a list, not a mapping" in p["credit"]["note"]
    assert p["teacher_note"].startswith("not saved")


def test_the_report_survives_saved_token_values_that_do_not_fit_the_tree(tmp_path):
    """The report read the same entries unchecked: ``int('leaf-3')`` ended ``agentrl report``."""
    from agentrl.types import write_trees
    from agentrl.viewer.report import gather

    bad = {"1": {"teacher_logprobs": ["x", -0.2, -0.3]}, "2": "oops", "leaf-3": {"teacher_logprobs": [1.0]},
           "3": {"teacher_logprobs": [-0.5, -0.25, -1.0], "student_logprobs": [-0.75, -0.25, -1.0]}}
    write_trees(tmp_path / "trees.jsonl", [_three_token_tree(bad)])
    facts = gather(tmp_path / "trees.jsonl")
    # leaf 3 is the one readable entry: turn 0 (node 0) s - t = -0.25, 0 (mean -0.125); turn 1: 0
    assert {step: dict(turns) for step, turns in facts.divergence.items()} == {None: {0: [-0.125], 1: [0.0]}}


def _slow_tokenizer_server(tmp_path, monkeypatch):
    """A server whose tokenizer loads when the returned event is set; a tree waits 0.2 s for it."""
    import threading

    from agentrl.types import write_trees
    from agentrl.viewer import server as server_module

    monkeypatch.setattr(server_module, "_TOKENIZER_WAIT_S", 0.2)
    write_trees(tmp_path / "trees.jsonl", [fork_tree()])
    loaded = threading.Event()

    def slow_decoder():
        loaded.wait(30)
        return (lambda ids: {i: f"t{i}" for i in ids}), "tokenizer of slow"

    return ViewerServer(Run(tmp_path / "trees.jsonl"), port=0, load_decoder=slow_decoder).start(), loaded


def test_a_tree_served_before_the_tokenizer_is_ready_says_its_tokens_are_pending(tmp_path, monkeypatch):
    """A tree served with ids only looked like a tree of a run without a tokenizer: nothing
    told the page to ask again. It now says ``tokens_pending``, and the tokenizer's note."""
    server, loaded = _slow_tokenizer_server(tmp_path, monkeypatch)
    try:
        status, body = _get(server.url + "api/tree/0")
        assert status == 200 and body["tokens_pending"] is True and body["vocab"] == {}
        assert "loading the tokenizer" in body["tokens_note"]
        loaded.set()
        server._ready.wait(10)
        status, body = _get(server.url + "api/tree/0")
        assert body["tokens_pending"] is False and body["vocab"]["10"] == "t10"
        assert body["tokens_note"] == "tokenizer of slow"
    finally:
        loaded.set()
        server.close()


def test_a_tree_opened_while_the_tokenizer_loads_gets_its_texts_without_a_reload(browser_context, tmp_path,
                                                                                monkeypatch):
    """A tree opened before the tokenizer was ready came with ids only, and the page kept that
    copy (its own cache, and no sign it was provisional): texts showed only after a reload.
    The page now asks again while the tree's tokens are pending, and draws them in place."""
    server, loaded = _slow_tokenizer_server(tmp_path, monkeypatch)
    page = browser_context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(server.url + "#tokens=0&node=0")
        page.wait_for_selector("#token-view .tok.act")
        assert "⟨10⟩" in page.inner_text("#token-view") and "loading" in page.inner_text("#token-head")
        loaded.set()
        page.wait_for_function("document.querySelector('#token-view').innerText.includes('t10')", timeout=10000)
        assert "loading" not in page.inner_text("#token-head")
        assert "tokenizer of slow" in page.inner_text("#run-about")
    finally:
        loaded.set()
        page.close()
        server.close()
    assert errors == []


def test_a_reward_too_big_for_a_float_skips_its_tree_not_the_run(tmp_path):
    """A reward written as an integer of 400 digits (JSON has no limit; ``float()`` of it
    raises OverflowError) ended ``Run()``: the viewer, --static and the report opened nothing."""
    huge = fork_tree(2).to_dict()
    huge["nodes"][1]["reward"] = 10**400
    run = Run(_write_lines(tmp_path / "trees.jsonl", [fork_tree(1).to_dict(), huge, fork_tree(3).to_dict()]))
    assert [s.seed for s in run.summaries] == [1, 3] and run.skipped == ["trees.jsonl:2"]


def test_a_files_first_tree_that_cannot_be_drawn_costs_only_itself(tmp_path):
    """Every tree asked its file's first tree for the batch's allocation report by parsing
    it: a first tree that does not parse (a newer writer's node field) made every tree of
    its file a 500, and --static named them all undrawable."""
    bad = fork_tree(1).to_dict()
    bad["nodes"][0]["written_by_a_newer_version"] = 1
    run = Run(_write_lines(tmp_path / "trees.jsonl", [bad, fork_tree(2).to_dict(), fork_tree(3).to_dict()]))
    server = ViewerServer(run, port=0).start()
    try:
        answers = [_get(server.url + f"api/tree/{i}") for i in range(3)]
    finally:
        server.close()
    assert answers[0][0] == 500 and "written_by_a_newer_version" in answers[0][1]["error"]
    assert [(status, body["meta"]["seed"]) for status, body in answers[1:]] == [(200, 2), (200, 3)]
    failed: list[str] = []
    write_static(run, tmp_path / "v.html", None, failed=failed)
    assert len(failed) == 1 and failed[0].startswith("tree 0 ")


def test_a_token_id_the_tokenizer_cannot_decode_is_shown_as_its_id_not_a_server_error():
    """A Rust tokenizer raises OverflowError on a negative id (and on one past 2**64): one
    such id in a tree (another writer's padding, a hand edit) made the tree's page a 500."""
    from agentrl.types import Node, RolloutTree
    from agentrl.viewer.payload import tree_payload
    from agentrl.viewer.tokens import _decoder

    class Tokenizer:
        def decode(self, ids: list[int]) -> str:
            if ids[0] < 0:
                raise OverflowError("number too small to fit in target type")
            return f"t{ids[0]}"

    t = RolloutTree(meta={})
    t.add(Node(context_ids=[1, -1], action_ids=[2], logprobs=[-0.1], entropies=[0.1], action_text="x"))
    assert tree_payload(t, decode=_decoder(Tokenizer()))["vocab"] == {"1": "t1", "2": "t2"}


def test_a_tree_request_the_page_never_sends_is_refused_naming_what_is_wrong(tmp_path):
    """``?generation=abc`` was read as no generation at all (the tree of whatever index the
    server held now was sent), and ``/api/tree/<anything>/1`` was tree 1."""
    from agentrl.types import write_trees

    write_trees(tmp_path / "trees.jsonl", [fork_tree(1), fork_tree(2)])
    server = ViewerServer(Run(tmp_path / "trees.jsonl"), port=0).start()
    try:
        bad_generation = _get(server.url + "api/tree/1?generation=abc")
        nested = _get(server.url + "api/tree/x/1")
        good = _get(server.url + "api/tree/1?generation=0")
        plain = _get(server.url + "api/tree/1")
    finally:
        server.close()
    assert bad_generation[0] == 400 and "generation 'abc'" in bad_generation[1]["error"]
    assert nested[0] == 404 and "/api/tree/x/1" in nested[1]["error"]
    assert good[0] == plain[0] == 200 and good[1]["meta"]["seed"] == plain[1]["meta"]["seed"] == 2


def test_a_tokenizer_folder_that_does_not_load_leaves_ids_and_says_why(tmp_path, monkeypatch):
    """transformers raises KeyError('added_tokens') on a corrupt tokenizer.json (and other
    errors of its own): load_decoder let it through, so ``agentrl view --static`` ended in
    a traceback instead of a page of token ids that says why."""
    from agentrl import models
    from agentrl.viewer.tokens import load_decoder

    def corrupt(name: str):
        raise KeyError("added_tokens")

    monkeypatch.setattr(models, "load_tokenizer", corrupt)
    decode, note = load_decoder({"policy": {"model": "runs/x/checkpoints/step-1"}})
    assert decode is None and "KeyError" in note and "'added_tokens'" in note and "--tokenizer" in note


def test_a_page_waiting_for_token_texts_says_so_when_the_run_changed_under_it(browser_context, tmp_path,
                                                                             monkeypatch):
    """A page asking again for a pending tree of an index the server has since rebuilt (the
    run changed on disk) got a 409 and stopped asking without a word: it said 'loading the
    tokenizer' for ever. It now shows the server's answer: reload the page."""
    from agentrl.types import write_trees

    server, loaded = _slow_tokenizer_server(tmp_path, monkeypatch)
    page = browser_context.new_page()
    try:
        page.goto(server.url + "#tree=0&node=0")
        page.wait_for_selector("#tree-canvas g.node.selected[data-node='0']")
        write_trees(tmp_path / "trees.jsonl", [fork_tree(7), fork_tree(8)])
        assert _get(server.url + "api/run")[1]["generation"] == 1  # another tab's reload, say
        loaded.set()
        page.wait_for_function("document.querySelector('#tree-title').innerText.includes('reload the page')",
                               timeout=10000)
    finally:
        loaded.set()
        page.close()
        server.close()


def test_the_page_keeps_a_bounded_number_of_bytes_of_trees_not_just_of_trees(browser_context, tmp_path):
    """The page kept the last 24 trees it opened whatever their size (the server keeps at most
    256 MB of them): a run of 100 MB trees (20,000-turn episodes, web pages in observations)
    took a tab past 2 GB after 24 clicks. It now keeps at most ``S.cacheBytes`` of their JSON."""
    from agentrl.types import write_trees

    trees = [fork_tree(k) for k in range(4)]
    for t in trees:
        t.nodes[0].observation = "x" * 1_000_000
    write_trees(tmp_path / "trees.jsonl", trees)
    server = ViewerServer(Run(tmp_path / "trees.jsonl"), port=0).start()
    page = browser_context.new_page()
    try:
        page.goto(server.url)
        page.wait_for_selector("body[data-ready='1']")
        page.evaluate("S.cacheBytes = 2_500_000")  # two of these trees
        for k in range(4):
            page.evaluate(f"location.hash = '#tree={k}&node=0'")
            page.wait_for_function(f"S.treeIndex === {k}")
        assert page.evaluate("[...S.cache.keys()]") == [2, 3]
        page.evaluate("S.cacheBytes = 10")  # one tree bigger than the limit is still kept: it is on screen
        page.evaluate("location.hash = '#tree=0&node=0'")
        page.wait_for_function("S.treeIndex === 0")
        assert page.evaluate("[...S.cache.keys()]") == [0]
    finally:
        page.close()
        server.close()


def test_a_config_key_of_the_wrong_type_inside_a_section_is_named_not_fatal(tmp_path):
    """Sections of the wrong type were named and dropped, but not the keys inside them the
    viewer reads: a hand-written ``train.distill: x``, ``train.credit_options: [1]`` or
    ``env.id: {a: 1}`` raised out of the run index (a blank page), of every tree's payload,
    and of ``agentrl report``."""
    from agentrl.types import write_trees
    from agentrl.viewer import run_index, tree_data
    from agentrl.viewer.report import write_report

    write_trees(tmp_path / "trajectories.jsonl", [fork_tree()])
    (tmp_path / "config.yaml").write_text(
        "env:\n  id: {a: 1}\ntrain:\n  credit: gigpo\n  credit_options: [1]\n  distill: x\npolicy:\n  model: m\n")
    run = Run(tmp_path)
    assert run.config == {"env": {}, "train": {"credit": "gigpo"}, "policy": {"model": "m"}}
    index = run_index(run)
    assert index["totals"]["trees"] == 1 and index["about"]["credit"] == "gigpo"
    about = index["about"]["config"]
    for key, kind in (("env.id", "dict"), ("train.credit_options", "list"), ("train.distill", "str")):
        assert f"{key} not read (a {kind}" in about, about
    assert tree_data(run, 0, None)["credit"]["method"] == "gigpo"
    write_report([tmp_path], tmp_path / "report")
    assert (tmp_path / "report" / "report.md").is_file()


def test_a_metric_too_big_for_a_float_is_left_out_of_its_curve_not_a_blank_page():
    """``math.isfinite`` of an integer of 400 digits raises OverflowError: one such value in
    ``metrics.jsonl`` raised out of the run index (a blank page) and the report's plots."""
    from agentrl.viewer.curves import curve_panels, series

    rows = [{"step": 1, "rollout/reward": 0.5}, {"step": 2, "rollout/reward": 10**400},
            {"step": 10**400, "rollout/reward": 0.25}, {"step": 3, "rollout/reward": 0.75}]
    assert series(rows, "rollout/reward") == [(1.0, 0.5), (3.0, 0.75)]
    reward = next(p for p in curve_panels(rows) if p["title"] == "reward")
    assert reward["series"][0]["points"] == [[1.0, 0.5], [3.0, 0.75]]


def test_a_run_index_the_server_cannot_build_shows_its_reason_on_the_page(browser_context, tmp_path,
                                                                           monkeypatch):
    """The page said only 'could not load the run: Error: api/run: 500'; the server's answer
    says why, and the page now shows it."""
    from agentrl.types import write_trees

    write_trees(tmp_path / "trees.jsonl", [fork_tree()])
    server = ViewerServer(Run(tmp_path / "trees.jsonl"), port=0).start()

    def broken() -> bytes:
        raise PermissionError(13, "Permission denied", "metrics.jsonl")

    monkeypatch.setattr(server, "index_json", broken)
    page = browser_context.new_page()
    try:
        page.goto(server.url)
        page.wait_for_selector("pre")
        shown = page.inner_text("pre")
    finally:
        page.close()
        server.close()
    assert "500" in shown and "Permission denied" in shown and "metrics.jsonl" in shown, shown


def test_a_tree_nested_near_the_parsers_limit_opens_from_the_server_as_it_indexed(tmp_path):
    """json's parser counts its caller's stack against the recursion limit: a line nested 985
    levels indexed when the run was opened (near the top of the stack) but raised
    RecursionError when a server thread, 20 frames deeper, parsed it again: listed, never
    shown. It is parsed from a fresh stack when the caller's is too deep."""
    t = fork_tree().to_dict()
    t["nodes"][1]["info"]["tool_calls"][0]["arguments"] = "DEEP"
    deep = '{"a":' * 980 + '"bottom"' + "}" * 980  # json.dumps from pytest's stack stops short of it
    (tmp_path / "trees.jsonl").write_text(json.dumps(t).replace('"DEEP"', deep) + "\n")
    run = Run(tmp_path / "trees.jsonl")
    assert len(run) == 1
    server = ViewerServer(run, port=0).start()
    try:
        status, body = _get(server.url + "api/tree/0")
    finally:
        server.close()
    assert status == 200, body
    (call,) = next(n for n in body["nodes"] if n["id"] == 1)["tool_calls"]
    assert json.dumps(call["arguments"]).count("bottom") == 1


def test_the_reports_turn_histogram_has_a_bounded_number_of_bins():
    """The report's histogram of turns per episode had a bin per turn count: a run with one
    20,000-turn episode drew 20,001 bins, a minute of matplotlib per run. Counts up to 100
    keep a bin each (whole turns); longer ones share 100 bins."""
    from agentrl.viewer.report import _turn_bins

    assert list(_turn_bins([1, 3, 2])) == [0, 1, 2, 3, 4]
    assert list(_turn_bins([1, 99])) == list(range(101))
    wide = list(_turn_bins([3, 20_000]))
    assert len(wide) == 101 and wide[0] == 0 and wide[-1] >= 20_001
    assert all(b - a == wide[1] - wide[0] for a, b in zip(wide, wide[1:], strict=False))  # equal widths
