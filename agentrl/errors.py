"""The one exception tree of agentrl.

    AgentRLError
    ├── ConfigError          a config key is missing, unknown or has a bad value
    ├── EnvError             an environment failed (unknown id, crashed step, ...)
    ├── PolicyError          a model or generation backend failed
    │   └── ContextOverflowError   a prompt no longer fits the context budget
    ├── SandboxError         a sandbox could not run a command
    │   ├── SandboxUnavailableError  the asked-for backend/isolation is missing here
    │   └── SandboxDeadError         the sandbox was killed or closed
    ├── ToolError            a tool call failed outside the model's control
    ├── ProxyError           the OpenAI-compatible proxy failed
    └── RolloutError         an episode failed; recorded on its tree node

Third-party errors (docker, httpx, vLLM, Ray) are mapped to these at the module
that calls the library, with ``raise ... from``.

``RolloutError`` is raised inside the rollout engine and caught there: the
engine records its message once, in ``Node.error`` of the episode's last node,
and the batch goes on. It reaches a caller only through that record.
"""

from __future__ import annotations

__all__ = [
    "AgentRLError",
    "ConfigError",
    "ContextOverflowError",
    "EnvError",
    "PolicyError",
    "ProxyError",
    "RolloutError",
    "SandboxDeadError",
    "SandboxError",
    "SandboxUnavailableError",
    "ToolError",
]


class AgentRLError(Exception):
    """Base class of every error agentrl raises on purpose."""


class ConfigError(AgentRLError, ValueError):
    """A config key is missing, unknown or has a bad value. The message names the key path."""


class EnvError(AgentRLError):
    """An environment failed: unknown id, or a crash inside reset/step."""


class PolicyError(AgentRLError):
    """A model or generation backend failed, or an unknown model was asked for."""


class ContextOverflowError(PolicyError):
    """The context (prompt plus what must still be generated) exceeds the budget."""


class SandboxError(AgentRLError):
    """A sandbox could not run a command."""


class SandboxUnavailableError(SandboxError):
    """The backend or isolation level asked for is not available on this machine."""


class SandboxDeadError(SandboxError):
    """The sandbox was closed or killed from outside; it cannot run anything more."""


class ToolError(AgentRLError):
    """A tool failed for a reason outside the model's control."""


class ProxyError(AgentRLError):
    """The OpenAI-compatible proxy failed."""


class RolloutError(AgentRLError):
    """An episode failed. The reason is recorded once, on the node where it happened.

    ``env_broken``: the env raised or may still be running a step, so the engine
    closes it instead of handing it to the next episode.
    """

    def __init__(self, reason: str, env_broken: bool = False):
        super().__init__(reason)
        self.env_broken = env_broken
