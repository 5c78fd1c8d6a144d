"""Plain ``def`` tools: ``@tool`` takes them, as peers' decorators do, and runs them in a worker
thread so that a blocking body stalls no other episode on the loop every env shares."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading

import pytest
from pydantic import BaseModel

from agentrl.tools import Task, ToolEnv, ToolResult, tool
from tests.tools.sandbox_fakes import MemorySandbox


class AddArgs(BaseModel):
    a: int
    b: int


def call(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


def test_a_plain_function_is_a_tool():
    @tool
    def add(args: AddArgs) -> int:
        """Add two integers."""
        return args.a + args.b

    env = ToolEnv(Task("2 + 3?", verify=lambda a: float(a.strip() == "5")), tools=[add])
    env.reset(seed=0)
    obs, reward, terminated, _, _ = env.step(call("add", '{"a": 2, "b": 3}'))
    assert obs == "<tool_response>\n5\n</tool_response>" and reward == 0 and not terminated
    obs, *_ = env.step(call("add", '{"a": "x", "b": 3}'))
    assert "a:" in obs and "integer" in obs  # its arguments are validated as an async tool's
    assert env.step("5")[1] == 1.0
    assert add.spec().description == "Add two integers."


def test_a_blocking_plain_tool_leaves_the_loop_free():
    """The tool waits for an event that only a coroutine on the same loop sets: run on the loop,
    it would wait out its own timeout; in its thread the coroutine runs and releases it."""
    released = threading.Event()

    @tool
    def wait(args: AddArgs) -> str:
        return "released" if released.wait(timeout=10) else "the loop was blocked"

    async def both() -> ToolResult:
        async def release() -> None:
            await asyncio.sleep(0)
            released.set()
        result, _ = await asyncio.gather(wait.invoke({"a": 1, "b": 2}, None), release())
        return result

    assert asyncio.run(both()).content == "released"


def test_a_plain_tool_past_its_timeout_is_answered_with_the_error_and_the_episode_goes_on():
    gate = threading.Event()

    @tool
    def stuck(args: AddArgs) -> str:
        gate.wait(timeout=30)
        return "late"

    env = ToolEnv(Task("q", verify=lambda a: 1.0), tools=[stuck], call_timeout_s=0.2)
    env.reset(seed=0)
    try:
        obs, _, terminated, truncated, info = env.step(call("stuck", '{"a": 1, "b": 2}'))
    finally:
        gate.set()  # its thread finishes on its own
    assert "took longer than 0.2 s" in obs and not (terminated or truncated) and "error" not in info
    assert env.step("done")[1] == 1.0


def test_a_plain_tool_cannot_take_the_sandbox():
    with pytest.raises(TypeError, match="make it an async def"):
        @tool
        def read(args: AddArgs, sandbox) -> str:
            return ""


@pytest.mark.parametrize("kind", ["generator", "async generator"])
def test_a_generator_is_not_a_tool(kind):
    with pytest.raises(TypeError, match="is a generator"):
        if kind == "generator":
            @tool
            def gen(args: AddArgs):
                yield "x"
        else:
            @tool
            async def agen(args: AddArgs):
                yield "x"


def test_an_async_tool_still_gets_the_sandbox():
    box = MemorySandbox()

    @tool
    async def which(args: AddArgs, sandbox) -> str:
        return type(sandbox).__name__

    assert asyncio.run(which.invoke({"a": 1, "b": 2}, box)).content == "MemorySandbox"


def test_a_plain_tool_stuck_for_good_lets_the_process_exit():
    """Its thread came from the loop's default executor, whose threads Python joins at exit:
    one tool stuck past its timeout (a sync HTTP call without a timeout) hung the run at exit."""
    script = textwrap.dedent("""
        import time
        from pydantic import BaseModel
        from agentrl.tools import Task, ToolEnv, tool

        class Args(BaseModel):
            a: int = 0

        @tool
        def stuck(args: Args) -> str:
            time.sleep(3600)
            return "late"

        env = ToolEnv(Task("q", verify=lambda a: 1.0), tools=[stuck], call_timeout_s=0.2)
        env.reset(seed=0)
        obs, *_ = env.step('<tool_call>{"name": "stuck", "arguments": {}}</tool_call>')
        assert "took longer than 0.2 s" in obs, obs
        env.close()
        print("done")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr


def test_plain_tools_stuck_past_their_timeout_leave_room_for_the_next_calls():
    """Each stuck call held one of the default executor's few threads (min(32, cores + 4)):
    once they were all held, every later plain tool call waited out its timeout."""
    gate = threading.Event()

    @tool
    def stuck(args: AddArgs) -> str:
        gate.wait(timeout=30)
        return "late"

    @tool
    def add(args: AddArgs) -> int:
        return args.a + args.b

    env = ToolEnv(Task("q", verify=lambda a: 1.0), tools=[stuck, add], call_timeout_s=0.1)
    env.reset(seed=0)
    try:
        for _ in range(40):
            *_, terminated, truncated, _ = env.step(call("stuck", '{"a": 1, "b": 2}'))
            if terminated or truncated:  # out of turns: the next episode
                env.reset(seed=0)
        obs, *_ = env.step(call("add", '{"a": 2, "b": 3}'))
    finally:
        gate.set()
    assert obs == "<tool_response>\n5\n</tool_response>"


def test_a_plain_function_that_returns_a_coroutine_is_awaited():
    """A def that hands back a coroutine (a decorator without async support around an async
    def): the model was shown '<coroutine object ...>' and the coroutine never ran."""
    async def add(args: AddArgs) -> int:
        await asyncio.sleep(0)
        return args.a + args.b

    @tool
    def logged(args: AddArgs):
        return add(args)

    assert asyncio.run(logged.invoke({"a": 2, "b": 3}, None)).content == "5"
