"""The teachers of on-policy distillation, and the privileged text they read first.

One job: load a teacher and build what it reads besides the student's own ids.
A model folder or registered name is loaded frozen (``load_teacher``), a vLLM
engine serves ``vllm:NAME`` (``load_vllm_teacher``); both must share the
student's tokenizer, since the teacher scores the student's token ids, never
re-tokenized. Privileged text comes from the env's reset
``info["privileged"]`` or, with ``privileged_source: hindsight``, from the
group's own best episode (``hindsight_summary``); it is a system message in
front of the student's ids (``privileged_prefix``), whose document BOS (if the
template writes one, ``document_bos``) replaces the student's own.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import ConfigError
from ...types import EpisodeGroup, RolloutTree

__all__ = ["document_bos", "hindsight_summary", "load_teacher", "load_vllm_teacher", "privileged_prefix"]


def load_teacher(name: str, student_tokenizer: Any, device: torch.device) -> torch.nn.Module:
    """The frozen teacher model; refuses one whose tokenizer differs from the student's."""
    from ...models import load_model

    try:
        model, tokenizer = load_model(name, device=str(device))
    except Exception as e:  # an unknown name or a folder transformers cannot read
        raise ConfigError(f"train.distill.teacher={name!r}: cannot load it ({e})") from e
    if tokenizer.get_vocab() != student_tokenizer.get_vocab():
        raise ConfigError(f"train.distill.teacher={name!r} has another tokenizer than the student; "
                          "the teacher scores the student's token ids, so they must share one")
    return model.requires_grad_(False).eval()


def load_vllm_teacher(name: str, student_tokenizer: Any, max_len: int, **engine: Any) -> Any:
    """A vLLM engine in this process that scores as the teacher (``teacher: vllm:NAME``)."""
    from ...policy.vllm import VLLMPolicy

    try:
        teacher = VLLMPolicy(name, **{**engine, "max_model_len": max_len})  # the rollouts set it
    except Exception as e:
        raise ConfigError(f"train.distill.teacher='vllm:{name}': cannot start it ({e})") from e
    if teacher.tokenizer.get_vocab() != student_tokenizer.get_vocab():
        teacher.close()
        raise ConfigError(f"train.distill.teacher='vllm:{name}' has another tokenizer than the student")
    return teacher


def privileged_prefix(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as a system message, rendered with the chat template.

    A template that cannot render a lone system message gets ``text`` and a
    blank line as plain tokens instead.
    """
    msg = [{"role": "system", "content": f"Privileged information (the agent cannot see it): {text}"}]
    try:
        ids = tokenizer.apply_chat_template(msg, tokenize=True, add_generation_prompt=False)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return list(ids)
    except Exception:  # a template that refuses a lone system message
        return tokenizer(msg[0]["content"] + "\n\n", add_special_tokens=False)["input_ids"]


def hindsight_summary(tree: RolloutTree | EpisodeGroup, tokenizer: Any, max_tokens: int = 1024) -> str:
    """Privileged text from a group's own rollouts of one task (SD-Search / OPSD-style hindsight).

    The group's best episode (highest return; the first on ties) as its
    decoded actions (cut after about ``max_tokens``), with its return and how
    many attempts it was picked from. Written after the group ran, so the
    teacher knows what worked on *this* task and scores each of the group's
    turns in that light. When every attempt got the same return there is no
    best one to point at, and the text says only that.
    """
    episodes = [ep for ep in EpisodeGroup.of(tree).episodes if not ep.error and ep.nodes]
    if not episodes:
        return "Hindsight: no attempt at this task ran without an error."
    returns = [ep.total_reward for ep in episodes]
    if len(episodes) < 2 or max(returns) == min(returns):  # no better attempt to point at
        return (f"Hindsight from {len(episodes)} attempt(s) at this task: all got return {returns[0]:g}; "
                "none did better.")
    best = max(episodes, key=lambda ep: ep.total_reward)
    head = (f"Hindsight from {len(episodes)} attempts at this task. The best one (return "
            f"{best.total_reward:g}) took these actions: ")
    actions, used = [], len(tokenizer(head, add_special_tokens=False)["input_ids"])
    for n in best.nodes:  # at most max_tokens: the teacher's context has room for so much
        text = tokenizer.decode(n.action_ids, skip_special_tokens=True).strip()
        used += len(n.action_ids) + 1
        if used > max_tokens:
            actions.append("...")
            break
        actions.append(text)
    return head + "; ".join(actions)


def document_bos(tokenizer: Any) -> int | None:
    """The BOS id if the chat template writes it once, at a conversation's start; else None.

    Some tokenizers name a turn marker their BOS (SmolLM2's is ``<|im_start|>``,
    which opens every message): dropping that from the student's ids would leave
    its first turn without its opening tag.
    """
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    try:
        ids = tokenizer.apply_chat_template([{"role": "system", "content": "a"}, {"role": "user", "content": "b"}],
                                            tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    except Exception:  # no usable template: keep every token
        return None
    return bos if list(ids).count(bos) == 1 and list(ids)[:1] == [bos] else None
