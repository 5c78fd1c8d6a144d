"""Where a ``ToolEnv`` gets each episode's sandbox: one fixed sandbox, a factory,
or a pool. All are adapted to the small ``SandboxSource`` protocol.

- a ``Sandbox``: reused by every episode and ``reset()`` between them; the
  caller owns it and closes it;
- a callable returning a ``Sandbox`` (or an awaitable of one): a new sandbox per
  episode, closed when the episode ends;
- an object with ``async acquire() -> Sandbox`` and ``async release(sandbox)``
  (a pool): leased per episode and given back when it ends.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from agentrl.errors import ConfigError
from agentrl.sandboxes.base import Sandbox

__all__ = ["FactorySource", "FixedSource", "SandboxSource", "as_sandbox_source"]


@runtime_checkable
class SandboxSource(Protocol):
    """Leases sandboxes to episodes."""

    async def acquire(self) -> Sandbox: ...

    async def release(self, sandbox: Sandbox) -> None: ...


class FixedSource:
    """One sandbox shared by consecutive episodes; ``reset()`` between them."""

    def __init__(self, sandbox: Sandbox):
        self.sandbox = sandbox

    async def acquire(self) -> Sandbox:
        return self.sandbox

    async def release(self, sandbox: Sandbox) -> None:
        await sandbox.reset()


class FactorySource:
    """A fresh sandbox per episode from ``factory()``; closed when the episode ends."""

    def __init__(self, factory: Callable[[], Sandbox | Awaitable[Sandbox]]):
        self.factory = factory

    async def acquire(self) -> Sandbox:
        out = self.factory()
        if inspect.isawaitable(out):
            out = await out
        if not isinstance(out, Sandbox):
            raise ConfigError(f"the sandbox factory returned {type(out).__name__}, not a Sandbox")
        return out

    async def release(self, sandbox: Sandbox) -> None:
        await sandbox.close()


def as_sandbox_source(obj: Any) -> SandboxSource | None:
    """Adapt a sandbox, a factory or a pool to ``SandboxSource`` (None stays None)."""
    if obj is None or isinstance(obj, SandboxSource):
        return obj
    if isinstance(obj, Sandbox):
        return FixedSource(obj)
    if callable(obj):
        return FactorySource(obj)
    raise ConfigError(
        "sandbox must be a Sandbox, a factory returning one, or an object with async "
        f"acquire()/release(sandbox); got {type(obj).__name__}"
    )
