"""agentrl: reinforcement learning for multi-turn, tool-using LLM agents.

The public API is re-exported here; docs/architecture.md is the map of the code.
"""

import os as _os

# torch's OpenMP threads spin while they wait; on a small shared CPU that made
# generation 3-5x slower here. It must be set before torch loads, so it is set
# on import (a value the user set wins).
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


from .chat import ChatContext, TemplateMismatchWarning
from .config import Config, load_config
from .env import TextEnv, TextSpace, list_envs, make_env, register_env
from .errors import (
    AgentRLError,
    ConfigError,
    ContextOverflowError,
    EnvError,
    PolicyError,
    ProxyError,
    RolloutError,
    SandboxDeadError,
    SandboxError,
    SandboxUnavailableError,
    ToolError,
)
from .types import Episode, Message, Node, RolloutTree, ToolCall, ToolSpec, read_trees, write_trees

__version__ = "0.1.0"

__all__ = [
    "AgentRLError",
    "ChatContext",
    "Config",
    "ConfigError",
    "ContextOverflowError",
    "EnvError",
    "Episode",
    "Message",
    "Node",
    "PolicyError",
    "ProxyError",
    "RolloutError",
    "RolloutTree",
    "SandboxDeadError",
    "SandboxError",
    "SandboxUnavailableError",
    "TemplateMismatchWarning",
    "TextEnv",
    "TextSpace",
    "ToolCall",
    "ToolError",
    "ToolSpec",
    "list_envs",
    "load_config",
    "make_env",
    "read_trees",
    "register_env",
    "write_trees",
]
