"""``hf`` backend: batched sampling with a transformers causal LM and a KV cache.

The decoding loop is our own rather than ``model.generate`` because training
needs, for every sampled token, its logprob under the exact distribution it was
drawn from (after temperature, top-k and top-p) and that distribution's
entropy; ``generate`` returns processed scores only for the whole vocabulary
and does not report the sampling distribution's entropy.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..errors import PolicyError
from .base import GenerateRequest, GenerateResult, SamplingParams

__all__ = ["HFPolicy", "sampling_logprobs"]


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution ``params`` samples from.

    ``logits`` is ``[B, V]``. Temperature scales the logits; top-k then top-p
    (nucleus, Holtzman et al. 2020, Sec. 3.1) set removed tokens to -inf. With
    ``temperature == 0`` (greedy) the unscaled distribution is returned.
    """
    logits = logits.float()
    if params.temperature > 0:
        logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always the first token).
        drop = probs.cumsum(-1) - probs >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.log_softmax(logits, dim=-1)


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    p = logp.exp()
    return -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)


class HFPolicy:
    """Sample from a transformers causal LM, many prompts at once.

    Requests in one ``generate`` call are grouped by identical sampling
    parameters and run as left-padded batches of at most ``max_batch_size``.
    """

    def __init__(self, model: Any, tokenizer: Any, max_batch_size: int = 16):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.version = 0
        eos = tokenizer.eos_token_id
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        cfg_eos = getattr(model.generation_config, "eos_token_id", None)
        if cfg_eos is not None:
            self.eos_ids |= {cfg_eos} if isinstance(cfg_eos, int) else set(cfg_eos)
        # transformers 5 renamed `past_key_values` to `cache` (argument and output).
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def update_weights(self, state_dict: dict[str, Any]) -> None:
        """Load new weights in place and bump ``version``."""
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        if unexpected:
            raise PolicyError(f"unexpected weight names: {sorted(unexpected)[:5]}")
        self.version += 1

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        results: list[GenerateResult | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            if not req.prompt_ids:
                raise PolicyError(f"request {i} has an empty prompt")
            p = req.params
            key = (p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.stop,
                   p.stop_token_ids, p.logprobs, p.seed)
            groups.setdefault(key, []).append(i)
        for idx in groups.values():
            for s in range(0, len(idx), self.max_batch_size):
                chunk = idx[s:s + self.max_batch_size]
                outs = self._generate_batch([requests[i].prompt_ids for i in chunk],
                                            requests[chunk[0]].params)
                for i, out in zip(chunk, outs, strict=True):
                    results[i] = out
        return results  # type: ignore[return-value]

    @torch.inference_mode()
    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerateResult]:
        B, dev = len(prompts), self.device
        width = max(map(len, prompts))
        input_ids = torch.full((B, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, width), dtype=torch.long)
        for b, p in enumerate(prompts):
            input_ids[b, width - len(p):] = torch.tensor(p)
            attn[b, width - len(p):] = 1
        input_ids, attn = input_ids.to(dev), attn.to(dev)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        gen = torch.Generator(device=dev)
        gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(2**62, ())))
        stop_ids = self.eos_ids | set(params.stop_token_ids)

        toks: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        ents: list[list[float]] = [[] for _ in range(B)]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in range(B)]
        finish: list[str | None] = [None] * B
        out = self.model(input_ids=input_ids, attention_mask=attn, position_ids=pos, use_cache=True,
                         logits_to_keep=1)
        for _ in range(params.max_new_tokens):
            logp = sampling_logprobs(out.logits[:, -1, :], params)
            if params.temperature == 0:
                nxt = logp.argmax(-1)
            else:
                nxt = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
            chosen = logp.gather(-1, nxt[:, None]).squeeze(-1)
            ent = _entropy(logp)
            top = torch.topk(logp, params.logprobs, dim=-1) if params.logprobs else None
            for b in range(B):
                if finish[b] is not None:
                    continue
                t = int(nxt[b])
                toks[b].append(t)
                lps[b].append(float(chosen[b]))
                ents[b].append(float(ent[b]))
                if top is not None:
                    tops[b].append([(int(i), float(v)) for i, v in
                                    zip(top.indices[b], top.values[b], strict=True)])
                if t in stop_ids:
                    finish[b] = "stop"
                elif params.stop and self._hit_stop_string(toks[b], params.stop):
                    finish[b] = "stop_string"
            if all(f is not None for f in finish):
                break
            nxt = torch.where(torch.tensor([f is None for f in finish], device=dev), nxt, self.pad_id)
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=dev)], dim=1)
            pos = pos[:, -1:] + 1
            out = self.model(input_ids=nxt[:, None], attention_mask=attn, position_ids=pos,
                             use_cache=True, **{self._cache_kw: getattr(out, self._cache_kw)})
        return [
            GenerateResult(toks[b], lps[b], ents[b], finish[b] or "length", self.version,  # type: ignore[arg-type]
                           tops[b] if params.logprobs else None)
            for b in range(B)
        ]

    def _hit_stop_string(self, toks: list[int], stop: tuple[str, ...]) -> bool:
        # Decode only the tail: a stop string is short, so 16 tokens cover it.
        tail = self.tokenizer.decode(toks[-16:], skip_special_tokens=False)
        return any(s in tail for s in stop)
