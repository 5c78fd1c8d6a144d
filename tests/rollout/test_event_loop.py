"""The event loop every episode shares stays free while an env's long answer is tokenized."""

from __future__ import annotations

import threading
from typing import Any

from agentrl.chat import ChatContext
from agentrl.config import load_config
from agentrl.env import TextEnv, register_env
from agentrl.policy import MockPolicy
from agentrl.rollout import collect

_LONG = "word " * 12_000  # 60,000 characters: about 0.3 s to tokenize, 12,000 tokens


class LongAnswers(TextEnv):
    """Opens with a long page and answers with another (``cat`` of a log, a web page)."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return "Read this. " + _LONG, {}

    def step(self, action: str):
        return "More. " + _LONG, 0.0, False, False, {}


register_env("agentrl/TestLongAnswers-v0", entry_point=LongAnswers)


def test_long_env_answers_are_tokenized_off_the_event_loop(tokenizer, monkeypatch):
    """Tokenizing them on the loop stalled every other episode (a second a megabyte, and the
    tokenizer lets go of the GIL, so a thread keeps the loop free)."""
    on_loop: list[str] = []
    init, observe = ChatContext.__init__, ChatContext.observation_ids

    def where(what: str, size: int) -> None:
        if size > len(_LONG) and threading.current_thread() is threading.main_thread():
            on_loop.append(what)

    def spy_init(self, tokenizer, messages, *a, **k):
        where("opening", sum(len(str(m["content"])) for m in messages))
        init(self, tokenizer, messages, *a, **k)

    def spy_observe(self, messages):
        where("observation", sum(len(str(m["content"])) for m in messages))
        return observe(self, messages)

    monkeypatch.setattr(ChatContext, "__init__", spy_init)
    monkeypatch.setattr(ChatContext, "observation_ids", spy_observe)
    cfg = load_config(overrides=["rollout.max_turns=2", "rollout.max_context_tokens=32768"])
    (tree,) = collect("agentrl/TestLongAnswers-v0", MockPolicy(tokenizer, ["ok"]), cfg, [0])
    (ep,) = tree.episodes()
    assert ep.error is None and ep.num_turns == 2 and len(ep.input_ids) > 24_000
    assert on_loop == []
