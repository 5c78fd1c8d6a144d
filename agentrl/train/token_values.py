"""What the update trained on, per token, kept with a step's saved trees for the viewer.

One job: turn a step's samples, once the update has run, into the
``tree.meta["token_values"]`` that ``agentrl.viewer.payload`` reads. Per leaf
of a saved tree, on the action tokens of the episode that ends there (the
positions where ``Episode.loss_mask`` is 1, root first):

- ``advantages``: the ``Sample.advantages`` the loss read (credit, then the
  distillation term ``w * (log pi_teacher - log pi_student)``); tree packing
  sums them per shared token (``rows``), from these same per-episode values;
- ``teacher_logprobs`` and ``student_logprobs``, where a teacher scored the
  student's sampled tokens (``Sample.distill.teacher`` and the student's
  scoring pass ``Sample.old``): the two sides of the distillation signal.

None of these change across ``train.epochs``: the advantages are fixed for the
step, and ``Sample.old`` is the scoring pass before the first epoch, so the
values are those of every epoch (the weights after each epoch are not
scored again). An asynchronous run saves the values of the step that trained
on the trees, whichever policy version sampled them.

A token the update left out of its mask (TIP), or that its loss left out in
every epoch (the update's ``Sample.trained``: sampled more than
``train.loss.max_token_staleness`` versions before the update, or masked by
M2PO, whose mask is a minibatch statistic that can change per epoch), is
``null``. An episode it left out altogether is ``{"trained": false, "reason":
...}``: a failed episode, an MC-GRPO pivot, one whose advantages were all 0
(``train.skip_zero_advantage``), one without an action token, or one whose
every token the loss's mask dropped. Values are rounded to ``DECIMALS``
places: JSON floats are text, and this keeps a saved step small.
"""

from __future__ import annotations

from typing import Any

from ..types import Episode, EpisodeGroup
from .batch import Sample

__all__ = ["DECIMALS", "token_values", "untrained_reason"]

DECIMALS = 4


def _on_actions(values: list[float], episode_mask: list[int], trained_mask: list[int]) -> list[float | None]:
    """``values`` at the episode's action tokens, rounded; ``None`` where the update's mask left one out."""
    return [round(float(v), DECIMALS) if t else None
            for v, m, t in zip(values, episode_mask, trained_mask, strict=True) if m]


def untrained_reason(episode: Episode, credited: bool, credit: str) -> str:
    """Why the update left ``episode`` out: ``credited`` says whether credit gave it advantages."""
    if not credited:
        if episode.error:
            return f"failed episode, left out (rollout.failed_episodes=exclude): {episode.error.splitlines()[0]}"
        if credit == "mc_grpo":
            return "MC-GRPO's pivot: the group's median episode carries no gradient"
        return f"left out by train.credit={credit}"
    if not any(episode.loss_mask):
        return "no action token (it failed before its first turn)"
    return "every advantage 0 (train.skip_zero_advantage)"


def token_values(group: EpisodeGroup, samples: list[Sample], credited: set[int],
                 credit: str) -> dict[str, dict[str, Any]]:
    """``{"<leaf id>": values}`` for one tree (see the module docstring), read after the update.

    ``samples`` are the step's samples (a sample's ``episode`` is one of the
    group's episodes or another tree's), ``credited`` the ``id``s of the
    episodes credit gave advantages to, ``credit`` the ``train.credit`` method. A sample's
    trained tokens are ``Sample.trained`` where the update set it, else ``Sample.mask``.
    """
    trained = {id(s.episode): s for s in samples if s.episode is not None}
    out: dict[str, dict[str, Any]] = {}
    for leaf, ep in zip(group.leaf_ids, group.episodes, strict=True):
        s = trained.get(id(ep))
        if s is None:
            out[str(leaf)] = {"trained": False, "reason": untrained_reason(ep, id(ep) in credited, credit)}
            continue
        mask = s.trained if s.trained is not None else s.mask
        if any(s.mask) and not any(mask):
            out[str(leaf)] = {"trained": False, "reason": "the loss's mask dropped every action token "
                                                          "(train.loss.max_token_staleness or m2po_tau)"}
            continue
        vals: dict[str, Any] = {"advantages": _on_actions(s.advantages, ep.loss_mask, mask)}
        if s.distill.teacher is not None and s.old is not None:
            vals["teacher_logprobs"] = _on_actions(s.distill.teacher, ep.loss_mask, mask)
            vals["student_logprobs"] = _on_actions(s.old, ep.loss_mask, mask)
        out[str(leaf)] = vals
    return out
