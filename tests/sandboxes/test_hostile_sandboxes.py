"""A hostile review of the sandboxes: what model-written code and a malicious tool caller
tried that the security and hardening suites did not, each kept as the attack that broke it.
"""

from __future__ import annotations

import pytest

from agentrl.errors import SandboxError
from agentrl.sandboxes import PythonInterpreter

from .conftest import TEST_LIMITS

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


async def test_snapshot_of_sparse_files_is_refused_not_inflated(builder, backend):
    # 256 MiB of holes take no room in an 8 MiB workdir, and the snapshot stored them at
    # full size: on the host's heap, a few thousand such files ran a trainer out of memory.
    limits = TEST_LIMITS.model_copy(update={"workdir_mb": 8})
    async with builder(backend, limits) as b:
        r = await b.sandbox.run("for i in 1 2 3 4; do truncate -s 64M hole$i || exit 1; done")
        assert r.ok, r
        with pytest.raises(SandboxError, match="snapshot"):
            await b.sandbox.snapshot()
        await b.sandbox.run("rm hole*")
        await b.sandbox.write_file("small.txt", "kept")
        snap = await b.sandbox.snapshot()
        await b.sandbox.restore(snap)
        assert await b.sandbox.read_file("small.txt") == b"kept"


@pytest.mark.parametrize("command", [["echo", "a\0b"], "echo a\0b"], ids=["argv", "shell"])
async def test_a_command_holding_a_nul_byte_is_a_failed_run_on_every_backend(built, command):
    # A model's "\u0000" in a bash call raised ValueError out of local and bwrap (the tool
    # failed its episode) where docker answers with a failed run the model can read.
    r = await built.sandbox.run(command, timeout=30)
    assert not r.ok and not r.timed_out, r
    assert (await built.sandbox.run("echo alive", timeout=30)).stdout == "alive\n"


async def test_an_empty_argv_is_refused_on_every_backend(built):
    # local and bwrap ran `env -i` with nothing after it, which printed the sandbox's env.
    with pytest.raises(SandboxError):
        await built.sandbox.run([], timeout=30)


@pytest.mark.parametrize("op", ["write", "read"])
async def test_a_path_holding_a_nul_byte_is_a_sandbox_error(built, op):
    call = (
        built.sandbox.write_file("a\0b", b"x") if op == "write" else built.sandbox.read_file("a\0b")
    )
    with pytest.raises(SandboxError):
        await call
