"""``mock`` backend: scripted, deterministic responses for tests and dry runs.

A response is chosen by a callable from the decoded prompt (or taken from a
list), tokenized, and followed by EOS. A list is a script: in deterministic
mode (the rollout engine's default) turn t of every episode answers
``responses[t % len(responses)]``, whatever order concurrent episodes call in;
otherwise the list cycles in call order. Logprobs are a fixed value per token,
so tests can hand-compute anything downstream. Stop tokens and stop strings end
the response where they would end a real backend's (see ``policy.base``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..chat import decode_ids, render_ids
from ..errors import PolicyError
from .base import GenerateRequest, GenerateResult, stop_string_hit

__all__ = ["MockPolicy"]


class MockPolicy:
    """Answer each request with a scripted text.

    ``responses`` is a list (a script: by the prompt's turn in ``deterministic``
    mode, else cycled in call order) or a function of the decoded prompt text.
    ``max_new_tokens`` is honoured: a longer response is cut and reported as
    ``length``.
    """

    deterministic_by_default = True  # rollout.deterministic: null; free here

    def __init__(self, tokenizer: Any, responses: Sequence[str] | Callable[[str], str],
                 logprob: float = -0.5, deterministic: bool = False):
        self.tokenizer = tokenizer
        self.responses = responses
        self.logprob = logprob
        self.deterministic = deterministic
        self.version = 0
        self.calls = 0
        self._encoded: dict[str, list[int]] = {}  # scripts repeat their texts: tokenize each once
        self._header: list[int] | None = None  # the chat template's assistant header, once found

    def _respond(self, prompt_ids: list[int]) -> str:
        if callable(self.responses):
            return self.responses(decode_ids(self.tokenizer, prompt_ids))
        n = len(self.responses)
        if n == 1:
            return self.responses[0]
        turn = self._turn(prompt_ids) if self.deterministic else None
        return self.responses[(self.calls if turn is None else turn) % n]

    def _turn(self, prompt_ids: list[int]) -> int | None:
        """Assistant turns already in the prompt (the headers of the template's assistant
        messages, less the one it ends with); None when the template shows none."""
        if self._header is None:
            user = [{"role": "user", "content": "x"}]
            try:
                full, bare = render_ids(self.tokenizer, user, True), render_ids(self.tokenizer, user, False)
            except Exception:  # no chat template: the script goes in call order
                full = bare = []
            self._header = full[len(bare):] if full[:len(bare)] == bare else []
        h = self._header
        if not h:
            return None
        count, i = 0, 0
        while (i := _find(prompt_ids, h, i)) >= 0:
            count, i = count + 1, i + len(h)
        return max(count - 1, 0)

    def _encode(self, text: str) -> list[int]:
        """The response's ids, then EOS (a cached list: ``_cut`` copies what it keeps)."""
        if text not in self._encoded:
            if len(self._encoded) >= 4096:  # a callable may answer with ever new texts
                self._encoded.clear()
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            self._encoded[text] = ids + [self.tokenizer.eos_token_id]
        return self._encoded[text]

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        out = []
        for req in requests:
            if req.admissible:  # a scripted reply is no sample of the masked distribution
                raise PolicyError("the mock backend cannot constrain a reply to admissible actions; "
                                  "rollout.constrain: admissible needs hf or vllm")
            text = self._respond(req.prompt_ids)
            self.calls += 1
            out.append(self._cut(self._encode(text), req))
        return out

    async def agenerate(self, request: GenerateRequest) -> GenerateResult:
        """Instant, so no batching: answered on the caller's loop."""
        return self.generate([request])[0]

    def _cut(self, ids: list[int], req: GenerateRequest) -> GenerateResult:
        """End the response as a sampler would: at a stop token, stop string or the length."""
        p, stop_ids = req.params, {self.tokenizer.eos_token_id, *req.params.stop_token_ids}
        finish = "length"
        for n in range(1, min(len(ids), p.max_new_tokens) + 1):
            if ids[n - 1] in stop_ids:
                finish = "stop"
            elif stop_string_hit(self.tokenizer, ids[:n], p.stop):
                finish = "stop_string"
            if finish != "length":
                break
        ids = ids[:n]
        return GenerateResult(ids, [self.logprob] * n, [0.0] * n, finish, self.version)  # type: ignore[arg-type]

    def update_weights(self, state_dict: dict[str, Any]) -> None:
        self.version += 1


def _find(seq: list[int], sub: list[int], start: int) -> int:
    """Index of the first occurrence of ``sub`` in ``seq`` at or after ``start``; -1 when none."""
    while True:
        try:
            start = seq.index(sub[0], start)
        except ValueError:
            return -1
        if seq[start:start + len(sub)] == sub:
            return start
        start += 1
