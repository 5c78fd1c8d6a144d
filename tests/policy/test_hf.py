"""HFPolicy: logprobs and entropies are those of the sampling distribution,
batching with left padding changes nothing, and stops are honoured."""

from __future__ import annotations

import torch

from agentrl.chat import render_ids
from agentrl.policy import GenerateRequest, HFPolicy, SamplingParams, sampling_logprobs


def _prompt(tokenizer, text="Tell me a story."):
    return render_ids(tokenizer, [{"role": "user", "content": text}])


def _recompute(model, prompt, tokens, params):
    """Logprobs and entropies of ``tokens`` from one full forward pass."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
    logp = sampling_logprobs(logits, params)
    chosen = logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
    p = logp.exp()
    ent = -(p * logp.masked_fill(p == 0, 0)).sum(-1)
    return chosen, ent


def test_logprobs_match_a_full_forward(tokenizer, tiny_model):
    policy = HFPolicy(tiny_model, tokenizer)
    prompt = _prompt(tokenizer)
    for params in [SamplingParams(max_new_tokens=12, seed=3),
                   SamplingParams(max_new_tokens=12, seed=4, temperature=0.7, top_k=50, top_p=0.9)]:
        res = policy.generate([GenerateRequest(prompt, params)])[0]
        assert len(res.token_ids) == len(res.logprobs) == len(res.entropies) == 12
        chosen, ent = _recompute(tiny_model, prompt, res.token_ids, params)
        assert torch.allclose(torch.tensor(res.logprobs), chosen, atol=1e-4)
        assert torch.allclose(torch.tensor(res.entropies), ent, atol=1e-3)
        assert res.finish_reason == "length" and res.version == 0


def test_left_padded_batch_equals_single_requests(tokenizer, tiny_model):
    policy = HFPolicy(tiny_model, tokenizer)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    prompts = [_prompt(tokenizer, "Hi"), _prompt(tokenizer, "A much longer question about many things?")]
    batch = policy.generate([GenerateRequest(p, greedy) for p in prompts])
    for p, res in zip(prompts, batch, strict=True):
        single = policy.generate([GenerateRequest(p, greedy)])[0]
        assert single.token_ids == res.token_ids
        assert torch.allclose(torch.tensor(single.logprobs), torch.tensor(res.logprobs), atol=1e-4)


def test_same_seed_same_sample(tokenizer, tiny_model):
    policy = HFPolicy(tiny_model, tokenizer)
    req = GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=6, seed=11))
    assert policy.generate([req])[0].token_ids == policy.generate([req])[0].token_ids


def test_stops_on_eos_stop_token_and_stop_string(tokenizer, tiny_model):
    policy = HFPolicy(tiny_model, tokenizer)
    prompt = _prompt(tokenizer)
    free = policy.generate([GenerateRequest(prompt, SamplingParams(max_new_tokens=6, temperature=0))])[0]
    # Declare the 3rd greedy token a stop token: generation ends right there.
    stop_tok = free.token_ids[2]
    res = policy.generate([GenerateRequest(prompt, SamplingParams(
        max_new_tokens=6, temperature=0, stop_token_ids=(stop_tok,)))])[0]
    assert res.finish_reason == "stop"
    assert res.token_ids == free.token_ids[:free.token_ids.index(stop_tok) + 1]
    text = tokenizer.decode(free.token_ids[:2])
    res = policy.generate([GenerateRequest(prompt, SamplingParams(
        max_new_tokens=6, temperature=0, stop=(text[-2:],)))])[0]
    assert res.finish_reason == "stop_string"
    assert len(res.token_ids) <= 2


def test_eos_ends_generation(tokenizer, tiny_model):
    policy = HFPolicy(tiny_model, tokenizer)
    assert tokenizer.eos_token_id in policy.eos_ids
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    free = policy.generate([GenerateRequest(_prompt(tokenizer), greedy)])[0]
    fake_eos = free.token_ids[1]  # pretend the 2nd greedy token is EOS
    policy.eos_ids = {fake_eos}
    res = policy.generate([GenerateRequest(_prompt(tokenizer), greedy)])[0]
    assert res.token_ids == free.token_ids[:free.token_ids.index(fake_eos) + 1]
    assert res.finish_reason == "stop"


def test_top_logprobs_and_weight_updates(tokenizer, tiny_model):
    policy = HFPolicy(tiny_model, tokenizer)
    req = GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=3, temperature=0, logprobs=3))
    before = policy.generate([req])[0]
    assert len(before.top_logprobs) == 3 and all(len(t) == 3 for t in before.top_logprobs)
    # Greedy: the chosen token is the top-1 alternative, with the same logprob.
    assert before.top_logprobs[0][0][0] == before.token_ids[0]
    assert abs(before.top_logprobs[0][0][1] - before.logprobs[0]) < 1e-5
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in tiny_model.state_dict().items()}
    model = type(tiny_model)(tiny_model.config)
    model.load_state_dict(tiny_model.state_dict())
    policy = HFPolicy(model, tokenizer)
    policy.update_weights(new)
    after = policy.generate([req])[0]
    assert policy.version == 1 and after.version == 1
    assert after.logprobs != before.logprobs
