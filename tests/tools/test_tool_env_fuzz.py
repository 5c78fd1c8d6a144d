"""Fuzz ToolEnv.step: no model output makes an exception escape or crashes a built-in tool."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.tools import SearchTool, Task, ToolEnv
from tests.tools.sandbox_fakes import MemorySandbox

TOOLS = ["calculator", "bash", "read_file", "write_file", "edit_file", "search", "nosuchtool"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3)
    ),
    max_leaves=12,
)
arg_keys = st.sampled_from(
    ["expression", "command", "path", "content", "search", "replace", "query", "k", "timeout", "x"]
)
calls = st.builds(
    lambda name, args: {"name": name, "arguments": args},
    st.sampled_from(TOOLS),
    st.dictionaries(arg_keys, json_values, max_size=4),
)

short = st.text(max_size=40)
# Calls whose arguments have the right names and types, so the tools themselves run.
typed_calls = st.one_of(
    st.builds(lambda e: {"name": "calculator", "arguments": {"expression": e}}, short),
    st.builds(lambda c: {"name": "bash", "arguments": {"command": c}}, short),
    st.builds(
        lambda p: {"name": "read_file", "arguments": {"path": p}},
        st.sampled_from(["a", "b"]) | short,
    ),
    st.builds(
        lambda p, c: {"name": "write_file", "arguments": {"path": p, "content": c}},
        st.sampled_from(["a", "b"]),
        short,
    ),
    st.builds(
        lambda p, a, b: {"name": "edit_file", "arguments": {"path": p, "search": a, "replace": b}},
        st.sampled_from(["a", "b"]),
        short,
        short,
    ),
    st.builds(lambda q: {"name": "search", "arguments": {"query": q}}, short),
)


def render(call: dict, how: int) -> str:
    body = json.dumps(call)
    return [f"<tool_call>{body}</tool_call>", body, f"<tool_call>{body[: len(body) // 2]}"][how]


actions = st.one_of(
    st.text(max_size=400),
    st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
    st.lists(st.tuples(calls | typed_calls, st.integers(0, 2)), min_size=1, max_size=6).map(
        lambda cs: "\n".join(render(c, h) for c, h in cs)
    ),
    st.just("x" * 100_000),
)


def make_env() -> ToolEnv:
    search = SearchTool(["paris is in france", "berlin is in germany"])
    tools = [t for t in TOOLS if t not in ("search", "nosuchtool")] + [search]
    task = Task("What is 2 + 2?", verify=lambda a: a == "4")
    return ToolEnv(task, tools=tools, sandbox=MemorySandbox(), max_calls_per_turn=3, max_turns=1000)


ENV = make_env()


@settings(deadline=None, max_examples=250, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(actions, min_size=1, max_size=3))
def test_fuzz_step_never_raises_and_always_answers_with_text(seq):
    ENV.reset(seed=0)
    for action in seq:
        obs, reward, terminated, truncated, info = ENV.step(action)
        assert isinstance(obs, str)
        assert reward in (0.0, 1.0) and isinstance(reward, float)
        assert "error" not in info, info.get("error")  # model input never fails an episode
        assert len(obs) <= ENV.config.max_observation_chars + 200
        if terminated or truncated:
            break
