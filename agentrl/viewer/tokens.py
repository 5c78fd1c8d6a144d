"""Token ids to text for the token view: the run's own tokenizer, each id decoded alone.

The tokenizer is the one of the run's ``policy.model`` (a registered name or a
model folder, through ``agentrl.models.load_tokenizer``), or the one named with
``--tokenizer``. Without one the page shows ids, and says so: a wrong
tokenizer would show wrong text with confidence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Decoder", "load_decoder"]

Decoder = Callable[[list[int]], dict[int, str]]


def _decoder(tokenizer: Any) -> Decoder:
    cache: dict[int, str] = {}

    def decode(ids: list[int]) -> dict[int, str]:
        for i in ids:
            if i not in cache:
                cache[i] = tokenizer.decode([i])
        return {i: cache[i] for i in ids}

    return decode


def load_decoder(config: dict[str, Any], name: str | None = None) -> tuple[Decoder | None, str]:
    """``(decode, where it came from)``; ``(None, why not)`` when no tokenizer loads."""
    from ..errors import AgentRLError
    from ..models import load_tokenizer

    want = name or (config.get("policy") or {}).get("model")
    if not want:
        return None, "the run names no model: pass --tokenizer NAME"
    try:
        tok = load_tokenizer(str(want))
    except (AgentRLError, OSError, ValueError) as e:
        return None, f"no tokenizer for {want!r} ({type(e).__name__}: {e}); pass --tokenizer NAME"
    return _decoder(tok), f"tokenizer of {want}"
