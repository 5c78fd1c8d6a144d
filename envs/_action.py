"""What every built-in env does with an action that is not a ``str``.

Models send text; a non-``str`` action (None, bytes, a number, a parsed tool
call) is a caller's mistake. It is answered like any invalid action, in the
env's own words plus ``not_text``'s sentence, and the step counts: the episode
goes on, and the observation says what was wrong. Bytes are refused too, not
decoded: the caller knows their encoding, the env does not. The sentence is
the one ``agentrl.tools.parse`` gives, so the tool envs and the others agree.
"""

from __future__ import annotations

from typing import Any

__all__ = ["not_text"]


def not_text(action: Any) -> str | None:
    """None when ``action`` is a ``str``; else the sentence that names its type."""
    if isinstance(action, str):
        return None
    return f"The action must be text, got {type(action).__name__}."
