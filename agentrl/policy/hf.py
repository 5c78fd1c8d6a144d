"""``hf`` backend: batched sampling with a transformers causal LM and a KV cache.

The decoding loop is our own rather than ``model.generate`` because training
needs, for every sampled token, its logprob under the exact distribution it was
drawn from (after temperature, top-k and top-p) and that distribution's
entropy; ``generate`` returns processed scores only for the whole vocabulary
and does not report the sampling distribution's entropy.

Across turns, each sequence's keys and values stay in a ``PrefixCache``: a
prompt that extends (or shares a prefix with) an earlier sequence prefills only
its new tokens. Rows whose cached prefixes and new tokens differ in length share
one batch: the cached part is left-padded to the longest one, the new tokens are
left-padded after it, the attention mask hides both pads, and explicit position
ids keep every row's positions those of its own unpadded sequence.
"""

from __future__ import annotations

import inspect
import random
from typing import Any

import torch

from ..errors import PolicyError
from .base import GenerateRequest, GenerateResult, SamplingParams, stop_string_hit
from .prefix_cache import PrefixCache, PrefixEntry

__all__ = ["HFPolicy", "sampling_logprobs"]


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution ``params`` samples from.

    ``logits`` is ``[B, V]``. Temperature scales the logits; top-k then top-p
    (nucleus, Holtzman et al. 2020, Sec. 3.1) set removed tokens to -inf. With
    ``temperature == 0`` (greedy) the unprocessed distribution is returned, with
    no top-k or top-p: a point mass has no useful logprobs (see ``GenerateResult``).
    """
    logits = logits.float()
    if params.temperature == 0:
        return torch.log_softmax(logits, dim=-1)
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
    parameters (seeds aside: each request has its own stream) and run in
    batches of at most ``max_batch_size``. ``prefix_cache_mb`` bounds the
    keys and values kept across calls (0 turns prefix reuse off).
    """

    def __init__(self, model: Any, tokenizer: Any, max_batch_size: int = 16,
                 prefix_cache_mb: int = 4096):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.version = 0
        self.prefix_cache = PrefixCache(prefix_cache_mb * 2**20) if prefix_cache_mb > 0 else None
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

    def update_weights(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load new weights in place, bump ``version`` and drop the now stale prefix cache.

        Every weight must be given unless ``strict=False``; a failed update
        leaves the version as it was.
        """
        try:
            missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        except RuntimeError as e:  # shape mismatches
            raise PolicyError(f"weight update failed: {e}") from e
        if unexpected:
            raise PolicyError(f"unexpected weight names: {sorted(unexpected)[:5]}")
        if missing and strict:
            raise PolicyError(f"{len(missing)} weights missing from the update, e.g. {sorted(missing)[:5]}; "
                              "pass strict=False for a partial update")
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.version += 1

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        results: list[GenerateResult | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            if not req.prompt_ids:
                raise PolicyError(f"request {i} has an empty prompt")
            p = req.params
            key = (p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.stop,
                   p.stop_token_ids, p.logprobs)
            groups.setdefault(key, []).append(i)
        for idx in groups.values():
            for s in range(0, len(idx), self.max_batch_size):
                chunk = idx[s:s + self.max_batch_size]
                outs = self._generate_batch([requests[i] for i in chunk])
                for i, out in zip(chunk, outs, strict=True):
                    results[i] = out
        return results  # type: ignore[return-value]

    def _match(self, prompt: list[int]) -> tuple[PrefixEntry | None, int]:
        if self.prefix_cache is None:
            return None, 0
        return self.prefix_cache.match(prompt)

    def _past(self, matches: list[tuple[PrefixEntry | None, int]], width: int) -> Any:
        """A transformers cache holding each row's reused prefix, left-padded to ``width``."""
        from transformers import DynamicCache

        cache = DynamicCache()
        rows = [(b, e, n) for b, (e, n) in enumerate(matches) if e is not None]
        for layer in range(len(rows[0][1].kv)):
            k0 = rows[0][1].kv[layer][0]
            keys = k0.new_zeros((len(matches), k0.shape[0], width, k0.shape[2]))
            values = torch.zeros_like(keys)
            for b, e, n in rows:
                keys[b, :, width - n:] = e.kv[layer][0][:, :n]
                values[b, :, width - n:] = e.kv[layer][1][:, :n]
            cache.update(keys, values, layer)
        return cache

    def _store(self, cache: Any, columns: list[torch.Tensor], seqs: list[list[int]]) -> None:
        """Keep each row's keys and values (its real columns only) for later prompts."""
        if self.prefix_cache is None:
            return
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        for b, (cols, ids) in enumerate(zip(columns, seqs, strict=True)):
            kv = [(k[b].index_select(1, cols), v[b].index_select(1, cols)) for k, v in layers]
            self.prefix_cache.insert(ids, kv)

    @torch.inference_mode()
    def _generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        params, dev, B = requests[0].params, self.device, len(requests)
        prompts = [r.prompt_ids for r in requests]
        matches = [self._match(p) for p in prompts]
        cached = [n for _, n in matches]
        news = [p[n:] for p, n in zip(prompts, cached, strict=True)]
        wc, wn = max(cached), max(map(len, news))
        input_ids = torch.full((B, wn), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, wc + wn), dtype=torch.long)
        pos = torch.zeros((B, wn), dtype=torch.long)
        for b, (n, new) in enumerate(zip(cached, news, strict=True)):
            input_ids[b, wn - len(new):] = torch.tensor(new)
            attn[b, wc - n:wc] = 1
            attn[b, wc + wn - len(new):] = 1
            pos[b] = torch.arange(n - wn + len(new), n + len(new)).clamp(min=n)
        input_ids, attn, pos = input_ids.to(dev), attn.to(dev), pos.to(dev)
        gens = [torch.Generator(device=dev).manual_seed(
            r.params.seed if r.params.seed is not None else random.getrandbits(62)) for r in requests]
        stop_ids = self.eos_ids | set(params.stop_token_ids)

        toks: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        ents: list[list[float]] = [[] for _ in range(B)]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in range(B)]
        finish: list[str | None] = [None] * B
        past = {self._cache_kw: self._past(matches, wc)} if wc else {}
        out = self.model(input_ids=input_ids, attention_mask=attn, position_ids=pos, use_cache=True,
                         logits_to_keep=1, **past)
        for step in range(params.max_new_tokens):
            logp = sampling_logprobs(out.logits[:, -1, :], params)
            if params.temperature == 0:
                nxt = logp.argmax(-1)
            else:  # one stream per request: its sample does not depend on the batch
                probs = logp.exp()
                nxt = torch.cat([torch.multinomial(probs[b], 1, generator=gens[b]) for b in range(B)])
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
                elif stop_string_hit(self.tokenizer, toks[b], params.stop):
                    finish[b] = "stop_string"
            if all(f is not None for f in finish) or step == params.max_new_tokens - 1:
                break
            live = torch.tensor([f is None for f in finish], device=dev)
            nxt = torch.where(live, nxt, self.pad_id)
            attn = torch.cat([attn, live[:, None].to(attn.dtype)], dim=1)
            pos = pos[:, -1:] + 1
            out = self.model(input_ids=nxt[:, None], attention_mask=attn, position_ids=pos,
                             use_cache=True, **{self._cache_kw: getattr(out, self._cache_kw)})
        # Real columns of each row: its reused prefix, its new tokens, and the
        # sampled tokens that were fed back (all but the last one).
        columns = [torch.cat([torch.arange(wc - n, wc), torch.arange(wc + wn - len(new), wc + wn),
                              torch.arange(wc + wn, wc + wn + len(toks[b]) - 1)]).to(dev)
                   for b, (n, new) in enumerate(zip(cached, news, strict=True))]
        self._store(getattr(out, self._cache_kw), columns,
                    [p + t[:-1] for p, t in zip(prompts, toks, strict=True)])
        return [
            GenerateResult(toks[b], lps[b], ents[b], finish[b] or "length", self.version,  # type: ignore[arg-type]
                           tops[b] if params.logprobs else None, cached_tokens=cached[b])
            for b in range(B)
        ]
