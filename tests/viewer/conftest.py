"""Fixtures of the viewer tests: the recorded branched run, hand-made trees, and a real browser.

``data/branched_run`` is a real training run recorded by ``record_run.py``
(tiny model, segment trees, tree credit plus expert distillation, 2 steps on
the same 2 tasks). The browser is Debian's ``chromium`` driven by the python
``playwright`` package (never ``playwright install``: it downloads browsers,
which this machine's closed network refuses). ``make test`` installs both; a
test that needs them skips, with the reason, only where they are missing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from agentrl.types import Node, RolloutTree

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture
def branched_run() -> Path:
    return DATA / "branched_run"


def fork_tree(seed: int = 1, allocator: str = "entropy_branch") -> RolloutTree:
    """One task, hand-made: a first turn, then three continuations from it: a win, a
    truncation (max_turns) and a failure (the sandbox died)."""
    t = RolloutTree(meta={"env": "agentrl/Fake-v0", "seed": seed, "task": 0, "allocator": allocator,
                          "instruction": "find the gold"})
    first = t.add(Node(context_ids=[1, 2, 3], action_ids=[10, 11], logprobs=[-0.1, -0.2],
                       entropies=[0.1, 0.1], action_text="look", observation="a room with a box",
                       info={"task_type": "pick"}))
    t.add(Node(context_ids=[4], action_ids=[12], logprobs=[-1.0], entropies=[2.0],
               action_text='<tool_call>{"name": "open", "arguments": {"what": "box"}}</tool_call>',
               observation="gold!", reward=1.0, terminated=True,
               info={"tool_calls": [{"id": "c1", "name": "open", "arguments": {"what": "box"}}],
                     "tool_messages": [{"role": "tool", "content": "the box holds gold", "name": "open",
                                        "tool_call_id": "c1"}]}), first.id)
    t.add(Node(context_ids=[4], action_ids=[13], logprobs=[-2.0], entropies=[2.0], action_text="wait",
               observation="nothing happens", truncated=True, info={"truncation_reason": "max_turns=2"}),
          first.id)
    t.add(Node(context_ids=[4], action_ids=[14], logprobs=[-0.5], entropies=[1.9], action_text="dig",
               truncated=True, error="sandbox died: killed by signal 9"), first.id)
    return t


@pytest.fixture(scope="session")
def artifacts() -> Path:
    """Where the browser tests leave their screenshots: $AGENTRL_TEST_ARTIFACTS, else build/test-artifacts."""
    out = Path(os.environ.get("AGENTRL_TEST_ARTIFACTS", ROOT / "build" / "test-artifacts")) / "viewer"
    out.mkdir(parents=True, exist_ok=True)
    return out


def _chromium() -> str | None:
    for cand in (os.environ.get("AGENTRL_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                 shutil.which("chromium-browser")):
        if cand and Path(cand).exists():
            return cand
    return None


@pytest.fixture(scope="module")
def browser_context(tmp_path_factory):
    """A headless chromium context, or a skip that says what is missing and how to get it."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        pytest.skip(f"python package playwright missing ({e}): pip install -e '.[dev]' (make test does)")
    exe = _chromium()
    if exe is None:
        pytest.skip("no chromium: apt-get install chromium (make test does where it can; "
                    "AGENTRL_CHROMIUM=/path/to/chrome points at another)")
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=exe, headless=True,
            args=CHROMIUM_FLAGS, viewport={"width": 1400, "height": 900})
        try:
            yield ctx
        finally:
            ctx.close()
