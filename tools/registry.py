"""The built-in tools by name: ``BUILTIN_TOOLS`` and ``get_tool``."""

from __future__ import annotations

import difflib
from typing import Any

from agentrl.errors import ConfigError

from .base import Tool
from .calculator import CalculatorTool
from .files import EditFileTool, ReadFileTool, WriteFileTool
from .python import PythonTool
from .search import SearchTool
from .shell import BashTool

__all__ = ["BUILTIN_TOOLS", "get_tool"]

BUILTIN_TOOLS: dict[str, type[Tool]] = {
    "bash": BashTool,
    "calculator": CalculatorTool,
    "edit_file": EditFileTool,
    "python": PythonTool,
    "read_file": ReadFileTool,
    "search": SearchTool,
    "write_file": WriteFileTool,
}


def get_tool(name: str, **kwargs: Any) -> Tool:
    """A new instance of the built-in tool ``name``; ``kwargs`` go to its constructor."""
    cls = BUILTIN_TOOLS.get(name)
    if cls is None:
        close = difflib.get_close_matches(name, BUILTIN_TOOLS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"unknown tool {name!r}.{hint} Built-in tools: {', '.join(BUILTIN_TOOLS)}"
        )
    return cls(**kwargs)
