"""Prefix reuse: the cache matches longest prefixes and evicts by bytes, and HFPolicy
with reuse samples exactly what a full prefill samples."""

from __future__ import annotations

import pytest
import torch

from agentrl.chat import ChatContext
from agentrl.policy import GenerateRequest, HFPolicy, SamplingParams
from agentrl.policy.base import request_seed
from agentrl.policy.hf import prefill_groups
from agentrl.policy.prefix_cache import PrefixCache


def _kv(n_tokens: int, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # 1 head x n tokens x 4 dims of float32: 16 bytes a token per tensor
    return [(torch.zeros(1, n_tokens, 4), torch.zeros(1, n_tokens, 4)) for _ in range(layers)]


def test_match_takes_the_longest_common_prefix_and_leaves_the_last_token():
    cache = PrefixCache(max_bytes=10**6)
    cache.insert([1, 2, 3, 4], _kv(4))
    cache.insert([1, 2, 9], _kv(3))
    entry, n = cache.match([1, 2, 3, 4, 5, 6])
    assert n == 4 and entry.ids.tolist() == [1, 2, 3, 4]
    entry, n = cache.match([1, 2, 9, 7])  # diverges from both; the second shares 3
    assert n == 3 and entry.ids.tolist() == [1, 2, 9]
    entry, n = cache.match([1, 2, 3, 4])  # whole prompt cached: the last token is still run
    assert n == 3
    entry, n = cache.match([7, 1, 2])
    assert entry is None and n == 0
    cache.record([4, 3, 0], [6, 4, 3])
    s = cache.stats
    assert (s.hits, s.misses, s.reused_tokens, s.prefilled_tokens) == (2, 1, 7, 6)


def test_an_entry_that_a_new_one_extends_is_dropped():
    cache = PrefixCache(max_bytes=10**6)
    cache.insert([1, 2, 3], _kv(3))
    cache.insert([1, 2, 3, 4, 5], _kv(5))  # the same episode one turn later
    assert len(cache) == 1
    entry, n = cache.match([1, 2, 3, 9])  # a branch from the earlier turn is still served
    assert n == 3 and entry.ids.tolist() == [1, 2, 3, 4, 5]
    cache.insert([1, 2, 7], _kv(3))  # a sibling extends only part: both stay
    assert len(cache) == 2


def test_eviction_is_least_recently_used_under_the_byte_budget():
    per_token = 2 * 2 * 16  # two layers, keys and values, 16 bytes each
    cache = PrefixCache(max_bytes=10 * per_token)
    cache.insert([1, 1, 1, 1], _kv(4))
    cache.insert([2, 2, 2, 2], _kv(4))
    cache.match([1, 1, 1, 1, 5])  # touches the first: the second is now least recent
    cache.insert([3, 3, 3, 3], _kv(4))
    assert cache.stats.evictions == 1 and len(cache) == 2
    assert cache.match([2, 2, 2, 2, 5])[0] is None
    assert cache.match([1, 1, 1, 1, 5])[1] == 4
    assert cache.stats.bytes == 8 * per_token <= cache.max_bytes
    cache.insert([9] * 11, _kv(11))  # larger than the whole budget: not stored, nothing evicted
    assert len(cache) == 2


def test_views_are_charged_for_their_whole_buffer_once():
    buffer = torch.zeros(2, 1, 100, 4)  # a batch of 2 rows, 100 columns: 3,200 bytes
    cache = PrefixCache(max_bytes=5000)
    for row, ids in enumerate(([1, 2, 3], [4, 5, 6])):
        cache.insert(ids, [(buffer[row, :, :3], buffer[row, :, :3])], storage=buffer, storage_bytes=3200)
    assert cache.stats.bytes == 3200  # two small views, one buffer
    other = torch.zeros(2, 1, 100, 4)
    cache.insert([7, 8], [(other[0, :, :2], other[0, :, :2])], storage=other, storage_bytes=3200)
    # The new buffer pushed the total over the budget: the old buffer's entries go, all of them.
    assert cache.stats.bytes == 3200 and len(cache) == 1 and cache.stats.evictions == 2


def test_hf_cache_bytes_count_the_slabs_it_keeps(tokenizer, tiny_model):
    policy = HFPolicy(tiny_model, tokenizer)
    prompts = [list(c.ids) for c in _conversations(tokenizer, 4)]
    first = policy.generate([GenerateRequest(p, SamplingParams(max_new_tokens=50)) for p in prompts])
    slab_bytes = policy.prefix_cache.stats.bytes
    k = tiny_model.config
    per_column = 2 * k.num_hidden_layers * k.num_key_value_heads * (k.hidden_size // k.num_attention_heads) * 4
    assert slab_bytes == 4 * (max(map(len, prompts)) + 50) * per_column
    # The next turn extends every row: the first slab is released, only the second is held.
    second = [p + r.token_ids + [11, 12] for p, r in zip(prompts, first, strict=True)]
    policy.generate([GenerateRequest(p, SamplingParams(max_new_tokens=3)) for p in second])
    assert len(policy.prefix_cache) == 4
    assert policy.prefix_cache.stats.bytes == 4 * (max(map(len, second)) + 3) * per_column


def _conversations(tokenizer, n: int) -> list[ChatContext]:
    return [ChatContext(tokenizer, [{"role": "system", "content": "You play a game."},
                                    {"role": "user", "content": f"Room {i}: " + "a chair, " * (3 * i)}])
            for i in range(n)]


def _common_start(prompts: list[list[int]]) -> int:
    n = 0
    while all(len(p) > n and p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n


def _play(policy, tokenizer, turns: int, n: int = 3, temperature: float = 1.0):
    """Multi-turn episodes in lockstep; observations of different lengths per episode."""
    ctxs = _conversations(tokenizer, n)
    log = []
    for turn in range(turns):
        reqs = [GenerateRequest(list(c.ids), SamplingParams(max_new_tokens=6, temperature=temperature,
                                                            seed=request_seed(0, i, turn)))
                for i, c in enumerate(ctxs)]
        results = policy.generate(reqs)
        log.append(results)
        for i, (c, r) in enumerate(zip(ctxs, results, strict=True)):
            c.append_action(r.token_ids, r.logprobs)
            c.append_observation([{"role": "user", "content": "You see " + "a lamp, " * (i + turn)}])
    return log, ctxs


def test_prefix_reuse_samples_what_a_full_prefill_samples(tokenizer, tiny_model):
    reuse = HFPolicy(tiny_model, tokenizer)
    full = HFPolicy(tiny_model, tokenizer, prefix_cache_mb=0)
    for temperature in (1.0, 0.0):
        got, ctxs = _play(reuse, tokenizer, turns=4, temperature=temperature)
        want, _ = _play(full, tokenizer, turns=4, temperature=temperature)
        for g_turn, w_turn in zip(got, want, strict=True):
            for g, w in zip(g_turn, w_turn, strict=True):
                assert g.token_ids == w.token_ids
                assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4)
                assert torch.allclose(torch.tensor(g.entropies), torch.tensor(w.entropies), atol=1e-3)
        assert all(r.cached_tokens == 0 for r in want[1])
        reuse.prefix_cache.clear()


def test_later_turns_prefill_only_their_new_tokens(tokenizer, tiny_model):
    policy = HFPolicy(tiny_model, tokenizer, prefill_pad_tokens=0)  # no re-run tokens: exact counts
    prompt_lens, action_lens = [], []
    ctxs = _conversations(tokenizer, 3)
    common = _common_start([list(c.ids) for c in ctxs])  # their system prompt: prefilled once
    for turn in range(3):
        prompt_lens.append([len(c) for c in ctxs])
        results = policy.generate([GenerateRequest(list(c.ids), SamplingParams(max_new_tokens=5, seed=turn))
                                   for c in ctxs])
        for i, (c, r) in enumerate(zip(ctxs, results, strict=True)):
            if turn == 0:
                assert r.cached_tokens == (0 if i == 0 else common)
            else:
                # The previous prompt and action are cached, except the action's last
                # token, which was sampled but never fed to the model.
                assert r.cached_tokens == prompt_lens[turn - 1][i] + action_lens[turn - 1][i] - 1
            c.append_action(r.token_ids, r.logprobs)
            c.append_observation([{"role": "user", "content": "You see " + "a lamp, " * (i + turn)}])
        action_lens.append([len(r.token_ids) for r in results])
    s = policy.prefix_cache.stats
    assert (s.hits, s.misses) == (8, 1)
    # Prefilled tokens are the sum of the context deltas, not of the contexts.
    assert s.prefilled_tokens + s.reused_tokens == sum(map(sum, prompt_lens))
    deltas = sum(prompt_lens[0]) + sum(
        prompt_lens[t][i] - prompt_lens[t - 1][i] - action_lens[t - 1][i] + 1  # + the unfed last token
        for t in (1, 2) for i in range(3))
    assert s.prefilled_tokens == deltas - 2 * common


def test_branches_share_their_common_prefix(tokenizer, tiny_model):
    policy = HFPolicy(tiny_model, tokenizer)
    ctx = _conversations(tokenizer, 1)[0]
    first = policy.generate([GenerateRequest(list(ctx.ids), SamplingParams(max_new_tokens=4, seed=1))])[0]
    assert first.cached_tokens == 0
    # Two branches from the same node: same context, different seeds.
    reqs = [GenerateRequest(list(ctx.ids), SamplingParams(max_new_tokens=4, seed=s)) for s in (2, 3)]
    branches = policy.generate(reqs)
    assert [b.cached_tokens for b in branches] == [len(ctx.ids) - 1] * 2
    # A sibling continuing the first branch shares the context plus its own action.
    child = list(ctx.ids) + branches[0].token_ids + [11, 12]
    res = policy.generate([GenerateRequest(child, SamplingParams(max_new_tokens=2, seed=4))])[0]
    assert res.cached_tokens == len(ctx.ids) + len(branches[0].token_ids) - 1


def test_prefill_groups_split_where_padding_would_cost_more_than_a_forward():
    assert prefill_groups([100, 90, 70, 10, 5], pad_tokens=30) == [(0, 3), (3, 5)]
    assert prefill_groups([100, 90, 70, 10, 5], pad_tokens=0) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert prefill_groups([100, 90, 70, 10, 5], pad_tokens=1000) == [(0, 5)]
    assert prefill_groups([7], pad_tokens=0) == [(0, 1)]
    assert prefill_groups([4, 4, 4], pad_tokens=0) == [(0, 3)]


def test_grouped_rows_rerun_cached_tokens_but_sample_the_same(tokenizer, tiny_model):
    grouped = HFPolicy(tiny_model, tokenizer, prefill_pad_tokens=1000)  # one forward per turn
    exact = HFPolicy(tiny_model, tokenizer, prefill_pad_tokens=0)
    got, _ = _play(grouped, tokenizer, turns=3)
    want, _ = _play(exact, tokenizer, turns=3)
    for g_turn, w_turn in zip(got, want, strict=True):
        assert [g.token_ids for g in g_turn] == [w.token_ids for w in w_turn]
    g, w = grouped.prefix_cache.stats, exact.prefix_cache.stats
    assert g.reused_tokens + g.prefilled_tokens == w.reused_tokens + w.prefilled_tokens
    assert g.prefilled_tokens > w.prefilled_tokens  # the shorter rows re-ran some cached tokens


def test_prefix_reuse_samples_what_a_full_prefill_samples_on_the_135m_model(tokenizer):
    """The same check on SmolLM2-135M: 3 conversations x 3 turns, sampled at temperature 1."""
    from agentrl.models import load_model

    torch.set_num_threads(2)
    model, _ = load_model("smollm2-135m")
    reuse = HFPolicy(model, tokenizer)
    full = HFPolicy(model, tokenizer, prefix_cache_mb=0)
    got, _ = _play(reuse, tokenizer, turns=3, temperature=1.0)
    want, _ = _play(full, tokenizer, turns=3, temperature=1.0)
    assert sum(r.cached_tokens for r in got[-1]) > 0  # the later turns really came from the cache
    for g_turn, w_turn in zip(got, want, strict=True):
        for g, w in zip(g_turn, w_turn, strict=True):
            assert g.token_ids == w.token_ids
            assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4)


def test_rows_of_one_batch_prefill_their_shared_context_once(tokenizer, tiny_model):
    """Four branches of one node arrive together: the node's context runs once, not four times,
    and they sample what a policy without any prefix reuse samples."""
    ctx = list(_conversations(tokenizer, 1)[0].ids)
    reqs = [GenerateRequest(ctx, SamplingParams(max_new_tokens=5, seed=s)) for s in range(4)]
    shared = HFPolicy(tiny_model, tokenizer)
    got = shared.generate(reqs)
    want = HFPolicy(tiny_model, tokenizer, prefix_cache_mb=0).generate(reqs)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4)
    # One row prefilled the context; the other three ran only their last token.
    assert sorted(r.cached_tokens for r in got) == [0] + [len(ctx) - 1] * 3
    assert shared.prefix_cache.stats.prefilled_tokens == len(ctx) + 3


def test_a_group_of_tasks_with_a_common_system_prompt_prefills_it_once(tokenizer, tiny_model):
    ctxs = [list(c.ids) for c in _conversations(tokenizer, 3)]
    common = _common_start(ctxs)
    assert common > 5  # the system prompt and the start of the user turn
    policy = HFPolicy(tiny_model, tokenizer, prefill_pad_tokens=0)
    got = policy.generate([GenerateRequest(c, SamplingParams(max_new_tokens=3, seed=1)) for c in ctxs])
    assert policy.prefix_cache.stats.prefilled_tokens == sum(map(len, ctxs)) - 2 * common
    assert sorted(r.cached_tokens for r in got) == [0, common, common]
    # Turned off below its price: a forward pass costs more than the tokens it would save.
    dear = HFPolicy(tiny_model, tokenizer, prefill_pad_tokens=10_000)
    dear.generate([GenerateRequest(c, SamplingParams(max_new_tokens=3, seed=1)) for c in ctxs])
    assert dear.prefix_cache.stats.prefilled_tokens == sum(map(len, ctxs))


def _count_prefill(policy: HFPolicy) -> list[int]:
    """[tokens run, forward passes] through ``policy._prefill`` from now on."""
    ran, orig = [0, 0], policy._prefill

    def spy(slab, prompts, rows, window):
        ran[0] += (rows[1] - rows[0]) * window
        ran[1] += 1
        return orig(slab, prompts, rows, window)

    policy._prefill = spy
    return ran


def test_a_shared_prefix_the_cache_cannot_hold_is_prefilled_once_and_not_again(tokenizer, tiny_model):
    from agentrl.policy.kv_slab import kv_shape

    layers, heads, dim = kv_shape(tiny_model.config)
    policy = HFPolicy(tiny_model, tokenizer, prefill_pad_tokens=0)
    policy.prefix_cache.max_bytes = 30 * 2 * layers * heads * dim * 4  # 30 tokens; the shared part is 60
    ran = _count_prefill(policy)
    reqs = [GenerateRequest(list(range(100, 160)) + [i], SamplingParams(max_new_tokens=2, seed=i)) for i in range(3)]
    got = policy.generate(reqs)  # once hung: an insert the budget refused was retried forever
    want = HFPolicy(tiny_model, tokenizer, prefix_cache_mb=0).generate(reqs)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert ran[0] == 3 * 61  # nothing was shared: each row ran its own prompt
    assert policy.prefix_cache.stats.prefilled_tokens == ran[0]


def test_sharing_is_skipped_when_the_prefill_groups_rerun_the_prefix_anyway(tokenizer, tiny_model):
    """Two rows share 40 tokens; a third, unrelated row of 30 puts all three in one 41-token-wide
    group. Prefilling the 40 first would run more tokens in all, so it is not done, and the
    counted prefill equals what really ran."""
    stem = list(range(100, 140))
    reqs = [GenerateRequest(stem + [7], SamplingParams(max_new_tokens=1, seed=0)),
            GenerateRequest(stem + [8], SamplingParams(max_new_tokens=1, seed=1)),
            GenerateRequest(list(range(500, 530)), SamplingParams(max_new_tokens=1, seed=2))]
    policy = HFPolicy(tiny_model, tokenizer)  # prefill_pad_tokens=32
    ran = _count_prefill(policy)
    policy.generate(reqs)
    assert ran == [3 * 41, 1]
    assert policy.prefix_cache.stats.prefilled_tokens == 41 + 41 + 30  # the third row's pad is not a token


def test_two_shared_prefixes_that_do_not_fit_together_are_not_swapped_forever(tokenizer, tiny_model):
    """Each 40-token stem fits the 45-token budget, both do not: once hung, each evicting the other."""
    from agentrl.policy.kv_slab import kv_shape

    layers, heads, dim = kv_shape(tiny_model.config)
    policy = HFPolicy(tiny_model, tokenizer, prefill_pad_tokens=0)
    policy.prefix_cache.max_bytes = 45 * 2 * layers * heads * dim * 4
    ran = _count_prefill(policy)
    a, b = list(range(100, 140)), list(range(300, 340))
    reqs = [GenerateRequest(stem + [i], SamplingParams(max_new_tokens=1, seed=i))
            for i, stem in enumerate([a, a, b, b])]
    got = policy.generate(reqs)
    want = HFPolicy(tiny_model, tokenizer, prefix_cache_mb=0).generate(reqs)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert ran[0] == (40 + 1 + 1) + (41 + 41)  # one stem shared, then its rows' last tokens; the other not
    assert policy.prefix_cache.stats.prefilled_tokens == ran[0]


def test_a_bounded_entry_keeps_its_boundaries_when_it_takes_a_dropped_entrys_id():
    """Deterministic mode after a free call: the two free entries the new one extends are dropped,
    and the new entry may be allocated at a freed one's address (the same ``id``); its
    boundaries were looked up by the ids new since before the insert, so they were lost
    and the next turn reused nothing."""
    import numpy as np

    from agentrl.policy.deterministic import BoundaryCache

    cache = BoundaryCache(max_bytes=10**6)
    cache.insert([1, 2], _kv(2))  # no boundaries: a call outside deterministic mode
    cache.insert([1], _kv(1))
    cache.insert([1, 2, 3], _kv(3), bounds=np.array([2, 3]))
    assert len(cache) == 1
    entry, reuse, bounds = cache.match_boundary([1, 2, 3, 4])
    assert reuse == 3 and bounds.tolist() == [2, 3] and entry.ids.tolist() == [1, 2, 3]


def test_a_shared_buffer_without_its_size_is_refused():
    """Views of a buffer charged 0 bytes would let the cache keep buffers past any budget."""
    from agentrl.errors import PolicyError

    cache = PrefixCache(max_bytes=100)
    buffer = _kv(1000)
    for bad in (0, -5):
        with pytest.raises(PolicyError, match=f"storage_bytes={bad}"):
            cache.insert([1, 2], [(k[:, :2], v[:, :2]) for k, v in buffer], storage=buffer, storage_bytes=bad)
    assert len(cache) == 0 and cache.stats.bytes == 0
