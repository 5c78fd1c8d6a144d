"""M2PO: the second-moment trust-region mask for stale data, and its loss term.

One job: which tokens of a stale batch keep a policy-gradient term, and that
term (Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy
RL Reach with Stale Data on LLMs?", Algorithm 1). ``loss.token_masks`` decides
the mask over a whole minibatch; ``loss.policy_loss`` uses the term in place
of PPO-clip and TIS when ``train.loss.m2po_tau`` is set.
"""

from __future__ import annotations

import torch

__all__ = ["m2po_mask", "m2po_token_loss", "m2po_trust_region"]


def m2po_trust_region(logratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """M2PO's trust-region tokens: those of ``mask`` with A > 0 and r > 1, or A < 0 and r < 1.

    ``r = exp(logratio)``, the trained policy over the behaviour policy. These are
    the tokens whose update moves the ratio further from 1 (the ones PPO's clip
    would bind on); the others are never masked (Zheng et al. 2025, Algorithm 1,
    line 2, and their released code).
    """
    if not (logratio.shape == advantages.shape == mask.shape):
        raise ValueError("M2PO needs one advantage per token: logratio, advantages and mask "
                         "must share one shape")
    lr = logratio.detach()
    return mask.bool() & (((advantages > 0) & (lr > 0)) | ((advantages < 0) & (lr < 0)))


def m2po_mask(logratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              tau: float = 0.04) -> torch.Tensor:
    """M2PO's mask M (Zheng et al. 2025, "Prosperity before Collapse: How Far Can
    Off-Policy RL Reach with Stale Data on LLMs?", Algorithm 1, "M2PO Masking").

    With ``logratio = log pi_theta - log pi_behav`` and ``M2_i = (log r_i)^2`` (their
    second-moment estimate, M2 = (1/N) sum_i (log r_i)^2): start from M = True on
    every token and T = the trust-region tokens (``m2po_trust_region``); while
    mean_{i in T} M2_i > tau, mask the token of T with the largest M2_i and take it
    out of T. The statistic is over the tokens given, so pass a whole batch
    (``token_masks``). Implemented exactly, in one sort: keep the ``m`` smallest
    M2_i of T for the largest ``m`` whose mean is <= tau (the running mean of an
    ascending sort only grows, so the kept set is a prefix). Ties at the cut
    keep the earlier token. If even the smallest exceeds tau, all of T is masked.
    Returns a boolean mask: True on ``mask`` except the masked trust-region tokens.

    Deviation: a token whose ratio is not finite (a sampler's -inf logprob) is masked
    whatever its advantage. Outside T (A < 0 or A = 0 with r = inf) the paper keeps it, and
    its term ``-A r`` is +inf or NaN, in the loss and in every gradient of the step.
    """
    if tau < 0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    tr = m2po_trust_region(logratio, advantages, mask)
    s = logratio.detach().float()[tr] ** 2
    order = torch.sort(s, stable=True).indices
    running_mean = s[order].cumsum(0) / torch.arange(1, s.numel() + 1, device=s.device)
    n_keep = int((running_mean <= tau).sum())
    kept = torch.zeros_like(s, dtype=torch.bool)
    kept[order[:n_keep]] = True
    out = mask.bool().clone()
    out[tr] = kept
    return out & torch.isfinite(logratio.detach())


def m2po_token_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                    keep: torch.Tensor) -> torch.Tensor:
    """Per-token M2PO loss ``-M_t * r_t * A_t``, ``r = pi_theta / pi_behav`` (zero off ``keep``).

    The terms of Zheng et al. 2025's objective J_M2PO = (1 / sum_i |o_i|) sum_i sum_t
    M_it * pi_theta / pi_theta_old * A_it, where pi_theta_old is the policy that
    sampled the stale data (pi_behav in their M2 estimate): no clip, and no
    truncation of the ratio, whose variance the mask bounds instead. The mean
    over *all* tokens (masked ones included) is ``aggregate`` over ``count`` in
    ``policy_loss``. ``advantages`` may carry a last dimension (summed), as in
    ``ppo_clip_token_loss``.

    Deviations, in ``policy_loss``'s use: pi_behav is the sampler's reported
    logprob (the paper recomputes the stale policy's in the trainer), so r also
    carries the sampler/trainer engine mismatch; the mask's batch is one
    minibatch, under the weights of its optimizer step (their released code
    takes each micro-batch); tokens past ``max_token_staleness`` leave the mean (the
    paper has no such bound); the ``seq-mean-*`` aggregations average per
    sequence instead of over all tokens; the KL, entropy and extra terms are not
    masked.
    """
    on = keep.bool()
    # The ratio of masked tokens is never formed: M2PO masks the largest ones, and an infinite
    # one (a sampler's -inf logprob) times 0 is NaN, in the loss and in its gradient.
    log_ratio = torch.where(on, logprobs - behaviour_logprobs.detach(), torch.zeros_like(logprobs))
    A = advantages.detach().to(logprobs.dtype)
    if A.dim() == logprobs.dim() + 1:
        A = A.sum(-1)  # linear in A: the sum of the copies' terms
    return torch.where(on, -A * torch.exp(log_ratio), torch.zeros_like(logprobs))
