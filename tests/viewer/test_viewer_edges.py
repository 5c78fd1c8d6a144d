"""The viewer at the edges of a run's life and data: a metrics file it cannot read, a run
not started yet, a config edited while it is looked at, a node's info of the wrong type,
a tree asked for again and again while the tokenizer loads.

Each test names the input and the outcome the page must get: a message, never a 500.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import typer
from typer.testing import CliRunner

from agentrl.types import Node, RolloutTree, write_trees
from agentrl.viewer import Run, ViewerServer, run_index
from agentrl.viewer.cli import register

from .conftest import fork_tree


def _get(url: str) -> tuple[int, dict]:
    """``(status, JSON body)`` of a GET, an HTTP error's included."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _run_with_metrics(folder: Path, metrics: str | None) -> Path:
    """A run of one tree whose ``metrics.jsonl`` holds ``metrics`` (None: a folder there)."""
    write_trees(folder / "trajectories.jsonl", [fork_tree()])
    if metrics is None:
        (folder / "metrics.jsonl").mkdir()
    else:
        (folder / "metrics.jsonl").write_text(metrics)
    return folder


def test_a_metrics_line_nested_past_the_parser_keeps_the_other_rows_and_is_named(tmp_path):
    """A metrics line nested 100,000 levels raised RecursionError out of ``read_metrics``:
    ``/api/run`` was a 500 and the page showed nothing of the run."""
    rows = [json.dumps({"step": 1, "rollout/reward": 0.25}), "[" * 100_000 + "]" * 100_000,
            json.dumps({"step": 2, "rollout/reward": 0.5})]
    server = ViewerServer(Run(_run_with_metrics(tmp_path, "\n".join(rows) + "\n")), port=0).start()
    try:
        code, index = _get(server.url + "api/run")
    finally:
        server.close()
    assert code == 200, index
    assert index["totals"]["trees"] == 1
    reward = next(p for p in index["curves"] if p["title"] == "reward")["series"][0]["points"]
    assert reward == [[1, 0.25], [2, 0.5]]  # the rows around the bad line still draw
    assert "metrics.jsonl:2" in index["about"]["metrics"]


def test_a_metrics_path_that_is_a_folder_is_named_not_a_500(tmp_path):
    server = ViewerServer(Run(_run_with_metrics(tmp_path, None)), port=0).start()
    try:
        code, index = _get(server.url + "api/run")
    finally:
        server.close()
    assert code == 200, index
    assert index["totals"]["trees"] == 1 and not any(p["series"] for p in index["curves"])
    assert "metrics.jsonl not read" in index["about"]["metrics"]
    assert "IsADirectoryError" in index["about"]["metrics"]


def test_a_summary_json_nested_past_the_parser_is_left_unread_not_a_500(tmp_path):
    """``summary.json`` (read for the title when there is no config) raised RecursionError too."""
    write_trees(tmp_path / "trajectories.jsonl", [fork_tree()])
    (tmp_path / "summary.json").write_text("[" * 100_000 + "]" * 100_000)
    server = ViewerServer(Run(tmp_path), port=0).start()
    try:
        code, index = _get(server.url + "api/run")
    finally:
        server.close()
    assert code == 200, index
    assert index["totals"]["trees"] == 1 and index["about"]["model"] is None


def test_a_config_edited_while_the_run_is_served_shows_on_the_next_index(tmp_path):
    """The run was indexed again only when a trees file or metrics.jsonl changed: a config
    written or edited after the viewer started (the trainer's, a hand's fix) never showed."""
    write_trees(tmp_path / "trajectories.jsonl", [fork_tree()])
    (tmp_path / "config.json").write_text(json.dumps({"env": {"id": "agentrl/One-v0"}}))
    server = ViewerServer(Run(tmp_path), port=0).start()
    try:
        first = _get(server.url + "api/run")[1]
        assert first["about"]["env"] == "agentrl/One-v0"
        (tmp_path / "config.json").write_text(json.dumps({"env": {"id": "agentrl/Second-v0"}}))
        now = _get(server.url + "api/run")[1]
        assert now["about"]["env"] == "agentrl/Second-v0" and now["generation"] != first["generation"]
        (tmp_path / "config.json").unlink()  # the checkpoint's config stands in for a config file
        (tmp_path / "checkpoints" / "step-000001").mkdir(parents=True)
        state = {"config": {"env": {"id": "agentrl/Third-v0"}}}
        (tmp_path / "checkpoints" / "step-000001" / "state.json").write_text(json.dumps(state))
        assert _get(server.url + "api/run")[1]["about"]["env"] == "agentrl/Third-v0"
    finally:
        server.close()


def _tree_with_infos(root_info: object, mid_info: object, leaf_info: object) -> RolloutTree:
    """root -> mid -> two leaves, each with the ``info`` given (whatever its type)."""
    t = RolloutTree(meta={"env": "agentrl/Fake-v0", "seed": 3, "task": 0})
    root = t.add(Node(context_ids=[1], action_ids=[2], logprobs=[-0.1], action_text="a"))
    mid = t.add(Node(context_ids=[3], action_ids=[4], logprobs=[-0.2], action_text="b"), root.id)
    t.add(Node(context_ids=[5], action_ids=[6], logprobs=[-0.3], action_text="c", reward=1.0, terminated=True),
          mid.id)
    t.add(Node(context_ids=[5], action_ids=[7], logprobs=[-0.4], action_text="d", truncated=True), mid.id)
    for node, info in zip(t.nodes.values(), (root_info, mid_info, leaf_info, leaf_info), strict=True):
        node.info = info  # as a hand-edited or foreign writer's file holds it
    return t


def test_a_node_whose_info_is_not_a_mapping_is_drawn_with_it_shown(tmp_path):
    """An inner node's ``info`` that was a list made its tree's endpoint a 500 (``info.get``);
    on a root or a leaf the whole tree was skipped as an unreadable line. The tree is drawn,
    and the node's info shown as it is, named as not a mapping."""
    write_trees(tmp_path / "trajectories.jsonl", [
        fork_tree(), _tree_with_infos({}, ["x", "y"], {}), _tree_with_infos("text", [1], ["success"])])
    run = Run(tmp_path)
    assert len(run) == 3 and run.skipped == []
    assert run.summaries[2].episodes == 2 and run.summaries[2].successes == 1  # terminated with reward 1
    server = ViewerServer(run, port=0).start()
    try:
        for i in (1, 2):
            code, tree = _get(server.url + f"api/tree/{i}")
            assert code == 200, tree
            mid = next(n for n in tree["nodes"] if n["action"] == "b")
            assert list(mid["info"].values()) == [["x", "y"] if i == 1 else [1]]
            assert "not a mapping" in next(iter(mid["info"]))
            assert [e["success"] for e in tree["episodes"]] == [True, False]
    finally:
        server.close()


def test_a_tree_asked_for_again_while_the_tokenizer_loads_is_built_once_per_file_state(tmp_path, monkeypatch):
    """The page asks for a tree served with ids only (``tokens_pending``) again every second
    until the tokenizer is ready; each ask parsed the tree and built its payload again (a
    tree can be megabytes). The ids-only answer is kept while the tree's file keeps its
    stamp (inode, size, mtime); a file changed under it is read again, and refused (409)."""
    from agentrl.viewer import server as server_module

    monkeypatch.setattr(server_module, "_TOKENIZER_WAIT_S", 0.05)
    built: list[int] = []
    real = server_module.tree_data

    def counting(run, i, decode):
        built.append(i)
        return real(run, i, decode)

    monkeypatch.setattr(server_module, "tree_data", counting)
    write_trees(tmp_path / "trees.jsonl", [fork_tree(seed=1), fork_tree(seed=2)])
    never = threading.Event()

    def no_tokenizer_yet():
        never.wait(30)
        return None, "token ids only"

    server = ViewerServer(Run(tmp_path / "trees.jsonl"), port=0, load_decoder=no_tokenizer_yet).start()
    try:
        answers = [_get(server.url + "api/tree/1") for _ in range(3)]
        assert all(code == 200 and t["tokens_pending"] and t["meta"]["seed"] == 2 for code, t in answers)
        assert built == [1]
        write_trees(tmp_path / "trees.jsonl", [fork_tree(seed=3), fork_tree(seed=4)])  # replaced whole
        code, body = _get(server.url + "api/tree/1")
        assert code == 409 and "reload" in body["error"]
    finally:
        never.set()
        server.close()


def _serving_url(proc: subprocess.Popen) -> str:
    """The URL ``agentrl view`` prints, read from its output (it must not exit first)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, "agentrl view exited early"
        m = re.search(r"serving at (http://127\.0\.0\.1:\d+/)", line)
        if m:
            return m.group(1)
    raise AssertionError("agentrl view printed no URL in 60 s")


def test_agentrl_view_of_a_run_not_started_yet_serves_and_waits_for_its_first_step(tmp_path):
    """Started before the trainer's first step (its folder holds only the run lock),
    ``agentrl view`` said the run holds no trees and exited. It serves, the index says it is
    waiting, and the steps show as they are written."""
    (tmp_path / ".run.lock").touch()  # what agentrl train writes first (train.output_lock)
    proc = subprocess.Popen([sys.executable, "-c", "from agentrl.cli import main; main()", "view", str(tmp_path),
                             "--port", "0", "--no-tokens"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = _serving_url(proc)
        first = _get(url + "api/run")[1]
        assert first["waiting"] is True and first["totals"]["trees"] == 0
        (tmp_path / "trees").mkdir()
        write_trees(tmp_path / "trees" / "step-000001.jsonl", [fork_tree(seed=5)])
        (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/reward": 0.5}) + "\n")
        now = _get(url + "api/run")[1]
        assert now["waiting"] is False and now["totals"]["trees"] == 1 and now["steps"] == [1]
        assert _get(url + f"api/tree/0?generation={now['generation']}")[1]["meta"]["seed"] == 5
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_agentrl_view_of_a_folder_with_nothing_of_a_run_still_says_what_it_looked_for(tmp_path):
    """A folder with no mark of a run (a typo'd path) is refused at once, as before, not
    served empty for ever; the message says how a run being started is recognised."""
    (tmp_path / "notes.txt").write_text("not a run")
    app = typer.Typer()
    register(app)
    res = CliRunner().invoke(app, ["view", str(tmp_path)])
    assert res.exit_code == 2 and "trajectories.jsonl" in res.output and ".run.lock" in res.output


def test_the_page_of_a_run_not_started_says_it_waits_and_fills_in(browser_context, tmp_path):
    """The page of an empty run said it held no trees and never asked again: it says it
    waits for the first step, asks the server again, and draws the run when it comes."""
    server = ViewerServer(Run(tmp_path), port=0).start()
    page = browser_context.new_page()
    try:
        page.goto(server.url)
        page.wait_for_selector("body[data-ready='1']", timeout=15_000)
        assert "waiting for the first step" in page.inner_text("#run-table").lower()
        write_trees(tmp_path / "trajectories.jsonl", [fork_tree(seed=7), fork_tree(seed=8)])
        page.wait_for_selector("#run-table tr.tree-row[data-tree='1']", timeout=15_000)
        assert page.inner_text("#run-cards").split()[0] == "2"
    finally:
        page.close()
        server.close()


def test_the_tokenizer_of_a_run_not_started_is_chosen_once_the_run_names_its_model(tmp_path, monkeypatch):
    """At start a run not started names no model; the tokenizer is chosen from its config
    once one is written, not from the empty config it had when the viewer started."""
    from agentrl.viewer import cli

    monkeypatch.setattr(cli, "_WAIT_POLL_S", 0.01)
    (tmp_path / ".run.lock").touch()
    got: list[dict] = []
    waiter = threading.Thread(target=lambda: got.append(cli._config_once_named(Run(tmp_path))), daemon=True)
    waiter.start()
    time.sleep(0.1)
    assert got == []
    (tmp_path / "config.json").write_text(json.dumps({"policy": {"model": "tiny/model"}}))
    waiter.join(10)
    assert got and got[0]["policy"]["model"] == "tiny/model"


def _two_root_tree(meta: dict, info: dict) -> RolloutTree:
    """fork_tree (allocator pilot_commit) with a second root, ``meta`` over its meta and
    ``info`` over every node's info."""
    t = fork_tree(allocator="pilot_commit")
    t.add(Node(context_ids=[1], action_ids=[9], logprobs=[-0.1], entropies=[0.1], action_text="z"))
    t.meta.update(meta)
    for n in t.nodes.values():
        n.info = {**n.info, **info}
    return t


def test_an_env_info_or_a_tree_meta_field_of_another_type_is_shown_not_a_500(tmp_path):
    """What an env puts in ``info`` and what a writer puts in ``meta`` is free-form: a count
    where the viewer reads a list (``parse_errors: 2``), a list where it reads a mapping
    (``branch_reasons``, ``allocation_report``), a pass rate that is text. Each made its
    tree's endpoint a 500; the tree is drawn, an info value it cannot read as its kind
    shown as it is."""
    trees = [_two_root_tree({}, {"parse_errors": 2, "tool_calls": 1.5, "tool_messages": True}),
             _two_root_tree({"branch_reasons": ["first"], "allocation_report": [1]}, {}),
             _two_root_tree({"allocation_report": {"pilot_commit": {"p": ["high"], "commit": 3}}}, {}),
             _two_root_tree({"allocation_report": {"pilot_commit": {"p": [0.5]}}}, {}),
             _two_root_tree({"allocation_report": {"pilot_commit": 5}}, {})]
    write_trees(tmp_path / "trees.jsonl", trees)
    server = ViewerServer(Run(tmp_path / "trees.jsonl"), port=0).start()
    try:
        answers = [_get(server.url + f"api/tree/{i}") for i in range(len(trees))]
    finally:
        server.close()
    assert [code for code, _ in answers] == [200] * len(trees), answers
    node = answers[0][1]["nodes"][0]
    assert node["parse_errors"] == [] and node["tool_calls"] == [] and node["tool_results"] == []
    assert {k: node["info"][k] for k in ("parse_errors", "tool_calls", "tool_messages")} == {
        "parse_errors": 2, "tool_calls": 1.5, "tool_messages": True}
    assert answers[1][1]["branch_points"]["prompt"] == "2 episodes started from the prompt (pilot_commit)"
    assert answers[3][1]["branch_points"]["prompt"].startswith("2 episodes started from the prompt (pilot_commit")


def test_a_tree_whose_node_fields_are_of_another_type_is_skipped_with_the_field_named(tmp_path):
    """A node field of another type than a tree's (``logprobs: null`` from a writer without
    logprobs, ``action_text`` a number, ``partial`` a number) indexed, and its tree's
    endpoint was a 500 (TypeError, IndexError). Such a line is skipped like a torn one,
    its node and field named; the other trees show."""
    good = json.loads(fork_tree(seed=1).to_json())
    lines = [json.dumps(good)]
    for field, value in (("logprobs", None), ("action_text", 5), ("partial", 5), ("context_ids", ["a"]),
                         ("partial", True)):  # a leaf: no turn on its episode (IndexError)
        bad = json.loads(json.dumps(good))
        bad["nodes"][1][field] = value
        lines.append(json.dumps(bad))
    (tmp_path / "trees.jsonl").write_text("\n".join(lines) + "\n")
    run = Run(tmp_path / "trees.jsonl")
    assert len(run) == 1 and run.skipped_count == 5
    assert "node 1: logprobs" in run.skipped[0] and "node 1: action_text" in run.skipped[1]
    assert "node 1: partial" in run.skipped[2] and "node 1: context_ids" in run.skipped[3]
    assert "node 1: partial (a turn's first tokens) but nothing continues it" in run.skipped[4]


def test_a_config_yaml_whose_aliases_expand_past_reason_is_named_not_walked(tmp_path):
    """YAML aliases share one value: 400 bytes of ``config.yaml`` can hold 10 million
    values once expanded. The title (``str`` of policy.model) and the index's JSON walked
    every one: 6 s and 52 MB a page load here, and one more level runs out of memory. A
    config that expands past 100,000 values is named in the page's about line, not read."""
    write_trees(tmp_path / "trajectories.jsonl", [fork_tree()])
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 7)]
    (tmp_path / "config.yaml").write_text("\n".join([*lines, "policy:", "  model: *a6", ""]))
    t0 = time.monotonic()
    index = run_index(Run(tmp_path))
    assert time.monotonic() - t0 < 2
    assert index["about"]["model"] is None and "100,000 values" in index["about"]["config"]
    assert "config.yaml" in index["about"]["config"]


def test_a_config_yaml_that_holds_itself_is_named_not_walked_for_ever(tmp_path):
    """``model: &a [1, *a]`` is a list that holds itself; the index's JSON walked it for ever."""
    write_trees(tmp_path / "trajectories.jsonl", [fork_tree()])
    (tmp_path / "config.yaml").write_text("policy:\n  model: &a [1, *a]\n")
    index = run_index(Run(tmp_path))
    assert index["about"]["model"] is None and "YAML aliases" in index["about"]["config"]


def test_allocator_options_that_are_not_a_mapping_are_named_not_a_500(tmp_path):
    """A hand-written ``rollout.allocator_options: 5`` (the form of runs recorded before
    ``allocator: {name: ...}``) made /api/run and every tree a 500 (``dict(5)``)."""
    write_trees(tmp_path / "trajectories.jsonl", [fork_tree()])
    cfg = {"rollout": {"allocator": "entropy_branch", "allocator_options": 5}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    server = ViewerServer(Run(tmp_path), port=0).start()
    try:
        (code, index), (tree_code, tree) = _get(server.url + "api/run"), _get(server.url + "api/tree/0")
    finally:
        server.close()
    assert code == 200 and tree_code == 200, (index, tree)
    assert "rollout.allocator_options not read (a int, not a mapping)" in index["about"]["config"]
    assert index["about"]["allocator"] == "entropy_branch"


def test_allocator_options_the_scoring_function_cannot_take_leave_the_branch_unscored_not_a_500(tmp_path):
    """``threshold: "0.5"`` (text, as a hand may write it) reached ``entropy_branch_scores``,
    whose comparison raised TypeError: every tree of the run was a 500. The branch point's
    reason says the scores could not be recomputed and why."""
    write_trees(tmp_path / "trajectories.jsonl", [fork_tree(allocator="entropy_branch")])
    cfg = {"rollout": {"allocator": {"name": "entropy_branch", "threshold": "0.5"}}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    server = ViewerServer(Run(tmp_path), port=0).start()
    try:
        code, tree = _get(server.url + "api/tree/0")
    finally:
        server.close()
    assert code == 200, tree
    assert tree["branch_points"]["0"].startswith("entropy_branch: chosen when the batch was planned; "
                                                 "its scores could not be recomputed (TypeError")


def test_the_newest_checkpoint_is_the_highest_step_not_the_last_name(tmp_path):
    """Checkpoints are named step-{step:06d}: past step 999,999 the name has 7 digits and
    sorts before step-999999, so the config was read from the older checkpoint."""
    write_trees(tmp_path / "trajectories.jsonl", [fork_tree()])
    for step, env in ((999_999, "agentrl/Old-v0"), (1_000_000, "agentrl/New-v0")):
        folder = tmp_path / "checkpoints" / f"step-{step:06d}"
        folder.mkdir(parents=True)
        (folder / "state.json").write_text(json.dumps({"step": step, "config": {"env": {"id": env}}}))
    run = Run(tmp_path)
    assert run.checkpoint_state["step"] == 1_000_000 and run.config["env"]["id"] == "agentrl/New-v0"


def test_a_static_page_is_not_written_over_a_file_of_the_run(tmp_path):
    """``agentrl view run/trees.jsonl --static run/trees.jsonl`` replaced the run's trees
    with the page made of them: the run was lost. It is refused, the file left as it was."""
    write_trees(tmp_path / "trees.jsonl", [fork_tree()])
    before = (tmp_path / "trees.jsonl").read_bytes()
    app = typer.Typer()
    register(app)
    for run, out in ((tmp_path / "trees.jsonl", tmp_path / "trees.jsonl"), (tmp_path, tmp_path / "x" / ".." / "trees.jsonl")):
        res = CliRunner().invoke(app, ["view", str(run), "--static", str(out), "--no-tokens"])
        assert res.exit_code == 2 and "is a file of the run" in res.output, res.output
    assert (tmp_path / "trees.jsonl").read_bytes() == before
