"""``hf`` backend: batched sampling with a transformers causal LM and a KV cache.

The decoding loop is our own rather than ``model.generate`` because training
needs, for every sampled token, its logprob under the exact distribution it was
drawn from (after temperature, top-k and top-p) and that distribution's
entropy; ``generate`` returns processed scores only for the whole vocabulary
and does not report the sampling distribution's entropy.

Across turns, each sequence's keys and values stay in a ``PrefixCache``: a
prompt that extends (or shares a prefix with) an earlier sequence prefills only
its new tokens. A batch's keys and values live in a ``KVSlab``, every row's
tokens right-aligned and contiguous, so a finished row is cached as a view
without a copy. Rows are sorted by how many new tokens they bring and
prefilled in groups: a row whose new part is shorter than its group's longest
re-runs a few of its cached tokens instead of padding (the same work padding
would cost, but it keeps the row contiguous). Explicit position ids keep every
row's positions those of its own unpadded sequence.

Deterministic mode (``deterministic=True``, which the rollout engine sets from
``rollout.deterministic``): a row's tokens and logprobs do not depend on which
requests share its batch, in what order, nor on what the prefix cache met
before. Linear layers run in fixed blocks of rows, attention runs per row over
the row's own keys, padding never overwrites a cached token, and cached keys
and values are reused only at the boundaries of the chunks that computed them
(``policy/deterministic.py`` says why each is needed).

Constrained replies (``GenerateRequest.admissible``, ``rollout.constrain:
admissible``): a row's logits are masked at every step to the tokens its
action trie allows after what it has sampled (``policy.constrain``), before
temperature, top-k and top-p, so its logprobs and entropies are those of the
constrained distribution, which the trainer rebuilds.

Precision (``precision="bf16"``, ``policy.precision``): generation runs
under bf16 autocast with the vocabulary head in fp32, what ``train.precision:
bf16`` computes, and keeps keys and values in bf16 (autocast's attention reads
them in bf16 anyway). The weights stay as they are. It runs under ``no_grad``,
not ``inference_mode``: there autocast casts every weight again at every
forward, and a decode step cost as much as in fp32; under ``no_grad`` each
weight that requires grad is cast once a ``generate`` call, and the bf16
copies (half the fp32 weights' bytes) live until the call ends; a frozen
weight (LoRA's base, ``trainable: top_k``'s lower layers) is cast at every
forward, so there decoding gains nothing, prefill still does. On a Zen 4 VM with ``avx512_bf16``,
make run's held-out evaluation (64 games, SmolLM2-135M after SFT) took 58-60 s
against 83-86 s in fp32: prefill 26-27 against 41-43 s, decode 29-30 against
38-40 s (``bench/sampler_precision.json``). Deterministic mode
computes in fp32: its batch invariance was measured there. Weights already in
bf16 or fp16 (``policy.dtype``) compute in their own dtype, as before.

Live requests (``RequestControl``): each sampled token is handed to the row's
``on_token`` as soon as its decode step ends, so a server streams while the
batch decodes; and a cancelled row finishes at the next decode step (reason
``cancelled``), so a reply nobody waits for stops costing the batch its steps.
"""

from __future__ import annotations

import contextlib
import inspect
import random
import threading
import warnings
from typing import Any

import numpy as np
import torch

from ..errors import PolicyError
from ..precision import check_precision, fp32_head
from .attention import avoid_cudnn_attention, use_gqa_sdpa
from .base import GenerateRequest, GenerateResult, RequestControl, SamplingParams, stop_string_hit
from .batching import MicroBatcher
from .constrain import ActionTrie, allowed_tensor, mask_logits
from .deterministic import (
    ALONE_TOKENS,
    STEP_ROWS,
    BoundaryCache,
    install_row_invariance,
    real_columns_cache,
    row_invariant,
)
from .kv_slab import KVSlab, kv_shape
from .prefix_cache import PrefixEntry, common_prefix

__all__ = ["HFPolicy", "check_weight_update", "sampling_logprobs"]


def check_weight_update(own: dict[str, Any], state_dict: dict[str, Any]) -> None:
    """Refuse, before anything is copied, a weight update that names a weight ``own`` (a model's
    ``state_dict``) lacks or gives one of another shape: ``load_state_dict(strict=False)`` would
    skip the first without a word (plain names given to a LoRA-wrapped model: none loads)."""
    unexpected = sorted(set(state_dict) - set(own))
    if unexpected:
        raise PolicyError(f"unexpected weight names: {unexpected[:5]}")
    wrong = [f"{k}: {tuple(v.shape)} for {tuple(own[k].shape)}" for k, v in state_dict.items()
             if tuple(v.shape) != tuple(own[k].shape)]
    if wrong:
        raise PolicyError(f"weight update has wrong shapes: {wrong[:5]}")


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


def prefill_groups(new_tokens: list[int], pad_tokens: int) -> list[tuple[int, int]]:
    """Split rows, sorted by new tokens (longest first), into ``[start, end)`` prefill groups.

    A row joins the current group when it would re-run at most ``pad_tokens``
    extra tokens there (the group's longest new part minus its own); else it
    starts a group, and so one more forward pass, which costs a read of every
    weight however few tokens it carries.
    """
    groups, start = [], 0
    for i in range(1, len(new_tokens) + 1):
        if i == len(new_tokens) or new_tokens[start] - new_tokens[i] > pad_tokens:
            groups.append((start, i))
            start = i
    return groups


def _gumbel_max_sample(logp: torch.Tensor, gens: list[torch.Generator]) -> torch.Tensor:
    """One token per row: ``argmax(logp + Gumbel noise)``, the noise from the row's own stream.

    The Gumbel-max trick (Gumbel 1954; Maddison et al. 2014, Sec. 2) samples
    exactly from ``softmax(logp)``. A stream per request keeps a request's
    sample independent of its batch. Why not inverse-CDF sampling with one
    uniform: a CDF summed over 49,152 tokens moves by more than the width of a
    tail token's interval when the logits move by float noise, so a prefix-cached
    and a fully prefilled run would pick different tail tokens; the argmax only
    flips when two perturbed scores are within that noise.
    """
    # Row by row: an elementwise op over [B, V] splits across threads at offsets that follow
    # B, and a tail the vector loop leaves goes through scalar log, whose last bit may differ.
    gumbel = [-torch.log(-torch.log(torch.rand(logp.shape[-1], generator=g, device=logp.device).clamp(min=1e-20)))
              for g in gens]
    return (logp + torch.stack(gumbel)).argmax(-1)


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """Entropy of each row's distribution, row by row (as ``_gumbel_max_sample``, for exp)."""
    out = []
    for row in logp:
        p = row.exp()
        out.append(-(p * row.masked_fill(p == 0, 0.0)).sum())
    return torch.stack(out)


class HFPolicy:
    """Sample from a transformers causal LM, many prompts at once.

    Requests in one ``generate`` call are grouped by identical sampling
    parameters (seeds aside: each request has its own stream) and run in
    batches of at most ``max_batch_size``. ``prefix_cache_mb`` bounds the
    keys and values kept across calls (0 turns prefix reuse off).
    ``deterministic`` makes each row's result independent of its batch (see the
    module docstring); it may be switched between calls. ``rollout.deterministic:
    null`` leaves it off: at 32 rows it cost +75% wall time (bench/engine_overhead).
    ``precision``: ``fp32`` or ``bf16`` (autocast, fp32 head, bf16 keys and values;
    see the module docstring), resolved already (``agentrl.precision``).
    """

    deterministic_by_default = False
    constrains_actions = True  # honours GenerateRequest.admissible

    def __init__(self, model: Any, tokenizer: Any, max_batch_size: int = 16,
                 prefix_cache_mb: int = 4096, prefill_pad_tokens: int = 32, deterministic: bool = False,
                 precision: str = "fp32"):
        check_precision(precision, "policy.precision")
        if precision == "auto":
            raise PolicyError("HFPolicy(precision='auto'): resolve it first (agentrl.precision.resolved_precision)")
        self.model = model.eval()
        self.precision = precision
        self._cached_dtype: torch.dtype | None = None  # the dtype of the prefix cache's keys and values
        self._call_bf16 = False  # whether the generate call under way samples under bf16 autocast
        self.prefill_pad_tokens = prefill_pad_tokens
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.deterministic = deterministic
        self.version = 0
        # generate and update_weights take it: a batch samples under one set of weights (a
        # rollout worker or a snapshot is loaded while its engine keeps sampling)
        self.weights_lock = threading.RLock()
        self.prefix_cache = BoundaryCache(prefix_cache_mb * 2**20) if prefix_cache_mb > 0 else None
        eos = tokenizer.eos_token_id
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        cfg_eos = getattr(model.generation_config, "eos_token_id", None)
        if cfg_eos is not None:
            self.eos_ids |= {cfg_eos} if isinstance(cfg_eos, int) else set(cfg_eos)
        # transformers 5 renamed `past_key_values` to `cache` (argument and output).
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        # the positions the model was built for (None: the config names none); see _limit
        self.max_positions: int | None = getattr(model.config, "max_position_embeddings", None)
        self._warned_positions = False
        try:
            kv_shape(model.config)
        except ValueError as e:  # sliding-window or hybrid attention: not supported by the slab yet
            raise PolicyError(f"{e}; use a full-attention model with the hf backend") from e
        use_gqa_sdpa(model)  # CPU: read grouped keys and values in place (see policy/attention.py)
        avoid_cudnn_attention(self.device)  # CUDA: cuDNN rebuilds its graphs at every decode step
        self.batcher = MicroBatcher(self.generate, name="agentrl-hf")
        self._tries: dict[tuple[str, ...], ActionTrie] = {}  # per action list: states recur

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def update_weights(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load new weights in place, bump ``version`` and drop the now stale prefix cache.

        Names and shapes are checked before anything is copied, so a rejected
        update changes nothing. Every weight must be given unless
        ``strict=False``; a weight tied to a given one (a tied LM head) counts
        as given.
        """
        own = self.model.state_dict()
        check_weight_update(own, state_dict)
        given = {own[k].data_ptr() for k in state_dict}
        missing = sorted(k for k in set(own) - set(state_dict) if own[k].data_ptr() not in given)
        if missing and strict:
            raise PolicyError(f"{len(missing)} weights missing from the update, e.g. {missing[:5]}; "
                              "pass strict=False for a partial update")
        with self.weights_lock:
            self.model.load_state_dict(state_dict, strict=False)
            self.weights_updated()

    def close(self) -> None:
        """Stop the batcher's thread and free the prefix cache: requests still to come fail
        their episodes at once. The model stays usable by whoever else holds it."""
        self.batcher.close()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def drop_prefix_cache(self) -> None:
        """Free the prefix cache's keys and values now, between batches. A trainer in this
        process calls it before it changes this model's weights: after that they are stale,
        and until then they only add to the update's peak memory."""
        with self.weights_lock:
            if self.prefix_cache is not None:
                self.prefix_cache.clear()

    def weights_updated(self) -> None:
        """The model's weights changed in place (a trainer in this process trains this very
        model): bump ``version`` and drop the prefix cache, whose keys and values are stale."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.version += 1

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        with self.weights_lock:
            deterministic = self.deterministic  # read once: an engine may switch it between calls
            # bf16 autocast over fp32 weights; weights already in bf16 or fp16 compute in their own dtype
            self._call_bf16 = self.precision == "bf16" and not deterministic and self.model.dtype == torch.float32
            with self._numerics():
                if self.prefix_cache is not None and self._cached_dtype not in (None, self._kv_dtype):
                    self.prefix_cache.clear()  # deterministic mode switched: its keys were computed otherwise
                self._cached_dtype = self._kv_dtype
                return self._generate_locked(requests, deterministic)

    @property
    def _kv_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self._call_bf16 else self.model.dtype

    @contextlib.contextmanager
    def _numerics(self) -> Any:
        """fp32: ``inference_mode``. bf16: autocast with the fp32 head, under ``no_grad`` so that
        autocast casts each weight once for the whole call (see the module docstring)."""
        if not self._call_bf16:
            with torch.inference_mode():
                yield
            return
        with torch.no_grad(), torch.autocast(self.device.type, dtype=torch.bfloat16), fp32_head(self.model):
            yield

    def _generate_locked(self, requests: list[GenerateRequest], deterministic: bool) -> list[GenerateResult]:
        results: list[GenerateResult | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            self._check_request(i, req)
            p = req.params
            # max_new_tokens and seed are per row: near a context budget, rows differ in room.
            key = (p.temperature, p.top_p, p.top_k, p.stop, p.stop_token_ids, p.logprobs)
            groups.setdefault(key, []).append(i)
        size = min(self.max_batch_size, STEP_ROWS) if deterministic else self.max_batch_size
        run = self._generate_rows if deterministic else self._generate_batch
        for idx in groups.values():
            for s in range(0, len(idx), size):
                chunk = idx[s:s + size]
                outs = run([requests[i] for i in chunk])
                for i, out in zip(chunk, outs, strict=True):
                    results[i] = out
        return results  # type: ignore[return-value]

    def _check_request(self, i: int, req: GenerateRequest) -> None:
        """Refuse, naming request ``i``, what the model cannot run: an empty prompt, a prompt id
        outside the vocabulary (torch's IndexError; on CUDA a device-side assert that fails every
        later call), or more top logprobs than the vocabulary has.

        A sequence past ``max_position_embeddings`` runs, with one warning: the context budget
        is the caller's (``rollout.max_context_tokens``, the proxy's), and a harness such as
        Codex sends a system prompt longer than SmolLM2's 8,192 positions. A RoPE model
        extrapolates there, worse; vLLM refuses unless ``max_model_len`` says otherwise."""
        if not req.prompt_ids:
            raise PolicyError(f"request {i} has an empty prompt")
        ids, vocab = np.asarray(req.prompt_ids), self.vocab_size
        if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= vocab:
            raise PolicyError(f"request {i} has prompt token ids outside the model's vocabulary [0, {vocab})")
        if req.params.logprobs > vocab:
            raise PolicyError(f"request {i}: logprobs={req.params.logprobs} is more than the vocabulary's {vocab} tokens")
        if (self.max_positions is not None and not self._warned_positions
                and len(ids) + self._limit(req) > self.max_positions):
            self._warned_positions = True
            warnings.warn(f"a sequence of up to {len(ids) + self._limit(req)} tokens runs past the "
                          f"{self.max_positions} positions this model was built for "
                          "(max_position_embeddings); its replies there may be worse", RuntimeWarning, stacklevel=3)

    def _limit(self, req: GenerateRequest) -> int:
        """How many tokens ``req`` may sample: ``max_new_tokens``, but never more than the
        model's whole context (a request for 10**12 tried to allocate keys and values for all
        of them, 128 TB)."""
        if self.max_positions is None:
            return req.params.max_new_tokens
        return min(req.params.max_new_tokens, self.max_positions)

    async def agenerate(self, request: GenerateRequest) -> GenerateResult:
        """One request; concurrent calls are gathered into one ``generate`` batch."""
        return await self.batcher.submit(request)

    def _constraint(self, request: GenerateRequest) -> tuple[ActionTrie, int] | None:
        """The request's action trie and its node after the reply's head; None: unconstrained."""
        if not request.admissible:
            return None
        key = tuple(request.admissible)
        trie = self._tries.get(key)
        if trie is None:
            if len(self._tries) >= 4096:
                self._tries.clear()
            trie = self._tries[key] = ActionTrie.of(self.tokenizer, key)
        head = request.prompt_ids[len(request.prompt_ids) - request.admissible_head:]
        node = trie.walk(head)
        if node is None:
            raise PolicyError(f"the reply's first {len(head)} tokens spell no admissible action")
        return trie, node

    def _match(self, prompt: list[int]) -> tuple[PrefixEntry | None, int]:
        if self.prefix_cache is None:
            return None, 0
        return self.prefix_cache.match(prompt)

    def _prefill(self, slab: KVSlab, prompts: list[list[int]], rows: tuple[int, int],
                 window: int) -> torch.Tensor:
        """Run the last ``window`` tokens of rows ``[start, end)`` into the slab; their last logits."""
        start, end = rows
        width, dev = slab.width, self.device
        input_ids = torch.full((end - start, window), self.pad_id, dtype=torch.long)
        attn = torch.zeros((end - start, width), dtype=torch.long)
        for r, p in enumerate(prompts[start:end]):
            tail = p[-window:]
            input_ids[r, window - len(tail):] = torch.tensor(tail)
            attn[r, width - len(p):] = 1
        pos = (torch.arange(window) - window)[None, :] + torch.tensor([len(p) for p in prompts[start:end]])[:, None]
        out = self.model(input_ids=input_ids.to(dev), attention_mask=attn.to(dev),
                         position_ids=pos.clamp(min=0).to(dev), use_cache=True, logits_to_keep=1,
                         **{self._cache_kw: slab.cache(slice(start, end), width - window)})
        return out.logits[:, -1, :]

    def _prefill_cost(self, news: list[int]) -> int:
        """Tokens the prefill groups of rows with ``news`` new tokens run, plus ``prefill_pad_tokens`` a forward."""
        news = sorted(news, reverse=True)
        groups = prefill_groups(news, self.prefill_pad_tokens)
        return sum((end - start) * news[start] for start, end in groups) + len(groups) * self.prefill_pad_tokens

    def _share_prefixes(self, prompts: list[list[int]], matches: list[tuple[PrefixEntry | None, int]]
                        ) -> list[tuple[list[int], int]]:
        """Prefill once what two or more rows share beyond the cache; ``[(rows, tokens it ran)]``.

        The branches of a tree node, or a group's episodes of one task, arrive in
        one batch with the same context: each would otherwise prefill it again.
        The shared prefix runs as a one-row batch into the prefix cache, and every
        row then matches it. It is done only when that runs fewer tokens in all
        than the prefill groups would without it, counting ``prefill_pad_tokens``
        for each forward pass (``_prefill_cost``), and only for a prefix whose
        keys and values fit the cache's budget. The caller charges the tokens it
        ran to the rows that share it, so they count once.
        """
        shared: list[tuple[list[int], int]] = []
        if self.prefix_cache is None or len(prompts) < 2:
            return shared
        ids = [np.asarray(p, dtype=np.int64) for p in prompts]
        rows_all = range(len(ids))
        # lcp[i][r]: tokens prompts i and r share, short of either's last token (always run).
        lcp = [[min(common_prefix(a, b), len(a) - 1, len(b) - 1) for b in ids] for a in ids]
        layers, heads, head_dim = kv_shape(self.model.config)
        token_bytes = 2 * layers * heads * head_dim * self._kv_dtype.itemsize
        room = self.prefix_cache.max_bytes  # every prefix shared in this batch must fit at once
        done: set[tuple[int, int]] = set()  # (first row, length): each prefix runs once, so the loop ends
        while True:
            now = [len(p) - m for p, (_, m) in zip(prompts, matches, strict=True)]
            base, tried = self._prefill_cost(now), set()
            best: tuple[int, list[int], int] | None = None  # (tokens run, rows, prefix length)
            for i in rows_all:
                for n in {lcp[i][j] for j in rows_all if j != i}:
                    rows = [r for r in rows_all if lcp[i][r] >= n and matches[r][1] < n]
                    if len(rows) < 2 or (rows[0], n) in tried or (rows[0], n) in done or n * token_bytes > room:
                        continue
                    tried.add((rows[0], n))
                    after = [len(prompts[r]) - n if r in rows else now[r] for r in rows_all]
                    cost = n - min(matches[r][1] for r in rows) + self.prefill_pad_tokens + self._prefill_cost(after)
                    if cost < base and (best is None or cost < best[0]):
                        best = (cost, rows, n)
            if best is None:
                return shared
            _, rows, n = best
            done.add((rows[0], n))
            room -= n * token_bytes  # else a second prefix could evict the first, which would come back
            first = min(rows, key=lambda r: matches[r][1])
            self._prefill_into_cache(prompts[first][:n], matches[first])
            shared.append((rows, n - matches[first][1]))
            matches[:] = [self._match(p) for p in prompts]

    @staticmethod
    def _charge_shared(shared: list[tuple[list[int], int]], cached: list[int], order: list[int]) -> int:
        """Count a shared prefix's tokens as prefilled by the rows sharing it, in place; those left over.

        Each row's ``cached`` (sorted order) shrinks by what it can give, down to
        0, until the prefix's tokens are charged; what no row can take (they
        re-ran their cached tokens anyway) is returned for the cache's stats.
        """
        where = {i: b for b, i in enumerate(order)}
        left = 0
        for rows, tokens in shared:
            for r in rows:
                take = min(tokens, cached[where[r]])
                cached[where[r]] -= take
                tokens -= take
            left += tokens
        return left

    def _prefill_into_cache(self, prefix: list[int], match: tuple[PrefixEntry | None, int]) -> None:
        """Run ``prefix`` (its cached part copied in) and keep its keys and values in the cache."""
        entry, cached = match
        slab = KVSlab(self.model.config, 1, len(prefix), 0, self._kv_dtype, self.device)
        slab.place(0, len(prefix), entry.kv if entry else None, cached)
        self._prefill(slab, [prefix], (0, 1), len(prefix) - cached)
        assert self.prefix_cache is not None
        self.prefix_cache.insert(prefix, slab.row(0, 0, len(prefix)), storage=slab, storage_bytes=slab.nbytes)

    @torch.no_grad()  # nests in generate's inference_mode or autocast (no_grad keeps its cast weights)
    def _generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        params, dev = requests[0].params, self.device
        matches = [self._match(r.prompt_ids) for r in requests]
        shared = self._share_prefixes([r.prompt_ids for r in requests], matches)
        # Rows with the most new tokens first, so prefill groups are contiguous row ranges.
        order = sorted(range(len(requests)), key=lambda i: matches[i][1] - len(requests[i].prompt_ids))
        prompts = [requests[i].prompt_ids for i in order]
        B, width, plen = len(order), max(map(len, prompts)), [len(p) for p in prompts]
        news = [plen[b] - matches[i][1] for b, i in enumerate(order)]
        limits = [self._limit(requests[i]) for i in order]
        slab = KVSlab(self.model.config, B, width, max(limits), self._kv_dtype, dev)
        logits, cached = [], [0] * B
        for start, end in prefill_groups(news, self.prefill_pad_tokens):
            window = news[start]
            for b in range(start, end):
                entry, _ = matches[order[b]]
                cached[b] = max(0, plen[b] - window)  # tokens before the window come from the cache
                slab.place(b, plen[b], entry.kv if entry else None, cached[b])
            logits.append(self._prefill(slab, prompts, (start, end), window))
        if self.prefix_cache is not None:
            unreported = self._charge_shared(shared, cached, order)
            self.prefix_cache.record(cached, plen, extra_prefilled=unreported)
        toks, lps, ents, tops, finish = self._decode(slab, torch.cat(logits), plen, limits,
                                                      [requests[i].params.seed for i in order], params,
                                                      [requests[i].control for i in order],
                                                      constraints=[self._constraint(requests[i]) for i in order])
        if self.prefix_cache is not None:  # each row's tokens, as views of the slab: no copy
            for b in range(B):
                self.prefix_cache.insert(prompts[b] + toks[b][:-1],
                                         slab.row(b, width - plen[b], width + len(toks[b]) - 1),
                                         storage=slab, storage_bytes=slab.nbytes)
        results: list[GenerateResult | None] = [None] * B
        for b, i in enumerate(order):
            results[i] = GenerateResult(toks[b], lps[b], ents[b], finish[b] or "length",  # type: ignore[arg-type]
                                        self.version, tops[b] if params.logprobs else None,
                                        cached_tokens=cached[b])
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def _generate_rows(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """``_generate_batch`` in deterministic mode: each row computed as it would be alone.

        Every prompt reuses cached keys and values up to a chunk boundary
        (``BoundaryCache.match_boundary``) and prefills the rest in one chunk:
        alone when it has ``ALONE_TOKENS`` new tokens or more, else in prefill
        groups whose shorter rows are padded (their padding writes nothing)
        instead of re-running cached tokens; every forward runs row-invariant.
        Rows with the same prompt and reuse are prefilled once and copied. Each
        row's cache entry keeps its boundaries: those it reused, the end of its
        prompt, and one per decoded token.
        """
        params, dev = requests[0].params, self.device
        install_row_invariance(self.model)
        cache = self.prefix_cache
        none = (None, 0, np.zeros(0, dtype=np.int64))
        matches = [cache.match_boundary(r.prompt_ids) if cache is not None else none for r in requests]
        seen: dict[tuple, int] = {}
        twin = [seen.setdefault((tuple(r.prompt_ids), m[1], id(m[0])), i)
                for i, (r, m) in enumerate(zip(requests, matches, strict=True))]
        run = [i for i in range(len(requests)) if twin[i] == i]
        # Rows with the most new tokens first, so prefill groups are contiguous row ranges; twins last.
        order = sorted(run, key=lambda i: matches[i][1] - len(requests[i].prompt_ids))
        order += [i for i in range(len(requests)) if twin[i] != i]
        prompts = [requests[i].prompt_ids for i in order]
        B, width, plen = len(order), max(map(len, prompts)), [len(p) for p in prompts]
        cached = [matches[i][1] for i in order]
        news = [plen[b] - cached[b] for b in range(len(run))]
        limits = [self._limit(requests[i]) for i in order]
        slab = KVSlab(self.model.config, B, width, max(limits), self._kv_dtype, dev)
        for b, i in enumerate(order):
            entry = matches[i][0]
            slab.place(b, plen[b], entry.kv if entry else None, cached[b])
        alone = sum(1 for n in news if n >= ALONE_TOKENS)  # sorted: the first rows
        groups = [(b, b + 1) for b in range(alone)]
        groups += [(alone + s, alone + e) for s, e in prefill_groups(news[alone:], self.prefill_pad_tokens)]
        logits = [self._prefill_rows(slab, prompts, (start, end), news[start:end], blocks=start >= alone)
                  for start, end in groups]
        rows = list(torch.cat(logits))
        where = {i: b for b, i in enumerate(order)}
        for b in range(len(run), B):  # the same computation as its twin's: copied
            src, cols = where[twin[order[b]]], slice(width - plen[b], width)
            for k, v in zip(slab.keys, slab.values, strict=True):
                k[b, :, cols] = k[src, :, cols]
                v[b, :, cols] = v[src, :, cols]
            rows.append(rows[src])
            cached[b] = plen[b]  # nothing prefilled for this row
        if cache is not None:
            cache.record(cached, plen)
        toks, lps, ents, tops, finish = self._decode(slab, torch.stack(rows), plen, limits,
                                                      [requests[i].params.seed for i in order], params,
                                                      [requests[i].control for i in order], invariant=True,
                                                      constraints=[self._constraint(requests[i]) for i in order])
        if cache is not None:
            for b, i in enumerate(order):
                bounds = np.concatenate([matches[i][2], np.arange(plen[b], plen[b] + len(toks[b]), dtype=np.int64)])
                cache.insert(prompts[b] + toks[b][:-1], slab.row(b, width - plen[b], width + len(toks[b]) - 1),
                             storage=slab, storage_bytes=slab.nbytes, bounds=bounds)
        results: list[GenerateResult | None] = [None] * B
        for b, i in enumerate(order):
            results[i] = GenerateResult(toks[b], lps[b], ents[b], finish[b] or "length",  # type: ignore[arg-type]
                                        self.version, tops[b] if params.logprobs else None,
                                        cached_tokens=cached[b])
        return results  # type: ignore[return-value]

    def _prefill_rows(self, slab: KVSlab, prompts: list[list[int]], rows: tuple[int, int],
                      real: list[int], blocks: bool) -> torch.Tensor:
        """Prefill the last ``real[r]`` tokens of each of rows ``[start, end)`` row-invariantly
        (``row_invariant``), in one forward padded to the longest (``real[0]``); their last logits."""
        start, end = rows
        width, dev, window = slab.width, self.device, real[0]
        input_ids = torch.full((end - start, window), self.pad_id, dtype=torch.long)
        attn = torch.zeros((end - start, width), dtype=torch.long)
        for r, p in enumerate(prompts[start:end]):
            input_ids[r, window - real[r]:] = torch.tensor(p[len(p) - real[r]:])
            attn[r, width - len(p):] = 1
        lens = torch.tensor([len(p) for p in prompts[start:end]])
        pos = ((torch.arange(window) - window)[None, :] + lens[:, None]).clamp(min=0)
        cache = real_columns_cache([k[start:end] for k in slab.keys], [v[start:end] for v in slab.values],
                                   width - window, real, window)
        with row_invariant((width - lens).tolist(), real, blocks):
            out = self.model(input_ids=input_ids.to(dev), attention_mask=attn.to(dev), position_ids=pos.to(dev),
                             use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[:, -1, :]

    def _decode(self, slab: KVSlab, logits: torch.Tensor, plen: list[int], limits: list[int],
                seeds: list[int | None], params: SamplingParams,
                controls: list[RequestControl | None], invariant: bool = False,
                constraints: list[tuple[ActionTrie, int] | None] | None = None) -> tuple:
        """Sample up to ``limits[b]`` tokens for row b, feeding each token back through the slab;
        row b's ``controls[b]`` sees each token, and ends the row when cancelled. ``invariant``:
        each step runs row-invariant (``row_invariant``). ``constraints[b]``: row b's action
        trie and node, whose allowed tokens mask its logits at each step."""
        B, dev, width = len(plen), self.device, slab.width
        gens = [torch.Generator(device=dev).manual_seed(s if s is not None else random.getrandbits(62))
                for s in seeds]
        stop_ids = self.eos_ids | set(params.stop_token_ids)
        attn = torch.zeros((B, width + max(limits)), dtype=torch.long, device=dev)
        for b, n in enumerate(plen):
            attn[b, width - n:width] = 1
        pos = torch.tensor(plen, device=dev)[:, None]
        cache = slab.cache(slice(None), width)
        toks: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        ents: list[list[float]] = [[] for _ in range(B)]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in range(B)]
        finish: list[str | None] = [None] * B
        nodes = [c[1] if c is not None else None for c in constraints or [None] * B]
        for step in range(max(limits)):
            if any(n is not None for n in nodes):  # masked before temperature, top-k and top-p
                allowed = [constraints[b][0].allowed(n) if n is not None else None  # type: ignore[index]
                           for b, n in enumerate(nodes)]
                logits = mask_logits(logits, allowed_tensor(allowed, logits.device))
            logp = sampling_logprobs(logits, params)
            nxt = logp.argmax(-1) if params.temperature == 0 else _gumbel_max_sample(logp, gens)
            # One device-to-host copy per tensor and step, not one per row and value.
            chosen = logp.gather(-1, nxt[:, None]).squeeze(-1).tolist()
            ent, ids = _entropy(logp).tolist(), nxt.tolist()
            top = torch.topk(logp, params.logprobs, dim=-1) if params.logprobs else None
            top_ids, top_lps = (top.indices.tolist(), top.values.tolist()) if top is not None else ([], [])
            for b in range(B):
                if finish[b] is not None:
                    continue
                t = ids[b]
                if nodes[b] is not None:
                    nodes[b] = constraints[b][0].child(nodes[b], t)  # type: ignore[index]
                toks[b].append(t)
                lps[b].append(chosen[b])
                ents[b].append(ent[b])
                if top is not None:
                    tops[b].append(list(zip(top_ids[b], top_lps[b], strict=True)))
                ctl = controls[b]
                if ctl is not None and ctl.on_token is not None:
                    ctl.on_token(t)
                if t in stop_ids:
                    finish[b] = "stop"
                elif stop_string_hit(self.tokenizer, toks[b], params.stop):
                    finish[b] = "stop_string"
                elif len(toks[b]) == limits[b]:
                    finish[b] = "length"
                elif ctl is not None and ctl.cancelled:
                    finish[b] = "cancelled"
            if all(f is not None for f in finish):
                break
            live = torch.tensor([f is None for f in finish], device=dev)
            attn[:, width + step] = live.to(attn.dtype)
            with row_invariant([width - n for n in plen]) if invariant else contextlib.nullcontext():
                out = self.model(input_ids=torch.where(live, nxt, self.pad_id)[:, None],
                                 attention_mask=attn[:, :width + step + 1], position_ids=pos + step,
                                 use_cache=True, **{self._cache_kw: cache})
            logits = out.logits[:, -1, :]
        return toks, lps, ents, tops, finish
