"""ChatContext keeps exactly the tokens the policy saw, and reports unstable templates."""

from __future__ import annotations

import copy

import pytest

from agentrl.chat import ChatContext, TemplateMismatchWarning, render_ids
from agentrl.errors import ContextOverflowError

# Drops the <think> block of every assistant message except the last one, as
# some reasoning-model templates do: not prefix-stable.
THINK_DROPPING_TEMPLATE = (
    "{% for m in messages %}"
    "{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last and '</think>' in c %}"
    "{% set c = c.split('</think>')[-1] %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ c }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _action(tokenizer, text, eos=True):
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids + [tokenizer.eos_token_id] if eos else ids


def test_chatml_context_equals_full_rerender(tokenizer):
    ctx = ChatContext(tokenizer, [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Guess a number from 1 to 32."}])
    for guess, hint in [("16", "Too low."), ("24", "Too high."), ("20", "Too low.")]:
        ctx.append_action(_action(tokenizer, guess))
        ctx.append_observation([{"role": "user", "content": hint}])
    assert ctx.ids == render_ids(tokenizer, ctx.messages)
    assert ctx.prefix_stable and ctx.mismatches == []


def test_truncated_action_is_closed_before_the_observation(tokenizer):
    ctx = ChatContext(tokenizer, [{"role": "user", "content": "Count."}])
    action = _action(tokenizer, "one two three", eos=False)  # hit max_new_tokens: no EOS
    ctx.append_action(action)
    delta = ctx.append_observation([{"role": "user", "content": "Stop."}])
    assert tokenizer.decode(delta).startswith("<|im_end|>\n<|im_start|>user\nStop.")
    assert ctx.ids == render_ids(tokenizer, ctx.messages)


@pytest.mark.parametrize("cut", range(len("<|im_end|>\n") + 1))
def test_action_cut_inside_terminator_text_still_gets_the_special_end_token(tokenizer, cut):
    # Plain-text tokens that spell a prefix of "<|im_end|>\n" are not the end token:
    # the whole terminator, special token included, must still close the turn.
    ctx = ChatContext(tokenizer, [{"role": "user", "content": "Write markup."}])
    text = "a " + "<|im_end|>\n"[:cut]
    action = [i for piece in ("a ", "<", "|", "im", "_end", "|", ">", "\n")[: 1 + cut]
              for i in tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=True)]
    assert tokenizer.eos_token_id not in action
    ctx.append_action(action)
    delta = ctx.append_observation([{"role": "user", "content": "Next."}])
    assert delta[0] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ctx.ids[len(ctx) - len(delta) - len(action):len(ctx) - len(delta)] == action
    assert tokenizer.decode(ctx.ids) == tokenizer.apply_chat_template(ctx.messages, tokenize=False,
                                                                      add_generation_prompt=True)
    assert ctx.prefix_stable, text


@pytest.mark.parametrize("k", [0, 1])
def test_sampled_terminator_tokens_are_not_appended_twice(tokenizer, k):
    ctx = ChatContext(tokenizer, [{"role": "user", "content": "Hi"}])
    term = tokenizer.encode("<|im_end|>\n", add_special_tokens=False)
    assert len(term) == 2
    action = tokenizer.encode("Hello", add_special_tokens=False) + term[:k]
    ctx.append_action(action)
    delta = ctx.append_observation([{"role": "user", "content": "Bye"}])
    assert delta[: 2 - k] == term[k:]
    assert tokenizer.decode(delta[2 - k:]).startswith("<|im_start|>user\nBye")


def test_actions_are_appended_as_sampled_between_the_rendered_deltas(tokenizer):
    ctx = ChatContext(tokenizer, [{"role": "user", "content": "Hi"}])
    opening = list(ctx.ids)
    action = _action(tokenizer, "Hello there")
    ctx.append_action(action, logprobs=[-0.25] * len(action))
    delta = ctx.append_observation([{"role": "user", "content": "Bye"}])
    assert ctx.ids == opening + action + delta
    assert ctx.messages[-2] == {"role": "assistant", "content": "Hello there"}


def test_decode_ids_equals_the_tokenizers_decode(tokenizer):
    from agentrl.chat import decode_ids

    ids = tokenizer.encode("<|im_start|>user\nCafé 🙂 über  spaces<|im_end|>\n", add_special_tokens=False)
    for skip in (False, True):
        assert decode_ids(tokenizer, ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)
        assert decode_ids(tokenizer, ids[:5], skip) == tokenizer.decode(ids[:5], skip_special_tokens=skip)
    assert decode_ids(tokenizer, []) == ""


def test_non_canonical_action_tokens_are_kept_as_sampled(tokenizer):
    # "hello" spelled one character per token: a re-tokenization would merge them.
    chars = [tokenizer.convert_tokens_to_ids(c) for c in "hello"]
    ctx = ChatContext(tokenizer, [{"role": "user", "content": "Say hello"}])
    n0 = len(ctx)
    ctx.append_action(chars + [tokenizer.eos_token_id])
    ctx.append_observation([{"role": "user", "content": "Again"}])
    assert ctx.ids[n0:n0 + 6] == chars + [tokenizer.eos_token_id]
    assert render_ids(tokenizer, ctx.messages) != ctx.ids  # the re-render would differ


def test_non_prefix_stable_template_keeps_what_policy_saw_and_reports(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = THINK_DROPPING_TEMPLATE
    ctx = ChatContext(tok, [{"role": "user", "content": "Solve 2+2."}])
    expected = list(ctx.ids)
    action = _action(tok, "<think>2 plus 2 is 4</think>4")
    ctx.append_action(action)
    expected += action
    with pytest.warns(TemplateMismatchWarning, match="not prefix-stable"):
        delta = ctx.append_observation([{"role": "user", "content": "And 3+3?"}])
    expected += delta
    assert ctx.ids == expected  # nothing was re-rendered
    assert "<think>2 plus 2 is 4</think>" in tok.decode(ctx.ids)
    assert not ctx.prefix_stable
    assert ctx.mismatches == [1]
    # The template's own full rendering dropped the reasoning: the two differ.
    assert render_ids(tok, ctx.messages) != ctx.ids


def test_overflowing_observation_raises_and_leaves_context_unchanged(tokenizer):
    ctx = ChatContext(tokenizer, [{"role": "user", "content": "Hi"}], max_tokens=64)
    ctx.append_action(_action(tokenizer, "ok"))
    before = (list(ctx.ids), list(ctx.messages))
    with pytest.raises(ContextOverflowError, match="budget of 64"):
        ctx.append_observation([{"role": "user", "content": "word " * 200}])
    assert (ctx.ids, ctx.messages) == before


def test_logprob_length_mismatch_is_an_error(tokenizer):
    ctx = ChatContext(tokenizer, [{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="2 logprobs for 3"):
        ctx.append_action([10, 11, 12], logprobs=[-1.0, -1.0])


def test_one_message_delta_by_concatenation_equals_the_template_render(tokenizer):
    """The fast path (template frame + content) gives the same ids as a full template render."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    ctx = ChatContext(tokenizer, [{"role": "user", "content": "hi"}])
    ctx.append_action(tokenizer.encode("ok", add_special_tokens=False) + [tokenizer.eos_token_id])
    assert ctx._frame("user") is not None and ctx._frame("tool") is not None

    @settings(max_examples=60, deadline=None)
    @given(st.text(min_size=1, max_size=80), st.sampled_from(["user", "tool"]))
    def check(text, role):
        msg = [{"role": role, "content": text}]
        fast = ctx.observation_ids(msg)
        slow = tokenizer.encode(ctx._unsampled_terminator() + ctx._render_delta(msg), add_special_tokens=False)
        assert fast == slow

    check()


def test_text_that_cannot_fit_is_refused_before_it_is_tokenized(tokenizer, monkeypatch):
    """A whole web page as an observation was tokenized first (seconds for megabytes, on the
    event loop every episode shares), then refused as over the budget."""
    ctx = ChatContext(tokenizer, [{"role": "user", "content": "hi"}], max_tokens=512)
    before, seen, encode = list(ctx.ids), [], tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: seen.append(len(text)) or encode(text, **kw))
    page = "word " * 200_000
    with pytest.raises(ContextOverflowError, match=r"1,000,\d+ characters are at least"):
        ctx.append_observation([{"role": "user", "content": page}])
    with pytest.raises(ContextOverflowError, match="at least"):
        ChatContext(tokenizer, [{"role": "user", "content": page}], max_tokens=512)
    assert seen == [] and ctx.ids == before  # never tokenized; the context is unchanged
    ctx.append_observation([{"role": "user", "content": "word " * 60}])  # what fits is appended
    with pytest.raises(ContextOverflowError, match="over the budget"):  # near the bound: tokenized, then refused
        ctx.append_observation([{"role": "user", "content": "word " * 1000}])
    assert seen and max(seen) < 6000
