"""Packages meet through public names: the env-loop hook the rollout engine awaits, the loop
helper the openai policy uses, and the one tar filter both snapshot restores apply."""

from __future__ import annotations

import asyncio
import inspect
import threading
from pathlib import Path

from agentrl.loopthread import LoopThread, shared_loop
from agentrl.tools import Task, ToolEnv

ROOT = Path(__file__).resolve().parents[2]
TOPS = {"agentrl": "agentrl", "tools": "agentrl.tools", "sandboxes": "agentrl.sandboxes", "envs": "agentrl.envs"}


def test_run_coroutine_awaits_an_env_call_on_the_envs_own_loop_from_another_loop():
    env = ToolEnv(Task(prompt="Say 4.", verify=lambda answer: answer == "4"), tools=["calculator"])

    async def where() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    async def episode():
        mine = asyncio.get_running_loop()
        theirs = await env.run_coroutine(where())
        await env.run_coroutine(env.areset(seed=0))
        step = await env.run_coroutine(env.astep("4"))
        return mine, theirs, step

    mine, theirs, (_, reward, terminated, _, _) = asyncio.run(episode())
    assert theirs is not mine and theirs is shared_loop().run(where())  # the loop the sync API uses
    assert (reward, terminated) == (1.0, True)
    env.close()


def test_loop_thread_arun_is_cancelled_with_its_caller():
    lt = LoopThread("test-arun")
    started, cancelled = threading.Event(), threading.Event()

    async def slow() -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def caller() -> None:
        task = asyncio.ensure_future(lt.arun(slow()))
        await asyncio.to_thread(started.wait, 10)
        task.cancel()

    asyncio.run(caller())
    assert cancelled.wait(10)
    assert lt.run(asyncio.sleep(0, result=7)) == 7
    lt.close()


def test_the_in_sandbox_put_back_runs_the_hosts_own_tar_filter():
    from agentrl.sandboxes.tar_filter import restore_filter
    from agentrl.tools.tool_env import _put_back_script

    script = _put_back_script()
    assert inspect.getsource(restore_filter) in script
    assert "tar_filter(" not in script.replace(inspect.getsource(restore_filter), "")


def _private_module_imports(path: Path) -> list[str]:
    """Imports of another package's private module (``agentrl.tools._loop`` from ``agentrl.policy``);
    a package's subpackages are part of it."""
    import ast

    rel = path.relative_to(ROOT).with_suffix("").parts
    package = [*TOPS[rel[0]].split("."), *rel[1:-1]]
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
        target = [p for p in ".".join(x for x in (base, node.module or "") if x).split(".") if p]
        for i, part in enumerate(target):
            # private to the package that holds it, subpackages included (envs/_action.py
            # serves envs/alfworld/ too), never to a sibling or a parent
            if part.startswith("_") and not part.startswith("__") and package[:i] != target[:i]:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {'.'.join(target)}")
    return bad


def test_no_module_imports_another_packages_private_module():
    files = [p for top in TOPS for p in (ROOT / top).rglob("*.py")]
    assert [b for p in files for b in _private_module_imports(p)] == []
