"""The Tool base class, the @tool decorator, output caps and the public names."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel, Field

import agentrl.tools as tools_pkg
from agentrl.errors import ConfigError
from agentrl.tools import BUILTIN_TOOLS, ToolResult, get_tool, tool, truncate_middle


class AddArgs(BaseModel):
    a: int = Field(description="first addend")
    b: int = Field(2, description="second addend")


@tool
async def add(args: AddArgs) -> str:
    """Add two integers."""
    return str(args.a + args.b)


def test_decorated_function_becomes_a_tool_with_openai_schema():
    spec = add.spec()
    assert spec.name == "add"
    assert spec.description == "Add two integers."
    assert spec.parameters["type"] == "object"
    assert spec.parameters["required"] == ["a"]
    assert spec.parameters["properties"]["a"] == {"description": "first addend", "type": "integer"}
    assert "title" not in spec.parameters
    assert spec.to_openai()["function"]["name"] == "add"
    assert add.needs_sandbox is False


def test_invoke_validates_arguments_and_reports_each_bad_field():
    ok = asyncio.run(add.invoke({"a": 3, "b": 4}, None))
    assert ok == ToolResult(content="7")
    bad = asyncio.run(add.invoke({"a": "three"}, None))
    assert bad.is_error
    assert "Invalid arguments for tool 'add'" in bad.content
    assert "- a:" in bad.content
    missing = asyncio.run(add.invoke({}, None))
    assert missing.is_error and "- a: Field required" in missing.content


def test_property_named_title_survives_schema_cleanup():
    class Args(BaseModel):
        title: str = Field(description="a title")

    @tool(name="t", description="d")
    async def t(args: Args, sandbox) -> str:
        return args.title

    assert "title" in t.spec().parameters["properties"]
    assert t.needs_sandbox is True


def test_decorator_rejects_sync_functions_and_missing_models():
    with pytest.raises(TypeError):
        tool(lambda args: "x")

    async def no_model(args: int) -> str:
        return ""

    with pytest.raises(TypeError):
        tool(no_model)


def test_invoke_caps_output_keeping_head_and_tail():
    class Args(BaseModel):
        n: int

    @tool
    async def flood(args: Args) -> str:
        return "A" * 10 + "x" * args.n + "Z" * 10

    flood.max_output_chars = 200
    res = asyncio.run(flood.invoke({"n": 100_000}, None))
    assert len(res.content) < 300
    assert res.content.startswith("A" * 10) and res.content.endswith("Z" * 10)
    assert "characters truncated" in res.content
    assert res.metadata["truncated_from"] == 100_020


def test_truncate_middle_leaves_short_text_alone():
    assert truncate_middle("short", 100) == "short"
    cut = truncate_middle("0123456789" * 10, 30)
    assert cut.startswith("0123456789") and "70 characters truncated" in cut


def test_registry_builds_every_builtin_and_suggests_names():
    for name in BUILTIN_TOOLS:
        t = get_tool(name)
        assert t.name == name
        spec = t.spec()
        assert spec.parameters["type"] == "object" and spec.description
    with pytest.raises(ConfigError, match="Did you mean 'calculator'"):
        get_tool("calculater")


def test_public_names_are_exported_and_importable():
    for name in tools_pkg.__all__:
        assert hasattr(tools_pkg, name), name
    assert {"Tool", "ToolResult", "ToolEnv", "Task", "parse_tool_calls", "get_tool"} <= set(
        tools_pkg.__all__
    )
