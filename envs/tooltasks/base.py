"""``ToolTaskEnv``: a ``ToolEnv`` that may own the sandbox it made from a backend name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentrl.loopthread import shared_loop
from agentrl.tools import Tool, ToolEnv

from ._common import owned_sandbox

__all__ = ["ToolTaskEnv"]


class ToolTaskEnv(ToolEnv):
    """A ``ToolEnv`` whose ``sandbox`` may be a backend name; that sandbox is closed
    with the env."""

    def __init__(self, source: Any, tools: Sequence[Tool | str], sandbox: Any, **config: Any):
        given, self._owned = owned_sandbox(sandbox)
        try:
            super().__init__(source, tools=tools, sandbox=given, **config)
        except BaseException:  # a bad setting: the sandbox made for this env is closed, not leaked
            if self._owned is not None:
                shared_loop().run(self._owned.close())
            raise

    def close(self) -> None:
        try:
            super().close()
        finally:
            owned, self._owned = self._owned, None
            if owned is not None:
                self._loop.run(owned.close())
