"""vLLM's side of constrained replies: a logits processor that masks each step to the admissible-action trie.

A request of the ``vllm`` backend that carries ``GenerateRequest.admissible``
passes its replies' token ids (``policy.constrain.reply_ids``) in vLLM's
``SamplingParams.extra_args`` (``REPLIES``), and how many prompt tokens
already begin the reply (``HEAD``, a segment fork). ``AdmissibleLogitsProcessor``
builds that request's ``ActionTrie`` and, at every step, sets the logits of
the tokens the trie does not allow after the reply so far to -inf: the same
mask ``hf`` applies and the trainer rebuilds.

Why not vLLM's own guided decoding (``StructuredOutputsParams(choice=...)``):
its grammar allows every token sequence whose *text* spells a choice ("g" +
"o" as well as "go"), so its masked distribution is not the trie's, and the
trainer could not rebuild it without the grammar engine's view of every
token's bytes.

Why the log-probs are those of the masked distribution: in vLLM 0.32
``Sampler.forward`` applies the logits processors that are not argmax-invariant
(this one says it is not) before temperature, top-k and top-p, and the engine
runs with ``logprobs_mode="processed_logprobs"``, whose log-probs are computed
after all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from .constrain import ActionTrie

__all__ = ["HEAD", "REPLIES", "AdmissibleLogitsProcessor"]

REPLIES = "agentrl_replies"
HEAD = "agentrl_head"


class _RequestMask:
    """One request's mask: walks the trie along the tokens sampled so far (incrementally)."""

    def __init__(self, trie: ActionTrie, head: int):
        self.trie, self.head = trie, head
        self.node: int | None = None
        self.seen = 0

    def __call__(self, prompt_ids: Sequence[int], output_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        if self.node is None:
            # The policy checked the head before submitting: it is in the trie.
            self.node = self.trie.walk(list(prompt_ids[len(prompt_ids) - self.head:])) if self.head else 0
        while self.node is not None and self.seen < len(output_ids):
            self.node = self.trie.child(self.node, output_ids[self.seen])
            self.seen += 1
        allowed = self.trie.allowed(self.node) if self.node is not None else []
        if not allowed:  # past the end token: the request is finishing
            return logits
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        keep[torch.tensor(allowed, device=logits.device)] = True
        return logits.masked_fill(~keep, float("-inf"))


class AdmissibleLogitsProcessor(AdapterLogitsProcessor):
    """Masks the rows of requests that carry ``extra_args[REPLIES]``; other rows are untouched."""

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token is likeliest: applied for greedy rows too

    def new_req_logits_processor(self, params: Any) -> _RequestMask | None:
        extra = params.extra_args or {}
        replies = extra.get(REPLIES)
        if not replies:
            return None
        return _RequestMask(ActionTrie(replies), int(extra.get(HEAD, 0)))
