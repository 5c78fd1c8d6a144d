"""``agentrl view``: a static page of a fresh ``agentrl rollout`` run, the server from the real
command line, and clear errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import typer
from typer.testing import CliRunner

from agentrl.cli import app as main_app
from agentrl.viewer.cli import register

runner = CliRunner()
app = typer.Typer()
register(app)


def test_static_page_of_a_mock_rollout_holds_every_tree(tmp_path):
    out = tmp_path / "run"
    res = runner.invoke(main_app, ["rollout", "--backend", "mock", "--episodes", "3", "--out", str(out),
                                   "--set", "policy.mock_responses=['4', '8']", "--no-progress"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["view", str(out), "--static", str(tmp_path / "v.html"), "--no-tokens"])
    assert res.exit_code == 0, res.output
    html = (tmp_path / "v.html").read_text()
    assert all(f'id="tree-{i}"' in html for i in range(3))
    index = json.loads(re.search(r'id="run-data">(.*?)</script>', html).group(1))
    assert index["totals"]["trees"] == 3 and index["about"]["env"] == "agentrl/GuessNumber-v0"
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")  # nothing to fetch


def test_view_of_an_empty_folder_names_what_it_looked_for(tmp_path):
    res = runner.invoke(app, ["view", str(tmp_path)])
    assert res.exit_code == 2 and "trajectories.jsonl" in res.output


def test_agentrl_view_serves_the_run_on_localhost(branched_run):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", "from agentrl.cli import main; main()", "view",
                             str(branched_run), "--port", "0", "--no-tokens"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url, deadline = None, time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "agentrl view exited early"
            m = re.search(r"serving at (http://127\.0\.0\.1:\d+/)", line)
            url = m.group(1) if m else None
        assert url
        index = json.loads(urllib.request.urlopen(url + "api/run", timeout=30).read())
        assert index["totals"]["trees"] == 4
        tree = json.loads(urllib.request.urlopen(url + "api/tree/3", timeout=30).read())
        assert tree["meta"]["seed"] == index["trees"][3]["seed"]
        page = urllib.request.urlopen(url, timeout=30).read().decode()
        assert 'data-mode="server"' in page
    finally:
        proc.terminate()
        proc.wait(timeout=30)
