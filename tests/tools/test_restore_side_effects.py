"""Restoring a ToolEnv does not replay the python tool's file side effects.

After ``restore`` the interpreter's variables come back by re-running its
snippets, and the sandbox's files are exactly the snapshot's, on every backend.
"""

from __future__ import annotations

import json

import httpx
import pytest

from agentrl.env import make_env
from agentrl.errors import SandboxUnavailableError
from agentrl.sandboxes import LocalSandbox, RemoteSandbox, check_backend
from agentrl.tools import ToolEnv
from agentrl.tools.task import Task

APPEND = "open('c.txt','a').write('x'); print('count', len(open('c.txt').read()))"


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def out(obs: str) -> str:
    """A single tool result's text."""
    return obs.removeprefix("<tool_response>\n").removesuffix("\n</tool_response>")


def sandbox_spec(backend: str):
    """What to pass as ``sandbox=``; skips (saying why) where the backend cannot run."""
    if backend == "remote":
        pytest.importorskip("fastapi", reason="the sandbox server needs fastapi")
        from agentrl.sandboxes.server import create_app

        app = create_app(lambda: LocalSandbox(), "tok", max_request_bytes=4 << 20)
        return lambda: RemoteSandbox(
            "http://sandbox.test", "tok", transport=httpx.ASGITransport(app=app)
        )
    try:
        check_backend(backend)
    except SandboxUnavailableError as err:
        pytest.skip(f"{backend} cannot run here: {err}")
    return backend


@pytest.mark.parametrize("backend", ["local", "bwrap", "remote", "docker"])
def test_restore_does_not_append_again(backend):
    spec = sandbox_spec(backend)
    env = make_env("agentrl/MathPython-v0", sandbox=spec)
    other = make_env("agentrl/MathPython-v0", sandbox=spec)
    try:
        env.reset(seed=0)
        assert out(env.step(call("python", code=APPEND))[0]) == "count 1"
        snap = env.unwrapped.snapshot()
        assert out(env.step(call("python", code=APPEND))[0]) == "count 2"
        for _ in range(2):  # one snapshot, restored again and again
            env.unwrapped.restore(snap)
            assert out(env.step(call("python", code=APPEND))[0]) == "count 2"
        other.reset(seed=0)  # a different env instance, with its own sandbox
        other.unwrapped.restore(snap)
        assert out(other.step(call("python", code=APPEND))[0]) == "count 2"
    finally:
        env.close()
        other.close()


# Each run adds one file and one dir named after how many entries it found, so a
# replay against the snapshot's files makes f2.txt and d2, which must not stay.
GROW = (
    "import os\nn = len(os.listdir('.'))\n"
    "open(f'f{n}.txt', 'w').write(str(n))\nos.makedirs(f'd{n}/sub')\nv = 41"
)
LOOK = (
    "import os\nprint(sorted(os.path.join(r, x) for r, ds, fs in os.walk('.') for x in ds + fs),"
    " open('f0.txt').read(), v + 1)"
)


def test_files_are_exactly_the_snapshots_and_variables_come_back(local_sandbox):
    task = Task(prompt="p", verify=lambda _: 0.0)
    env = ToolEnv(task, tools=["python", "bash"], sandbox=local_sandbox)
    env.reset()
    env.step(call("python", code=GROW))
    env.step(call("bash", command="chmod 444 f0.txt && ln -s f0.txt link && chmod 555 d0"))
    snap = env.snapshot()
    env.step(call("bash", command="chmod 755 d0 && rm -r d0 && echo junk > f0.txt && mkdir d0"))
    env.restore(snap)
    look = out(env.step(call("python", code=LOOK))[0])
    want = "['./d0', './d0/sub', './f0.txt', './link'] 0 42"
    assert look == want
    listing = env.step(call("bash", command="stat -c '%n %a' d0 f0.txt; readlink link"))[0]
    assert out(listing) == "d0 555\nf0.txt 444\nf0.txt"
    env.close()


def test_a_branch_that_never_calls_python_keeps_its_history_for_the_next_snapshot(
    local_sandbox,
):
    task = Task(prompt="p", verify=lambda _: 0.0)
    env = ToolEnv(task, tools=["python", "bash"], sandbox=local_sandbox)
    env.reset()
    env.step(call("python", code=APPEND))
    snap = env.snapshot()
    env.restore(snap)
    # bash changes the files before python is called: the rebuild keeps bash's change
    assert out(env.step(call("bash", command="printf yy >> c.txt; echo ok"))[0]) == "ok"
    again = env.snapshot()  # python has not run since the restore: its history is carried
    assert out(env.step(call("python", code=APPEND))[0]) == "count 4"
    env.restore(again)
    assert out(env.step(call("python", code=APPEND))[0]) == "count 4"
    env.close()


def test_a_file_the_rebuilt_interpreter_holds_open_is_the_file_others_see(local_sandbox):
    task = Task(prompt="p", verify=lambda _: 0.0)
    env = ToolEnv(task, tools=["python"], sandbox=local_sandbox)
    env.reset()
    env.step(call("python", code="log = open('log.txt', 'a', buffering=1); log.write('a\\n')"))
    snap = env.snapshot()
    env.restore(snap)
    # the replay wrote a second 'a'; the put-back rewrote log.txt in place, so the
    # replayed handle (O_APPEND) still writes to the file that is read back
    obs = env.step(call("python", code="log.write('b\\n'); print(repr(open('log.txt').read()))"))
    assert out(obs[0]) == "'a\\nb\\n'"
    env.close()


def test_put_back_reads_the_archives_docker_makes(local_sandbox, tmp_path):
    """Docker snapshots with ``tar -cf - .``: names start with ``./`` and ``.`` is a member."""
    import asyncio
    import shutil
    import subprocess

    from agentrl.tools.tool_env import _put_back_files

    if shutil.which("tar") is None:
        pytest.skip("no tar binary to make a docker-style archive with")
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "a.txt").write_text("snap")
    archive = subprocess.run(
        ["tar", "-C", str(tmp_path), "-cf", "-", "."], check=True, capture_output=True
    ).stdout
    assert b"./keep/a.txt" in archive

    async def go() -> str:
        await local_sandbox.write_file("keep/a.txt", "later, longer")
        await local_sandbox.write_file("extra/b.txt", "not in the snapshot")
        await _put_back_files(local_sandbox, archive, timeout=30)
        found = await local_sandbox.run("find . | sort; cat keep/a.txt")
        return found.stdout

    assert asyncio.run(go()) == ".\n./keep\n./keep/a.txt\nsnap"
