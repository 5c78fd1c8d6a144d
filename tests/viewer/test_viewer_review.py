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
