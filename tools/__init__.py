"""Tools the model can call, with pydantic argument schemas, and ``ToolEnv``,
which turns a ``TextEnv`` or a ``Task`` into a tool-calling env.

Built-in tools by name: ``BUILTIN_TOOLS`` / ``get_tool(name)``. Importing this
package starts nothing: sandboxes, interpreters and search indexes are made on
first use.
"""

from .base import FunctionTool, NoArgs, Tool, ToolResult, tool, truncate_middle
from .calculator import CalculatorTool, evaluate
from .files import EditFileTool, ReadFileTool, WriteFileTool
from .parse import ParseResult, parse_tool_calls, render_tool_results, render_tools_prompt
from .python import PythonTool
from .registry import BUILTIN_TOOLS, get_tool
from .sandbox_source import SandboxSource, as_sandbox_source
from .search import Document, SearchIndex, SearchTool
from .shell import BashTool
from .task import Task
from .tool_env import ToolEnv, ToolEnvConfig, strip_thinking

__all__ = [
    "BUILTIN_TOOLS",
    "BashTool",
    "CalculatorTool",
    "Document",
    "EditFileTool",
    "FunctionTool",
    "NoArgs",
    "ParseResult",
    "PythonTool",
    "ReadFileTool",
    "SandboxSource",
    "SearchIndex",
    "SearchTool",
    "Task",
    "Tool",
    "ToolEnv",
    "ToolEnvConfig",
    "ToolResult",
    "WriteFileTool",
    "as_sandbox_source",
    "evaluate",
    "get_tool",
    "parse_tool_calls",
    "render_tool_results",
    "render_tools_prompt",
    "strip_thinking",
    "tool",
    "truncate_middle",
]
