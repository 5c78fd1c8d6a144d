"""token_logprobs on rows, packed rows and prefix trees, checked against plain forwards of the tiny model."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from agentrl.train.logprobs import token_logprobs
from agentrl.train.rows import (
    block_causal_mask,
    collate_packed,
    pack_sequences,
    prefix_tree,
    tree_attention_mask,
    tree_token_savings,
)

VOCAB = 49152


def _seqs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _reference(model, seq):
    """Per-token logprobs of one sequence from a plain forward: log_softmax(logits[t-1])[seq[t]]."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], -1)
    out = torch.zeros(len(seq))
    out[1:] = logp.gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1)
    ent = torch.zeros(len(seq))
    ent[1:] = -(logp.exp() * logp).sum(-1)
    return out, ent


def _head_shapes(model) -> tuple[list[tuple[int, ...]], object]:
    """The logits shape of each call of the model's vocabulary head from now on, and the hook's handle."""
    shapes: list[tuple[int, ...]] = []
    handle = model.get_output_embeddings().register_forward_hook(
        lambda _m, _args, out: shapes.append(tuple(out.shape)))
    return shapes, handle


# --------------------------------------------------------------------------- rows


def test_row_logprobs_match_log_softmax_and_first_token_is_zero(tiny_model):
    seq = _seqs([9])[0]
    with torch.no_grad():
        lp, ent = token_logprobs(tiny_model, torch.tensor([seq]))
    ref, ref_ent = _reference(tiny_model, seq)
    assert lp[0, 0] == 0 and ent[0, 0] == 0
    assert torch.allclose(lp[0], ref, atol=1e-5)
    assert torch.allclose(ent[0], ref_ent, atol=1e-4)


def test_temperature_divides_the_logits(tiny_model):
    seq = _seqs([6])[0]
    with torch.no_grad():
        lp, _ = token_logprobs(tiny_model, torch.tensor([seq]), temperature=0.5)
        logits = tiny_model(input_ids=torch.tensor([seq])).logits[0, :-1].float()
    ref = torch.log_softmax(logits / 0.5, -1).gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1)
    assert torch.allclose(lp[0, 1:], ref, atol=1e-5)


def test_only_kept_positions_go_through_the_vocab_head(tiny_model):
    seq = _seqs([10])[0]
    keep = torch.zeros(1, 10, dtype=torch.bool)
    keep[0, 6:] = True  # the last 4 tokens: their sources are positions 5..8
    shapes, hook = _head_shapes(tiny_model)
    with torch.no_grad():
        lp, _ = token_logprobs(tiny_model, torch.tensor([seq]), positions_to_keep=keep)
    hook.remove()
    assert shapes == [(4, VOCAB)]
    ref, _ = _reference(tiny_model, seq)
    assert torch.allclose(lp[0, 6:], ref[6:], atol=1e-5)
    assert (lp[0, :6] == 0).all()


def test_chunked_gradients_equal_unchunked(tiny_model):
    seq = torch.tensor([_seqs([8])[0]])
    grads = []
    for chunk in (1, 1024):
        tiny_model.zero_grad()
        lp, ent = token_logprobs(tiny_model, seq, chunk_size=chunk)
        (lp.sum() + 0.1 * ent.sum()).backward()
        grads.append([tiny_model.model.layers[0].mlp.up_proj.weight.grad.clone(),
                      tiny_model.get_output_embeddings().weight.grad.clone()])  # the head: a chunk at a time
    tiny_model.zero_grad()
    (body, head), (body_whole, head_whole) = grads
    assert body.abs().sum() > 0 and head.abs().sum() > 0
    assert torch.allclose(body, body_whole, atol=1e-6)
    # the head's gradient sums its chunks' products: fp32 rounding of a different order (measured 3e-6)
    assert (head - head_whole).abs().max() <= 1e-5 * head_whole.abs().max()


def test_left_padding_gives_the_unpadded_logprobs(tiny_model):
    short, long = _seqs([5, 7])
    ids = torch.tensor([[2, 2] + short, long])
    mask = torch.tensor([[0, 0] + [1] * 5, [1] * 7])
    with torch.no_grad():
        lp, _ = token_logprobs(tiny_model, ids, mask)
    assert (lp[0, :3] == 0).all()  # pads, and the first real token
    assert torch.allclose(lp[0, 2:], _reference(tiny_model, short)[0], atol=1e-5)
    assert torch.allclose(lp[1], _reference(tiny_model, long)[0], atol=1e-5)


def test_a_model_that_rescales_its_logits_is_refused(tiny_model):
    """token_scores applies the head to hidden states itself, so a soft-capped head would be scored wrongly."""
    model = copy.deepcopy(tiny_model)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        token_logprobs(model, torch.tensor([[5, 6, 7]]))


def test_bad_inputs_name_the_parameter(tiny_model):
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(tiny_model, ids, temperature=0.0)
    with pytest.raises(ValueError, match="boolean"):
        token_logprobs(tiny_model, ids, torch.ones(1, 1, 3, 3), position_ids=torch.arange(3)[None])
    with pytest.raises(ValueError, match="position_ids"):
        token_logprobs(tiny_model, ids, torch.ones(1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="parents"):
        token_logprobs(tiny_model, ids, parents=torch.tensor([[-1, 0, 3]]))


# --------------------------------------------------------------------------- packing


def test_pack_sequences_first_fit_decreasing():
    seqs = [[1] * 3, [2] * 5, [3] * 2, [4] * 4]
    rows = pack_sequences(seqs, max_len=6)
    # 5 opens row 0; 4 opens row 1; 3 fits neither (8, 7 > 6) and opens row 2; 2 joins row 1.
    assert [r.seq_index for r in rows] == [[1], [3, 2], [0]]
    assert rows[1].spans == [(0, 4), (4, 6)]
    assert rows[1].position_ids == [0, 1, 2, 3, 0, 1]
    assert rows[1].input_ids == [4, 4, 4, 4, 3, 3]
    with pytest.raises(ValueError, match="max_len"):
        pack_sequences([[1] * 7], max_len=6)


def test_block_causal_mask_hand_case():
    mask = block_causal_mask(torch.tensor([[0, 1, 2, 0, 1]]))
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert mask.shape == (1, 1, 5, 5)
    assert torch.equal(mask[0, 0], expected)


@pytest.fixture(params=["sdpa", "eager"])
def model_with_attention(request, tiny_model):
    """The tiny model with each attention kernel that takes a 4D mask (a copy for eager)."""
    if request.param == "sdpa":
        return tiny_model
    model = copy.deepcopy(tiny_model)
    model.set_attn_implementation("eager")
    return model


def test_packed_forward_equals_separate_forwards(model_with_attention):
    tiny_model = model_with_attention
    seqs = _seqs([7, 5, 9, 4], seed=1)
    rows = pack_sequences(seqs, max_len=16)
    assert len(rows) == 2  # 9+7 and 5+4 (+ padding)
    ids, pos, mask = collate_packed(rows, pad_id=2)
    with torch.no_grad():
        lp, ent = token_logprobs(tiny_model, ids, mask, position_ids=pos)
    for r, row in enumerate(rows):
        for (start, end), i in zip(row.spans, row.seq_index, strict=True):
            ref, ref_ent = _reference(tiny_model, seqs[i])
            assert torch.allclose(lp[r, start:end], ref, atol=1e-5), f"sequence {i}"
            assert torch.allclose(ent[r, start:end], ref_ent, atol=1e-4)
    assert (lp[1, 9:] == 0).all()  # padding


# --------------------------------------------------------------------------- trees


def test_tree_attention_mask_hand_case():
    #   0 ─ 1 ─ 2
    #   │     └ 3
    #   └ 4
    mask, depth = tree_attention_mask([-1, 0, 1, 1, 0])
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)
    assert depth.tolist() == [0, 1, 2, 2, 1]
    with pytest.raises(ValueError, match="earlier index"):
        tree_attention_mask([-1, 2, 0])


def test_prefix_tree_and_savings_hand_case():
    seqs = [[1, 2, 3], [1, 2, 4], [1, 5]]
    tree = prefix_tree(seqs)
    assert tree.input_ids == [1, 2, 3, 4, 5]
    assert tree.parents == [-1, 0, 1, 1, 0]
    assert tree.index == [[0, 1, 2], [0, 1, 3], [0, 4]]
    assert tree_token_savings(seqs) == 8 - 5
    prompt = list(range(60))
    assert tree_token_savings([prompt + [100] * 40, prompt + [200] * 40]) == 60


def test_tree_forward_equals_separate_forwards(model_with_attention):
    tiny_model = model_with_attention
    trunk, tail_a, tail_b, tail_c = _seqs([8, 3, 4, 3], seed=2)
    seqs = [trunk + tail_a, trunk + tail_b, trunk[:3] + tail_c]
    tree = prefix_tree(seqs)
    assert len(tree.input_ids) == 8 + 3 + 4 + 3
    mask, depth = tree_attention_mask(tree.parents)
    ids, parents = torch.tensor([tree.input_ids]), torch.tensor([tree.parents])
    with torch.no_grad():
        lp, _ = token_logprobs(tiny_model, ids, mask[None, None], position_ids=depth[None],
                               parents=parents)
        n = len(tree.input_ids)  # a plain causal mask over the same row must not match
        wrong, _ = token_logprobs(tiny_model, ids, torch.ones(n, n, dtype=torch.bool).tril()[None, None],
                                  position_ids=depth[None], parents=parents)
    for s, index in zip(seqs, tree.index, strict=True):
        ref, _ = _reference(tiny_model, s)
        assert torch.allclose(lp[0, index], ref, atol=1e-5)
    assert not torch.allclose(wrong[0, tree.index[2]], _reference(tiny_model, seqs[2])[0], atol=1e-3)


def test_packed_rows_run_under_bf16_autocast(tiny_model):
    """Under bf16 autocast (the trainer's GPU setting) packed rows still run; logprobs come back in float32."""
    seqs = _seqs([5, 4], seed=3)
    ids, pos, mask = collate_packed(pack_sequences(seqs, max_len=9), pad_id=2)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = token_logprobs(tiny_model, ids, mask, position_ids=pos)
    assert lp.dtype == torch.float32
    assert torch.allclose(lp[0, :5], _reference(tiny_model, seqs[0])[0], atol=0.1)


def test_flash_attention_refuses_a_dense_mask(tiny_model):
    class _Config:
        _attn_implementation = "flash_attention_2"

    class _Flash:
        config = _Config()

        def parameters(self):
            return tiny_model.parameters()

    with pytest.raises(ValueError, match="sdpa"):
        token_logprobs(_Flash(), torch.tensor([[5, 6]]), torch.ones(1, 1, 2, 2, dtype=torch.bool),
                       position_ids=torch.tensor([[0, 1]]))


# --- _ChunkScores: the update's log-softmax, entropy and gather with their gradient written out ---


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("constrained", [False, True])
def test_the_written_out_gradient_equals_autograd_through_the_log_softmax(temperature, constrained):
    from agentrl.train.logprobs import _ChunkScores, _gather_logprobs

    torch.manual_seed(0)
    n, vocab = 5, 11
    logits = (torch.randn(n, vocab, dtype=torch.float64) * 3).requires_grad_()
    wanted = torch.tensor([[0, 3], [4, 4], [10, 1], [2, 7], [5, 0]])  # the target, then a candidate
    allowed = None
    if constrained:  # row 2 is free (no id), the others may only say a few tokens, the targets among them
        allowed = torch.tensor([[0, 3, 6], [4, 1, -1], [-1, -1, -1], [2, 7, 9], [5, 0, -1]])
    g_up, h_up = torch.randn(n, 2, dtype=torch.float64), torch.randn(n, dtype=torch.float64)

    want_g, want_h = _gather_logprobs(logits, wanted, temperature, 0, allowed)
    (want_g * g_up).sum().add((want_h * h_up).sum()).backward()
    want_grad, logits.grad = logits.grad.clone(), None

    got_g, got_h = _ChunkScores.apply(logits, wanted, temperature, allowed)
    assert torch.equal(got_g, want_g) and torch.equal(got_h, want_h)  # the very same forward
    (got_g * g_up).sum().add((got_h * h_up).sum()).backward()
    assert torch.isfinite(logits.grad).all()
    assert torch.allclose(logits.grad, want_grad, atol=1e-12), (logits.grad - want_grad).abs().max()
    if constrained:  # a token the constraint forbids gets no gradient at all
        assert logits.grad[0, 1] == 0 and logits.grad[1, 0] == 0


def test_hand_case_gradient_of_one_logprob_is_onehot_minus_softmax():
    """d log p_w / d z = onehot(w) - p: for z = (0, log 3), p = (1/4, 3/4), w = 0 the gradient is (3/4, -3/4)."""
    from agentrl.train.logprobs import _ChunkScores

    z = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64, requires_grad=True)
    g, h = _ChunkScores.apply(z, torch.tensor([[0]]), 1.0, None)
    assert float(g) == pytest.approx(math.log(0.25))
    assert float(h) == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    g.sum().backward()
    assert z.grad[0].tolist() == pytest.approx([0.75, -0.75])
