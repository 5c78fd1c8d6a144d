"""One job: the token-id prefix trie of a turn's admissible actions, and the tokens allowed at each step.

With ``rollout.constrain: admissible`` a turn whose env listed
``info["admissible_actions"]`` may only reply with one of them. A reply
*spells* an action when its token ids are exactly

    tokenizer.encode(action, add_special_tokens=False) + [tokenizer.eos_token_id]

the action's own tokens, the way SFT writes an expert's turn
(``train.sft.expert_tree``), then the end of turn (SmolLM2's ``<|im_end|>``),
on which every backend stops. The env then reads the bare action text, which
its exact-match fast path takes. Only that one tokenization is in the trie:
"g" + "o" spells "go" as well as "go" does, but allowing every spelling would
make the masked distribution depend on the whole vocabulary's strings.

The sampler (``policy.hf``) masks each step's logits to ``ActionTrie.allowed``
of the tokens sampled so far; the trainer rebuilds the same trie from the
actions recorded on the turn's ``Node.admissible`` (``episode_allowed``) and
masks its logits the same way (``train.logprobs.token_scores``), so sampled and
trained log-probs are both those of the constrained distribution.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..errors import PolicyError
from ..types import Episode

__all__ = ["ActionTrie", "allowed_tensor", "end_token_id", "episode_allowed", "mask_logits", "reply_ids",
           "turn_allowed"]


def end_token_id(tokenizer: Any) -> int:
    """The token that ends a constrained reply: the tokenizer's EOS (a chat model's end of turn)."""
    eos = tokenizer.eos_token_id
    if isinstance(eos, list | tuple):
        eos = eos[0] if eos else None
    if not isinstance(eos, int):
        raise PolicyError("rollout.constrain=admissible needs a tokenizer with an eos_token_id "
                          "to end the constrained reply")
    return eos


def reply_ids(tokenizer: Any, actions: Sequence[str]) -> list[list[int]]:
    """Each action's reply as token ids: its own tokens, then the end token."""
    end = end_token_id(tokenizer)
    return [list(tokenizer.encode(a, add_special_tokens=False)) + [end] for a in actions]


class ActionTrie:
    """The prefix trie of token-id sequences. Node 0 is the root (nothing sampled yet).

    ``allowed(node)`` lists, sorted, the tokens that keep a reply inside the
    trie; ``child(node, token)`` follows one (None when it leaves the trie).
    """

    __slots__ = ("_next",)

    def __init__(self, sequences: Iterable[Sequence[int]]):
        self._next: list[dict[int, int]] = [{}]
        for seq in sequences:
            node = 0
            for tok in seq:
                nxt = self._next[node].get(tok)
                if nxt is None:
                    nxt = len(self._next)
                    self._next[node][tok] = nxt
                    self._next.append({})
                node = nxt

    @classmethod
    def of(cls, tokenizer: Any, actions: Sequence[str]) -> ActionTrie:
        """The trie of the replies that spell ``actions`` (``reply_ids``)."""
        return cls(reply_ids(tokenizer, list(dict.fromkeys(actions))))

    def __len__(self) -> int:
        return len(self._next)

    def allowed(self, node: int = 0) -> list[int]:
        return sorted(self._next[node])

    def child(self, node: int, token: int) -> int | None:
        return self._next[node].get(token)

    def walk(self, ids: Sequence[int], node: int = 0) -> int | None:
        """The node after ``ids`` from ``node``; None when they leave the trie."""
        for tok in ids:
            nxt = self._next[node].get(tok)
            if nxt is None:
                return None
            node = nxt
        return node


def turn_allowed(trie: ActionTrie, action_ids: Sequence[int]) -> list[list[int]]:
    """The tokens allowed at each position of a constrained turn's action.

    Position i's list is ``trie.allowed`` after ``action_ids[:i]``. Raises
    ``ValueError`` when the action leaves the trie: it was not sampled under
    this constraint (another tokenizer, or a hand-edited tree).
    """
    out, node = [], 0
    for i, tok in enumerate(action_ids):
        out.append(trie.allowed(node))
        nxt = trie.child(node, tok)
        if nxt is None:
            raise ValueError(f"token {i} ({tok}) of a constrained turn spells no admissible action; "
                             "was it sampled with this tokenizer under rollout.constrain=admissible?")
        node = nxt
    return out


def episode_allowed(tokenizer: Any, episode: Episode,
                    tries: dict[tuple[str, ...], ActionTrie] | None = None) -> dict[int, list[int]]:
    """Every constrained action token of ``episode``: its position in ``input_ids`` -> the
    token ids allowed there (empty when no turn was constrained).

    A turn is constrained when the node that ends it has ``admissible`` (the
    partial nodes of a segment fork acted in the same state: the same list).
    ``tries`` caches a trie per action list across episodes (a tree's siblings
    share their states).
    """
    out: dict[int, list[int]] = {}
    tries = {} if tries is None else tries
    for turn, (node, (start, end)) in enumerate(zip(episode.nodes, episode.turn_spans, strict=True)):
        if node.admissible is None:
            continue
        key = tuple(node.admissible)
        trie = tries.get(key)
        if trie is None:
            trie = tries[key] = ActionTrie.of(tokenizer, key)
        try:
            allowed = turn_allowed(trie, episode.input_ids[start:end])
        except ValueError as e:  # name the turn: a run fails here, far from where it was sampled
            shown = ", ".join(repr(a) for a in key[:5]) + (", ..." if len(key) > 5 else "")
            raise ValueError(f"turn {turn} (node {node.id}, action {node.action_text!r}) against its "
                             f"{len(key)} admissible actions ({shown}): {e}") from None
        for k, ids in enumerate(allowed):
            out[start + k] = ids
    return out


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[n, V]`` with every token outside its row's ``allowed`` ids set to -inf.

    ``allowed`` is ``[n, A]`` token ids, -1 padding; a row with no id at all is
    not constrained and keeps its logits. The sampler (``policy.hf``) and the
    trainer (``train.logprobs``) both mask through here.
    """
    n, vocab = logits.shape
    valid = allowed >= 0
    # Padding scatters into an extra column, cut off after: it never clears an allowed id.
    idx = torch.where(valid, allowed, vocab).to(logits.device)
    keep = torch.zeros(n, vocab + 1, dtype=torch.bool, device=logits.device).scatter_(1, idx, True)[:, :vocab]
    free = ~valid.any(-1, keepdim=True).to(logits.device)
    return logits.masked_fill(~(keep | free), float("-inf"))


def allowed_tensor(rows: Sequence[Sequence[int] | None], device: torch.device | str = "cpu") -> torch.Tensor:
    """``[n, A]`` token ids from per-row lists (None or empty: unconstrained), -1 padding."""
    width = max((len(r) for r in rows if r), default=1)
    out = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.tensor(list(r), dtype=torch.long)
    return out.to(device)
