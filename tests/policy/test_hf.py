"""HFPolicy: logprobs and entropies are those of the sampling distribution,
batching with left padding changes nothing, and stops are honoured."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from agentrl.chat import render_ids
from agentrl.errors import PolicyError
from agentrl.policy import GenerateRequest, GenerateResult, HFPolicy, SamplingParams
from agentrl.policy.base import request_seed


def _prompt(tokenizer, text="Tell me a story."):
    return render_ids(tokenizer, [{"role": "user", "content": text}])


def _reference_logprobs(logits_row: list[float], params: SamplingParams) -> list[float]:
    """Sampling distribution written out by hand, one row, plain Python: a second opinion."""
    if params.temperature == 0:
        scaled = list(logits_row)
    else:
        scaled = [x / params.temperature for x in logits_row]
    keep = set(range(len(scaled)))
    order = sorted(keep, key=lambda i: -scaled[i])
    if 0 < params.top_k < len(scaled) and params.temperature > 0:
        keep = set(order[:params.top_k])
    if params.top_p < 1.0 and params.temperature > 0:
        kept = [i for i in order if i in keep]
        z = sum(math.exp(scaled[i]) for i in kept)
        mass, nucleus = 0.0, set()
        for i in kept:
            if mass >= params.top_p:
                break
            nucleus.add(i)
            mass += math.exp(scaled[i]) / z
        keep = nucleus
    z = math.log(sum(math.exp(scaled[i]) for i in keep))
    return [scaled[i] - z if i in keep else -math.inf for i in range(len(scaled))]


def _recompute(model, prompt, tokens, params):
    """Logprobs and entropies of ``tokens`` from one full forward pass and the hand reference."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].double()
    chosen, ents = [], []
    for row, t in zip(logits.tolist(), tokens, strict=True):
        lp = _reference_logprobs(row, params)
        chosen.append(lp[t])
        ents.append(-sum(math.exp(x) * x for x in lp if x > -math.inf))
    return torch.tensor(chosen, dtype=torch.float64), torch.tensor(ents, dtype=torch.float64)


def test_logprobs_match_a_full_forward(tokenizer, tiny_model):
    policy = HFPolicy(tiny_model, tokenizer)
    prompt = _prompt(tokenizer)
    for params in [SamplingParams(max_new_tokens=12, seed=3),
                   SamplingParams(max_new_tokens=12, seed=4, temperature=0.7, top_k=50, top_p=0.9),
                   SamplingParams(max_new_tokens=12, temperature=0.0, top_k=5)]:
        res = policy.generate([GenerateRequest(prompt, params)])[0]
        assert len(res.token_ids) == len(res.logprobs) == len(res.entropies) == 12
        chosen, ent = _recompute(tiny_model, prompt, res.token_ids, params)
        assert torch.allclose(torch.tensor(res.logprobs).double(), chosen, atol=1e-4)
        assert torch.allclose(torch.tensor(res.entropies).double(), ent, atol=1e-3)
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


def test_greedy_logprobs_are_the_unprocessed_distribution(tokenizer, tiny_model):
    # top_k must not change greedy logprobs: they are log_softmax of the raw logits.
    prompt = _prompt(tokenizer)
    res = HFPolicy(tiny_model, tokenizer).generate(
        [GenerateRequest(prompt, SamplingParams(max_new_tokens=4, temperature=0.0, top_k=3))])[0]
    with torch.no_grad():
        logits = tiny_model(input_ids=torch.tensor([prompt + res.token_ids])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits.double(), -1)
    assert res.token_ids == ref.argmax(-1).tolist()
    assert torch.allclose(torch.tensor(res.logprobs).double(),
                          ref.gather(-1, torch.tensor(res.token_ids)[:, None]).squeeze(-1), atol=1e-4)
    assert all(e > 1.0 for e in res.entropies)  # a near-uniform random model, not a point mass


def _pairwise_distinct(samples):
    return all(a != b for a, b in itertools.combinations(samples, 2))


def test_identical_prompts_draw_independent_samples(tokenizer, tiny_model):
    # Two chunks of 16: the old per-chunk seeding replayed chunk 1's noise in chunk 2.
    policy = HFPolicy(tiny_model, tokenizer, max_batch_size=16)
    prompt = _prompt(tokenizer)
    seeded = [GenerateRequest(prompt, SamplingParams(max_new_tokens=4, seed=request_seed(0, ep, 1)))
              for ep in range(32)]
    assert _pairwise_distinct([tuple(r.token_ids) for r in policy.generate(seeded)])
    unseeded = [GenerateRequest(prompt, SamplingParams(max_new_tokens=4)) for _ in range(32)]
    assert _pairwise_distinct([tuple(r.token_ids) for r in policy.generate(unseeded)])


def test_a_requests_sample_does_not_depend_on_its_batch(tokenizer, tiny_model):
    policy = HFPolicy(tiny_model, tokenizer, prefix_cache_mb=0)
    mine = GenerateRequest(_prompt(tokenizer, "Mine."), SamplingParams(max_new_tokens=8, seed=7))
    others = [GenerateRequest(_prompt(tokenizer, f"Other prompt number {i}, longer."),
                              SamplingParams(max_new_tokens=8, seed=100 + i)) for i in range(5)]
    alone = policy.generate([mine])[0]
    for batch in ([mine] + others, others[:2] + [mine] + others[2:]):
        got = policy.generate(batch)[batch.index(mine)]
        assert got.token_ids == alone.token_ids
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(alone.logprobs), atol=1e-4)


def test_rejected_weight_updates_change_nothing(tokenizer, tiny_model):
    model = type(tiny_model)(tiny_model.config)
    model.load_state_dict(tiny_model.state_dict())
    policy = HFPolicy(model, tokenizer)
    policy.generate([GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=2))])
    assert len(policy.prefix_cache) == 1
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new = {k: v + 1.0 for k, v in before.items()}
    part = dict(list(new.items())[::2])
    for bad, match in [(part, "missing"), (dict(new, bogus=torch.zeros(1)), "unexpected"),
                       (dict(new, **{next(iter(new)): torch.zeros(3)}), "shapes")]:
        with pytest.raises(PolicyError, match=match):
            policy.update_weights(bad)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # nothing copied
        assert policy.version == 0 and len(policy.prefix_cache) == 1
    policy.update_weights(part, strict=False)
    assert policy.version == 1
    assert len(policy.prefix_cache) == 0  # keys and values of the old weights are stale
    assert torch.equal(model.state_dict()[next(iter(part))], next(iter(part.values())))


def test_a_checkpoint_without_the_tied_head_is_complete(tokenizer, tiny_model):
    model = type(tiny_model)(tiny_model.config)
    model.load_state_dict(tiny_model.state_dict())
    assert model.config.tie_word_embeddings
    policy = HFPolicy(model, tokenizer)
    saved = {k: v + 1.0 for k, v in model.state_dict().items() if k != "lm_head.weight"}
    policy.update_weights(saved)  # what save_pretrained writes for a tied model
    assert policy.version == 1
    assert torch.equal(model.lm_head.weight, saved["model.embed_tokens.weight"])


def test_rows_with_different_token_limits_share_a_batch(tokenizer, tiny_model):
    policy = HFPolicy(tiny_model, tokenizer)
    policy.eos_ids = {-1}
    calls = []
    original = policy._generate_batch
    policy._generate_batch = lambda reqs: calls.append(len(reqs)) or original(reqs)
    limits = [5, 2, 9, 1]
    results = policy.generate([GenerateRequest(_prompt(tokenizer, f"Q{i}"), SamplingParams(max_new_tokens=n))
                               for i, n in enumerate(limits)])
    assert calls == [4]
    assert [len(r.token_ids) for r in results] == limits
    assert all(r.finish_reason == "length" for r in results)


def test_a_cancelled_request_leaves_the_running_batch_at_the_next_decode_step(tiny_model, tokenizer):
    """A client that leaves mid-reply: its row stops, and the request queued behind the batch runs."""
    import asyncio
    import threading
    import time

    from agentrl.policy.base import RequestControl

    policy = HFPolicy(tiny_model, tokenizer, prefix_cache_mb=0)
    seen: list[int] = []
    started = threading.Event()

    def on_token(t: int) -> None:
        seen.append(t)
        if len(seen) == 5:
            started.set()

    long = GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=3000, seed=0),
                           RequestControl(on_token))
    policy.eos_ids = set()  # nothing ends the long reply early but its cancellation

    async def scenario() -> tuple[int, GenerateResult, float]:
        task = asyncio.ensure_future(policy.agenerate(long))
        assert await asyncio.to_thread(started.wait, 60)
        task.cancel()
        while not long.control.cancelled:
            await asyncio.sleep(0)
        at_cancel = len(seen)
        t0 = time.monotonic()
        short = await policy.agenerate(GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=4, seed=1)))
        with pytest.raises(asyncio.CancelledError):
            await task
        return at_cancel, short, time.monotonic() - t0

    at_cancel, short, waited = asyncio.run(scenario())
    policy.batcher.wait_idle(60)
    assert len(seen) <= at_cancel + 1  # at most the step that was running
    assert len(short.token_ids) == 4
    assert len(seen) < 3000 and waited < 30


# A reply whose text, as the user sees it (special tokens skipped), is "gonorth": SmolLM2's
# <repo_name> (id 3) is a special token between "go" and "north". The stop string "onor" spans it.
_SPLIT_ACTION = "go<repo_name>north"


@pytest.mark.parametrize("stop, finish, kept", [
    (("onor",), "stop_string", 3),     # the visible text has it: stop on "north", as vLLM does
    (("<repo_name>",), "stop", 4),     # a special token's own text is invisible: no stop string there
])
def test_stop_strings_match_the_text_without_special_tokens(tokenizer, tiny_model, stop, finish, kept):
    from agentrl.policy import MockPolicy, action_text

    ids = tokenizer.encode(_SPLIT_ACTION, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert ids[1] == 3 and tokenizer.decode(ids, skip_special_tokens=True) == "gonorth"
    prompt = _prompt(tokenizer)
    # hf, its reply forced by the admissible-action trie; the mock, scripted: the same tokens.
    hf = HFPolicy(tiny_model, tokenizer).generate([GenerateRequest(
        prompt, SamplingParams(temperature=0, max_new_tokens=8, stop=stop), admissible=(_SPLIT_ACTION,))])[0]
    mock = MockPolicy(tokenizer, [_SPLIT_ACTION]).generate([GenerateRequest(
        prompt, SamplingParams(max_new_tokens=8, stop=stop))])[0]
    for res in (hf, mock):
        assert (res.finish_reason, res.token_ids) == (finish, ids[:kept])
    assert action_text(tokenizer, hf.token_ids, stop) == ("gonor" if finish == "stop_string" else "gonorth")


def test_a_stop_string_is_found_across_a_run_of_special_tokens(tokenizer):
    """Special tokens decode to nothing, so they do not count toward the tail that is decoded."""
    from agentrl.policy import MockPolicy, stop_string_hit

    text = "a" + "<repo_name>" * 30 + "b c"
    ids = tokenizer.encode(text, add_special_tokens=False)
    j = ids.index(3) + 30  # the token after the run: "b"
    assert tokenizer.decode(ids[:j + 1], skip_special_tokens=True) == "ab"
    assert stop_string_hit(tokenizer, ids[:j + 1], ("ab",)) and not stop_string_hit(tokenizer, ids[:j], ("ab",))
    res = MockPolicy(tokenizer, [text]).generate([GenerateRequest([1], SamplingParams(stop=("ab",)))])[0]
    assert (res.finish_reason, res.token_ids) == ("stop_string", ids[:j + 1])
