"""Harness episodes at their edges: what one episode shares with another, what outlives the
trainer, and the proxy's count endpoints under bodies too long to fit."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import httpx
import pytest

from agentrl.proxy.harness import anchored_argv, open_session, run_harness_episode


@pytest.mark.parametrize("path, body", [
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": "a" * 2_000_000}]}),
    ("/v1/responses/input_tokens", {"model": "m", "input": "a" * 2_000_000}),
])
def test_a_count_of_a_prompt_too_long_to_fit_is_refused_before_it_is_rendered(mock_policy, serve, monkeypatch,
                                                                              path, body):
    """The count endpoints rendered and tokenized any body up to the 8 MB limit (a thread held for
    seconds per call) without the check the sampling endpoints make first: 2,000,000 characters
    are at least 2,000,000 / (most bytes a token holds) tokens, far over a budget of 4096."""
    import agentrl.proxy.handlers as handlers

    def never(*a, **kw):
        raise AssertionError("rendered a prompt that cannot fit")

    monkeypatch.setattr(handlers, "_render_whole", never)
    server = serve(mock_policy(), max_context_tokens=4096)
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "the prompt is at least" in error["message"] and "over the context budget of 4096" in error["message"]


def test_a_count_that_fits_is_still_counted(mock_policy, serve):
    server = serve(mock_policy(), max_context_tokens=4096)
    r = httpx.post(f"{server.url}/v1/messages/count_tokens",
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 200 and r.json()["input_tokens"] > 0


# -- each episode in its own working directory ---------------------------------------------

# Leaves a file named after its session, waits for the other episode to leave its own, then
# prints where it ran and what it saw there.
LOOKS_AROUND = '''
import json, os, time
open(os.environ["AGENTRL_SESSION_ID"], "w").write("mine")
time.sleep(1.0)
print(json.dumps({"cwd": os.getcwd(), "seen": sorted(os.listdir("."))}))
'''


def _sessions_run(proxy, *episodes):
    """Run ``(cmd, kwargs)`` episodes concurrently, each in a session of its own; their trees."""
    async def run():
        sessions = [await open_session(proxy.url) for _ in episodes]
        return await asyncio.gather(*(run_harness_episode(cmd, s, timeout=30, **kw)
                                      for s, (cmd, kw) in zip(sessions, episodes, strict=True)))
    return asyncio.run(run())


def _printed(tree) -> dict:
    return json.loads(tree.meta["harness"]["stdout_tail"])


def test_concurrent_episodes_each_run_in_a_fresh_directory_removed_afterwards(mock_policy, serve, tmp_path,
                                                                            monkeypatch):
    """Every episode ran in the trainer's own directory: one harness read and overwrote what
    another wrote there (and the trainer's files). Now each runs in a new empty directory,
    removed once it ends."""
    monkeypatch.chdir(tmp_path)
    proxy = serve(mock_policy())
    cmd = [sys.executable, "-c", LOOKS_AROUND]
    trees = _sessions_run(proxy, (cmd, {}), (cmd, {}))
    seen = [_printed(t) for t in trees]
    sids = [t.meta["session_id"] for t in trees]
    assert [s["seen"] for s in seen] == [[sids[0]], [sids[1]]]  # its own file, and nothing else
    assert seen[0]["cwd"] != seen[1]["cwd"]
    assert str(tmp_path) not in (seen[0]["cwd"], seen[1]["cwd"])
    assert not any(os.path.exists(s["cwd"]) for s in seen)  # removed
    assert os.listdir(tmp_path) == []  # nothing left where the trainer runs


def test_a_configured_directory_is_used_as_it_is_and_kept(mock_policy, serve, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "given.txt").write_text("the user's")
    proxy = serve(mock_policy())
    (tree,) = _sessions_run(proxy, ([sys.executable, "-c", LOOKS_AROUND], {"cwd": str(work)}))
    sid = tree.meta["session_id"]
    assert _printed(tree) == {"cwd": str(work), "seen": sorted(["given.txt", sid])}
    assert sorted(os.listdir(work)) == sorted(["given.txt", sid])


def test_a_relative_script_still_runs_from_a_fresh_directory(mock_policy, serve, tmp_path, monkeypatch):
    """``python examples/harness/react_agent.py`` names its script from where the trainer runs:
    the script's path is made absolute, so it is found from the episode's own directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "agents").mkdir()
    (tmp_path / "agents" / "agent.py").write_text("import os; print(os.getcwd())\n")
    proxy = serve(mock_policy())
    (tree,) = _sessions_run(proxy, ("python agents/agent.py", {}))
    run = tree.meta["harness"]
    assert run["returncode"] == 0, run
    assert run["cmd"] == [sys.executable, str(tmp_path / "agents" / "agent.py")]
    assert run["stdout_tail"].strip() != str(tmp_path)


def test_anchored_argv_makes_only_paths_to_files_absolute(tmp_path):
    (tmp_path / "agent.py").write_text("")
    (tmp_path / "data").mkdir()
    argv = ["bin/run", "agent.py", "-c", "agent.py is good", ".", "data", "--x=agent.py", "/abs/y", "missing.py"]
    assert anchored_argv(argv, str(tmp_path)) == [
        str(tmp_path / "bin" / "run"), str(tmp_path / "agent.py"), "-c", "agent.py is good", ".", "data",
        "--x=agent.py", "/abs/y", "missing.py"]
    assert anchored_argv(["claude", "-p", "hi"], str(tmp_path)) == ["claude", "-p", "hi"]  # found on PATH
