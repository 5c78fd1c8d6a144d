"""``Task``: a prompt plus a verifier, the smallest thing ``ToolEnv`` turns into an env.

A task may put ``files`` into the episode's sandbox before the first turn. Tasks
that must look inside the sandbox to score (run the tests, say) override
``score``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl.sandboxes.base import Sandbox

from .base import _in_thread

__all__ = ["Task"]


@dataclass
class Task:
    """One task: the prompt the model sees and how its final answer is scored.

    ``verify(answer) -> float`` (a bool counts as 0/1) scores the final answer
    text; a reward that is not a finite number fails the episode. ``files`` (path -> content) are written into the sandbox at reset.
    ``info`` is merged into the env's ``info`` (e.g. the reference answer), and
    ``report(answer)``, when given, adds metrics to the last step's ``info``.
    """

    prompt: str
    verify: Callable[[str], float | bool] | None = None
    files: dict[str, str | bytes] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    report: Callable[[str], dict[str, Any]] | None = None

    @property
    def needs_sandbox(self) -> bool:
        """Whether the env must lease a sandbox at reset (for ``setup``/``score``)."""
        return bool(self.files)

    async def setup(self, sandbox: Sandbox) -> None:
        """Prepare the sandbox before the first turn: write ``files``."""
        for path, data in self.files.items():
            await sandbox.write_file(path, data)

    async def score(self, answer: str, sandbox: Sandbox | None) -> float:
        """The reward of the final ``answer``; ``verify`` runs on a thread of its own, off the
        event loop every ``ToolEnv`` of the process shares."""
        if self.verify is None:
            raise NotImplementedError("give Task a verify function or override score()")
        return float(await _in_thread(self.verify, answer, "agentrl-verify"))
