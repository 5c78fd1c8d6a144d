"""``HFPolicy(precision="bf16")``: generation computes what ``train.precision: bf16`` does (bf16
autocast, the vocabulary head in fp32), keeps keys and values in bf16, and runs under ``no_grad``
so that autocast casts each weight once a call; fp32 and deterministic mode stay fp32."""

from __future__ import annotations

import pytest
import torch

from agentrl.chat import render_ids
from agentrl.config import PolicyConfig
from agentrl.errors import ConfigError, PolicyError
from agentrl.models import load_model
from agentrl.policy import GenerateRequest, HFPolicy, SamplingParams, make_policy
from agentrl.precision import fp32_head


def _large_logit_model():
    """tiny-random with the likeliest logits near 16-32, where a bf16 head rounds them by up to
    0.125: a sampler whose head ran in bf16 would be off the trainer's log-probs by that much."""
    model, _ = load_model("tiny-random")
    with torch.no_grad():
        model.lm_head.weight.mul_(16.0)
    return model


def _requests(tokenizer, n=3, new=8):
    texts = ["Tell me a story.", "Go to the kitchen and open the fridge.", "hi"]
    return [GenerateRequest(render_ids(tokenizer, [{"role": "user", "content": texts[i % 3]}]),
                            SamplingParams(temperature=0.0, max_new_tokens=new, logprobs=5)) for i in range(n)]


def _watch(model):
    """What each decoder layer and the head saw during generation."""
    seen: dict[str, set] = {"autocast": set(), "inference_mode": set(), "grad": set(), "head": set()}

    def layer_hook(module, args, out):
        seen["autocast"].add(torch.is_autocast_enabled("cpu"))
        seen["inference_mode"].add(torch.is_inference_mode_enabled())
        seen["grad"].add(torch.is_grad_enabled())

    hooks = [layer.register_forward_hook(layer_hook) for layer in model.model.layers]
    hooks.append(model.lm_head.register_forward_hook(lambda m, a, out: seen["head"].add(out.dtype)))
    return seen, hooks


def test_bf16_generation_autocasts_under_no_grad_with_the_head_and_the_numbers_of_the_bf16_trainer(tokenizer):
    model = _large_logit_model()
    policy = HFPolicy(model, tokenizer, precision="bf16")
    seen, hooks = _watch(model)
    reqs = _requests(tokenizer)
    try:
        outs = policy.generate(reqs)
    finally:
        for h in hooks:
            h.remove()
    # bf16 autocast, not in inference mode (where autocast re-casts every weight at every forward)
    assert seen == {"autocast": {True}, "inference_mode": {False}, "grad": {False}, "head": {torch.float32}}
    assert not torch.is_autocast_enabled("cpu") and "forward" not in model.lm_head.__dict__  # nothing leaks
    entry, _ = policy.prefix_cache.match(reqs[0].prompt_ids + outs[0].token_ids[:-1])
    assert entry is not None and {t.dtype for t in entry.kv[0]} == {torch.bfloat16}
    errs = []
    for req, out in zip(reqs, outs, strict=True):  # each step's 5 likeliest tokens, against one full forward
        ids = torch.tensor([req.prompt_ids + out.token_ids])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), fp32_head(model):
            logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0, len(req.prompt_ids) - 1:-1]
        errs += [abs(lp - logp[pos, t].item()) for pos, top in enumerate(out.top_logprobs) for t, lp in top]
    assert len(errs) == 3 * 8 * 5
    assert max(errs) < 0.01, max(errs)  # measured 1e-4; with the head in bf16, 0.083


def test_fp32_and_deterministic_generation_stay_fp32(tokenizer, tiny_model):
    for policy in (HFPolicy(tiny_model, tokenizer), HFPolicy(tiny_model, tokenizer, precision="bf16",
                                                              deterministic=True)):
        seen, hooks = _watch(tiny_model)
        reqs = _requests(tokenizer, n=2, new=4)
        try:
            outs = policy.generate(reqs)
        finally:
            for h in hooks:
                h.remove()
        assert seen["autocast"] == {False} and seen["inference_mode"] == {True}
        entry, _ = policy.prefix_cache.match(reqs[0].prompt_ids + outs[0].token_ids[:-1])
        assert entry is not None and entry.kv[0][0].dtype == torch.float32


def test_bf16_generation_reuses_its_bf16_cache_across_turns(tokenizer):
    """A second turn that extends the first prefills only its new tokens from the bf16 cache, and
    its greedy reply and log-probs are those of a fresh policy that prefills everything."""
    model, _ = load_model("tiny-random")
    cached = HFPolicy(model, tokenizer, precision="bf16")
    first = _requests(tokenizer, n=1, new=6)[0]
    out = cached.generate([first])[0]
    follow = GenerateRequest(first.prompt_ids + out.token_ids + render_ids(tokenizer, [{"role": "user",
                             "content": "and then?"}])[1:], first.params)
    again = cached.generate([follow])[0]
    assert again.cached_tokens >= len(first.prompt_ids)
    fresh = HFPolicy(model, tokenizer, precision="bf16", prefix_cache_mb=0).generate([follow])[0]
    assert fresh.cached_tokens == 0
    assert again.token_ids == fresh.token_ids
    assert max(abs(a - b) for a, b in zip(again.logprobs, fresh.logprobs, strict=True)) < 0.03


def test_precision_is_resolved_before_a_policy_is_made(monkeypatch):
    with pytest.raises(PolicyError, match="resolve it first"):
        HFPolicy(*load_model("tiny-random"), precision="auto")
    with pytest.raises(ConfigError, match="policy.precision='fp16'"):
        HFPolicy(*load_model("tiny-random"), precision="fp16")
    for forced, want in (("1", "bf16"), ("0", "fp32")):
        monkeypatch.setenv("AGENTRL_CPU_BF16", forced)
        policy = make_policy(PolicyConfig(backend="hf", model="tiny-random"))
        assert policy.precision == want
        policy.close()
    policy = make_policy(PolicyConfig(backend="hf", model="tiny-random", precision="bf16"))
    assert policy.precision == "bf16"
    policy.close()


def test_fp32_head_blocks_overlap_and_the_last_one_out_restores_the_head():
    model, _ = load_model("tiny-random")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = fp32_head(model), fp32_head(model)
        a.__enter__()
        b.__enter__()
        a.__exit__(None, None, None)  # out of order, as a sampler's and a trainer's threads may be
        assert model(input_ids=torch.tensor([[5, 6]])).logits.dtype == torch.float32
        b.__exit__(None, None, None)
        assert "forward" not in model.lm_head.__dict__
        assert model(input_ids=torch.tensor([[5, 6]])).logits.dtype == torch.bfloat16


def test_switching_deterministic_mode_drops_keys_and_values_of_the_other_precision(tokenizer, tiny_model):
    """A bf16 policy switched out of deterministic mode (fp32) does not reuse the fp32 keys and
    values that mode cached, nor does it later reuse its bf16 ones in fp32."""
    policy = HFPolicy(tiny_model, tokenizer, precision="bf16", deterministic=True)
    req = _requests(tokenizer, n=1, new=4)[0]
    policy.generate([req])
    policy.deterministic = False
    assert policy.generate([req])[0].cached_tokens == 0
    assert policy.generate([req])[0].cached_tokens > 0  # reused within one precision
    entry, _ = policy.prefix_cache.match(req.prompt_ids)
    assert entry.kv[0][0].dtype == torch.bfloat16
    policy.deterministic = True
    policy.generate([req])
    entry, _ = policy.prefix_cache.match(req.prompt_ids)
    assert entry.kv[0][0].dtype == torch.float32


def _weight_casts(policy, reqs) -> tuple[int, int]:
    """(fp32 -> bf16 casts of 2-D tensors, the weights' kind, during ``generate``; the model's 2-D weights)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            src = args[0] if args else None
            if (func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.to)  # inference_mode: aten.to
                    and isinstance(src, torch.Tensor) and src.dim() == 2
                    and src.dtype == torch.float32 and out.dtype == torch.bfloat16):
                Count.n += 1
            return out

    with Count():
        policy.generate(reqs)
    return Count.n, sum(1 for p in policy.model.parameters() if p.dim() == 2)


def test_bf16_generation_casts_each_weight_once_a_call_also_in_a_snapshot(tokenizer):
    """Under no_grad, autocast keeps its bf16 copy of each weight for the whole call (under
    inference_mode it cast them all again at every forward: 8 decode steps, 8 times as many)."""
    from agentrl.policy import SnapshotPolicy

    model, _ = load_model("tiny-random")
    policy = HFPolicy(model, tokenizer, precision="bf16", prefix_cache_mb=0)
    casts, weights = _weight_casts(policy, _requests(tokenizer, n=2, new=8))
    assert 0 < casts <= weights, (casts, weights)
    snap = SnapshotPolicy.of(policy)
    assert snap.precision == "bf16"
    casts, weights = _weight_casts(snap, _requests(tokenizer, n=2, new=8))
    assert 0 < casts <= weights, (casts, weights)


def test_bf16_precision_over_bf16_weights_computes_in_their_dtype_and_the_head_still_runs_fp32(tokenizer):
    """policy.dtype bfloat16: nothing to autocast, so generation runs as before; the trainer's
    fp32 head over bf16 weights multiplies an fp32 copy of them (it crashed on the dtype mismatch)."""
    model, _ = load_model("tiny-random", dtype="bfloat16")
    policy = HFPolicy(model, tokenizer, precision="bf16")
    seen, hooks = _watch(model)
    try:
        out = policy.generate(_requests(tokenizer, n=1, new=4))[0]
    finally:
        for h in hooks:
            h.remove()
    assert len(out.token_ids) == 4 and seen["autocast"] == {False} and seen["head"] == {torch.bfloat16}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), fp32_head(model):
        logits = model(input_ids=torch.tensor([[5, 6, 7]])).logits
    assert logits.dtype == torch.float32


def test_an_fp32_head_refuses_a_wrapped_head_over_bf16_weights_instead_of_dropping_its_adapter():
    """LoRA on lm_head over bf16 weights: an fp32 copy of the base weight alone would compute
    logits without the adapter, and train it not at all."""
    model, _ = load_model("tiny-random", dtype="bfloat16")

    class Adapted(torch.nn.Module):  # the shape of a peft LoRA layer: the base, and more
        def __init__(self, base):
            super().__init__()
            self.base_layer, self.weight, self.bias = base, base.weight, None

        def forward(self, x):
            return self.base_layer(x) + 1.0

    model.lm_head = Adapted(model.lm_head)
    with torch.autocast("cpu", dtype=torch.bfloat16), fp32_head(model), \
            pytest.raises(ConfigError, match="cannot wrap a Adapted over torch.bfloat16 weights"):
        model(input_ids=torch.tensor([[1, 2, 3]]))
