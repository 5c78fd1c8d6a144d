"""A turn-level value head for GAE over turns: a linear probe on the policy's own features.

One job: V(s_k), the value of the state in which turn k acts, for
``credit: gae`` (Schulman et al. 2016, GAE, Eq. 16, over turns instead of
tokens). The state's features are the policy's final hidden state at the last
context token before the turn's action (the position whose logits sampled the
action's first token), read without gradient: the head does not train the
policy's trunk. ``V(s) = w . [h(s); 1]``.

Why a probe refit by ridge regression rather than a critic trained with SGD
on a shared trunk (PPO's usual head): it needs no optimizer state, so a
checkpoint holds it as H + 1 numbers and a resumed run continues exactly; it
adds no backward pass; and with the trunk frozen for it, the value loss cannot
pull the policy's features. Its cost is one no-grad forward per episode a
step: credit comes before the old-logprob pass, so that pass cannot serve it.
Each step refits ``w`` on the batch's (features, lambda-return) pairs (Hoerl
and Kennard 1970, ridge) and moves the weights a share ``mix`` of the way
there, which averages the fits over recent batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from pydantic import Field

from ..credit import episode_gae
from ..strict import StrictModel
from ..types import Episode

__all__ = ["ValueHead", "ValueHeadConfig", "next_context", "ridge_fit", "turn_features"]


class ValueHeadConfig(StrictModel):
    """The ``train.value_head`` section (used by ``credit: gae``)."""

    l2: float = Field(1.0, ge=0.0, description="Ridge penalty on the weights (not the bias).")
    mix: float = Field(0.5, gt=0.0, le=1.0, description="Share of the way from the old weights to "
                       "each step's fit (1: use the newest fit alone).")


def ridge_fit(x: torch.Tensor, y: torch.Tensor, l2: float) -> torch.Tensor:
    """``argmin_w |[x, 1] w - y|^2 + l2 |w[:-1]|^2``: the weights, bias last (float64 normal equations)."""
    a = torch.cat([x.double(), torch.ones(len(x), 1, dtype=torch.float64)], dim=1)
    penalty = torch.full((a.shape[1],), float(l2), dtype=torch.float64)
    penalty[-1] = 0.0  # the bias is not shrunk
    gram = a.T @ a + torch.diag(penalty)
    return torch.linalg.lstsq(gram, a.T @ y.double()).solution.float()


def next_context(episode: Episode) -> list[int]:
    """The ids the turn after the last would have read, when ``max_turns`` cut the episode
    (``rollout.record_next_context``); ``[]`` when the episode ended or none were kept."""
    last = episode.nodes[-1] if episode.nodes else None
    if last is None or last.terminated or last.error:
        return []
    return list(last.info.get("next_context_ids") or [])


@torch.no_grad()
def turn_features(model: Any, episode: Episode) -> torch.Tensor:
    """``[turns (+1), H]``: the final hidden state at the token before each turn's action.

    An episode that ``max_turns`` cut gets one more row: the state after its last
    turn, read at the end of ``next_context(episode)`` (GAE's bootstrap)."""
    positions = [max(start - 1, 0) for start, _ in episode.turn_spans]
    tail = next_context(episode)
    if tail:
        positions.append(len(episode.input_ids) + len(tail) - 1)
    device = next(model.parameters()).device
    ids = torch.tensor([episode.input_ids + tail], device=device)
    if hasattr(model, "get_decoder"):  # the decoder alone: no vocabulary head, no per-layer states kept
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
    else:
        hidden = model(input_ids=ids, output_hidden_states=True, logits_to_keep=1, use_cache=False).hidden_states[-1]
    return hidden[0, positions].float().cpu()


class ValueHead:
    """``V(s) = w . [h(s); 1]``, refit each step; ``state``/``load`` for checkpoints."""

    def __init__(self, hidden_size: int, cfg: ValueHeadConfig):
        self.cfg = cfg
        self.w = torch.zeros(hidden_size + 1)  # V = 0 until the first fit: GAE is then plain returns

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        return features @ self.w[:-1] + self.w[-1]

    def fit(self, features: Sequence[torch.Tensor], episodes: Sequence[Episode], gamma: float,
            lam: float) -> dict[str, float]:
        """Move ``w`` toward the ridge fit of this batch's lambda-returns; stats before and after.

        ``value/mse_before`` is the old fit on new data; ``mse_after`` and
        ``explained_var`` are in-sample (the batch just fitted), so optimistic."""
        values = [self(f) for f in features]
        rows, targets = [], []
        for f, ep, v in zip(features, episodes, values, strict=True):
            turns = ep.num_turns  # a further row is the bootstrap state, which has no target of its own
            rows.append(f[:turns])
            adv = episode_gae(ep, lambda _, v=v: v.tolist(), gamma, lam)  # the bootstrap as credit reads it
            targets.append(torch.tensor(adv) + v[:turns])
        x, targets = torch.cat(rows), torch.cat(targets)
        before = float(((self(x) - targets) ** 2).mean())
        self.w = (1 - self.cfg.mix) * self.w + self.cfg.mix * ridge_fit(x, targets, self.cfg.l2)
        after = float(((self(x) - targets) ** 2).mean())
        var = float(targets.var(unbiased=False))
        return {"value/mse_before": before, "value/mse_after": after,
                "value/explained_var": 1 - after / var if var > 0 else 0.0, "value/turns": len(targets)}

    def state(self) -> list[float]:
        return self.w.tolist()

    def load(self, state: list[float]) -> None:
        if len(state) != len(self.w):
            raise ValueError(f"value head state has {len(state)} weights, this model needs {len(self.w)}")
        self.w = torch.tensor(state)
