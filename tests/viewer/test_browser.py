"""The viewer in a real browser (headless Debian chromium through playwright).

The recorded branched run is opened as a static file and through the local
server; the test clicks into a node, checks that its action text and advantage
are shown, switches to the token view, hovers a token, and saves screenshots
(build/test-artifacts/viewer/, or $AGENTRL_TEST_ARTIFACTS). Any JavaScript
error on the page fails the test. A run of thousands of trees must open
without freezing: only the table is loaded, and a tree when it is opened.
"""

from __future__ import annotations

import time

import pytest

from agentrl.types import write_trees
from agentrl.viewer import Run, ViewerServer, tree_data, write_static

from .conftest import fork_tree

NODE = 2  # a second-turn node of tree 2 (step 2, task seed 3)
TREE = 2


@pytest.fixture
def page(browser_context):
    pg = browser_context.new_page()
    pg.errors = []
    pg.on("pageerror", lambda e: pg.errors.append(f"page error: {e}"))
    pg.on("console", lambda m: pg.errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    yield pg
    pg.close()


def _open(page, url: str) -> None:
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']", timeout=15_000)


def _sfmt(x: float) -> str:  # the page's signed format
    return ("+" if x > 0 else "") + f"{x:.4f}"


def _node_then_tokens(page, run: Run, artifacts, name: str) -> None:
    expected = next(n for n in tree_data(run, TREE, None)["nodes"] if n["id"] == NODE)
    page.click(f"tr.tree-row[data-tree='{TREE}']")
    page.click("#tree-canvas g.node.branch[data-node='0'] circle")  # a branch point, with its reason
    assert "segment tree" in page.inner_text("#node-detail .branch-reason")
    page.click(f"#tree-canvas g.node[data-node='{NODE}'] circle")
    assert page.inner_text("#node-detail .action-text") == expected["action"]
    assert page.inner_text("#node-detail .advantage").startswith(_sfmt(expected["advantage"]))
    page.screenshot(path=str(artifacts / f"{name}-tree.png"), full_page=True)

    page.click("#show-tokens")
    page.wait_for_selector("#token-view .tok.act")
    tokens = run.tree(TREE).nodes[NODE]
    assert page.locator("#token-view .tok.act").count() == len(tokens.action_ids)
    assert page.locator("#token-view .tok.ctx").count() == len(tokens.context_ids)
    assert "".join(page.locator("#token-view .tok.act").all_inner_texts()).startswith(expected["action"])
    page.check("input[name=tokmode][value=advantage]")
    page.hover("#token-view .tok.act >> nth=0")
    tip = page.inner_text("#tok-tip")
    assert "advantage" in tip and "logprob" in tip and "entropy" in tip and "log-ratio" in tip
    page.check("input[name=tokmode][value=ratio]")
    page.hover("#token-view .tok.act >> nth=0")  # the screenshot shows a token's numbers
    page.screenshot(path=str(artifacts / f"{name}-tokens.png"), full_page=True)


def test_static_page_shows_node_action_advantage_and_tokens(page, branched_run, tmp_path, artifacts):
    run = Run(branched_run)
    from agentrl.viewer.tokens import load_decoder

    decode, note = load_decoder(run.config)
    html = write_static(run, tmp_path / "view.html", decode, note)
    _open(page, html.as_uri())
    assert page.locator("tr.tree-row").count() == 4
    _node_then_tokens(page, run, artifacts, "static")
    page.click("nav button[data-view=curves]")
    assert page.locator(".panel[data-panel=success] circle").count() >= 3  # rollouts and held-out points
    page.click("nav button[data-view=compare]")
    page.wait_for_selector("#compare-body .col[data-tree='2']")  # step 1 against step 2 of seed 3
    assert page.locator("#compare-body .col").count() == 2
    page.screenshot(path=str(artifacts / "static-compare.png"), full_page=True)
    assert page.errors == []


def test_server_loads_only_the_trees_opened(page, branched_run, artifacts):
    from agentrl.viewer.tokens import load_decoder

    run = Run(branched_run)
    server = ViewerServer(run, port=0, load_decoder=lambda: load_decoder(run.config)).start()
    asked = []
    page.on("request", lambda r: asked.append(r.url.split("/api/", 1)[1]) if "/api/" in r.url else None)
    try:
        _open(page, server.url)
        assert asked == ["run"]
        _node_then_tokens(page, run, artifacts, "server")
        assert asked == ["run", f"tree/{TREE}?generation=0"]  # of the index the page holds
        page.goto(server.url + "#tree=1&node=0")  # a link to a node opens it
        page.wait_for_selector("#tree-canvas g.node.selected[data-node='0']")
    finally:
        server.close()
    assert page.errors == []


def test_thousands_of_trees_open_without_freezing(page, tmp_path, artifacts):
    f = tmp_path / "trees.jsonl"
    write_trees(f, [fork_tree(i) for i in range(3000)])
    run = Run(f)
    server = ViewerServer(run, port=0).start()
    try:
        t0 = time.perf_counter()
        _open(page, server.url)
        ready = time.perf_counter() - t0
        assert page.locator("tr.tree-row").count() == 50  # one page of the table
        assert "of 3000" in page.inner_text("#pager-info")
        page.fill("#f-text", "2999")
        page.wait_for_selector("tr.tree-row[data-tree='2999']")
        t0 = time.perf_counter()
        page.click("tr.tree-row[data-tree='2999']")
        page.wait_for_selector("#tree-canvas g.node[data-node='3'].failed")
        opened = time.perf_counter() - t0
        page.screenshot(path=str(artifacts / "many-trees.png"))
    finally:
        server.close()
    assert ready < 10 and opened < 5, f"page ready in {ready:.1f} s, a tree opened in {opened:.1f} s"
    assert page.errors == []

    html = write_static(run, tmp_path / "many.html", None)  # every tree inside, parsed when opened
    t0 = time.perf_counter()
    _open(page, html.as_uri())
    page.goto(html.as_uri() + "#tree=2998&node=3")
    page.wait_for_selector("#tree-canvas g.node.selected[data-node='3']")
    took = time.perf_counter() - t0
    assert took < 10, f"a static page of 3000 trees took {took:.1f} s to open a tree"
    assert "sandbox died" in page.inner_text("#node-detail .failure")
    assert page.errors == []


def test_page_says_which_episodes_the_update_left_out(page, tmp_path):
    t = fork_tree()
    t.meta["token_values"] = {"1": {"advantages": [0.5, 0.5, 2.0]},  # trained, no teacher scored it
                              "2": {"trained": False, "reason": "MC-GRPO's pivot: no gradient"},
                              "3": {"trained": False, "reason": "failed episode, left out"}}
    write_trees(tmp_path / "trees.jsonl", [t])
    _open(page, write_static(Run(tmp_path / "trees.jsonl"), tmp_path / "view.html", None).as_uri())
    page.click("tr.tree-row[data-tree='0']")
    assert page.inner_text("#tree-credit").endswith("saved: the values the update used")
    page.click("#tree-canvas g.node[data-node='2'] circle")
    assert "leaf 2 left out of the update: MC-GRPO's pivot" in page.inner_text("#node-detail .advantage")
    page.click("#show-tokens")
    page.wait_for_selector("#token-view .tok.act")
    assert "this episode was left out of the update: MC-GRPO's pivot" in page.inner_text("#token-head")
    label = page.locator("input[name=tokmode][value=ratio] >> xpath=..").inner_text()
    assert label.endswith("(no teacher)") and "not recorded" not in label
    assert page.errors == []
