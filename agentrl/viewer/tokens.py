"""Token ids to text for the token view: the run's own tokenizer, each id decoded alone.

The tokenizer is the one of the run's ``policy.model`` (a registered name or a
model folder, through ``agentrl.models.load_tokenizer``), or the one named with
``--tokenizer``. Without one the page shows ids, and says so: a wrong
tokenizer would show wrong text with confidence.

A token that holds part of a UTF-8 character (byte-level BPE splits an emoji
or most CJK text across tokens) decodes alone to U+FFFD, the same mark for
every such token; it is shown as its bytes instead (``\\xf0\\x9f``), read from
its vocabulary piece: GPT-2's byte-to-unicode alphabet, or sentencepiece's
byte fallback (``<0xF0>``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache
from typing import Any

__all__ = ["Decoder", "load_decoder", "piece_bytes"]

Decoder = Callable[[list[int]], dict[int, str]]

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-unicode map, inverted: the character a byte-level BPE piece uses for
    each byte (printable Latin-1 for itself, the rest shifted past U+0100)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + k): b for k, b in enumerate(shifted)}}


def piece_bytes(piece: str) -> bytes | None:
    """The bytes a vocabulary piece stands for, where its form says (byte-level BPE, or a
    sentencepiece byte-fallback piece); None otherwise."""
    if m := _BYTE_FALLBACK.fullmatch(piece):
        return bytes([int(m.group(1), 16)])
    alphabet = _byte_level_alphabet()
    if piece and all(ch in alphabet for ch in piece):
        return bytes(alphabet[ch] for ch in piece)
    return None


def _token_text(tokenizer: Any, i: int) -> str:
    """Token ``i`` decoded alone; its bytes (``\\xNN``) where that gives a replacement mark."""
    text = tokenizer.decode([i])
    if "\ufffd" not in text or not hasattr(tokenizer, "convert_ids_to_tokens"):
        return text
    piece = tokenizer.convert_ids_to_tokens([i])[0]
    raw = piece_bytes(piece) if isinstance(piece, str) else None
    return raw.decode("utf-8", "backslashreplace") if raw is not None else text


def _decoder(tokenizer: Any) -> Decoder:
    """``decode(ids) -> {id: text}``, each id decoded once. An id the tokenizer cannot decode
    (a negative one, one past its integer type: another writer's padding) is left out, so
    the page shows it as its id; one such id must not make the whole tree undrawable."""
    known: dict[int, str | None] = {}

    def decode(ids: list[int]) -> dict[int, str]:
        for i in ids:
            if i not in known:
                try:
                    known[i] = _token_text(tokenizer, i)
                except (OverflowError, ValueError, TypeError, IndexError, KeyError):
                    known[i] = None
        return {i: text for i in ids if (text := known[i]) is not None}

    return decode


def load_decoder(config: dict[str, Any], name: str | None = None) -> tuple[Decoder | None, str]:
    """``(decode, where it came from)``; ``(None, why not)`` when no tokenizer loads."""
    from ..models import load_tokenizer

    want = name or (config.get("policy") or {}).get("model")
    if not want:
        return None, "the run names no model: pass --tokenizer NAME"
    try:
        tok = load_tokenizer(str(want))
    # ours (no such model), and transformers' own: KeyError('added_tokens') on a corrupt tokenizer.json
    except Exception as e:
        return None, f"no tokenizer for {want!r} ({type(e).__name__}: {str(e)[:300]}); pass --tokenizer NAME"
    return _decoder(tok), f"tokenizer of {want}"
