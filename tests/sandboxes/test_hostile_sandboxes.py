"""A hostile review of the sandboxes: what model-written code and a malicious tool caller
tried that the security and hardening suites did not, each kept as the attack that broke it.
"""

from __future__ import annotations

import asyncio

import pytest

from agentrl.sandboxes import PythonInterpreter

pytestmark = pytest.mark.anyio


@pytest.fixture
async def interp(built):
    it = PythonInterpreter(built.sandbox)
    await it.start()
    yield it
    await it.close()


@pytest.mark.parametrize(
    "spawn",
    [
        "import os, time\nif os.fork() == 0:\n    time.sleep(60)\n    os._exit(0)\n",
        "import multiprocessing as mp, time\n"
        "worker = mp.get_context('fork').Process(target=time.sleep, args=(60,), daemon=True)\n"
        "worker.start()\n",
    ],
    ids=["os.fork", "multiprocessing"],
)
async def test_snippet_that_leaves_a_background_child_finishes_and_keeps_its_state(interp, spawn):
    # The child inherits the snippet's status pipe; the kernel waited for its EOF, so a
    # finished snippet was reported as timed out and its state rolled back.
    r = await interp.execute(spawn + "kept = 42\nprint('done')", timeout=5)
    assert (r.stdout, r.timed_out, r.exit_code) == ("done\n", False, 0), r
    assert interp.history[0][0].startswith(spawn)
    assert (await interp.execute("kept", timeout=5)).stdout == "42\n"
