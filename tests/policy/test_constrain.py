"""The admissible-action trie (``policy.constrain``) and constrained sampling on ``hf``."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.chat import render_ids
from agentrl.errors import PolicyError
from agentrl.policy import GenerateRequest, HFPolicy, SamplingParams
from agentrl.policy.constrain import (
    ActionTrie,
    allowed_tensor,
    end_token_id,
    episode_allowed,
    mask_logits,
    turn_allowed,
)
from agentrl.types import Episode, Node


class WordTokenizer:
    """One token a word; id 0 ends a turn."""

    eos_token_id = 0
    vocab = {"go": 1, "north": 2, "south": 3, "look": 4}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.vocab[w] for w in text.split()]


def test_the_trie_allows_exactly_the_next_tokens_of_some_action():
    trie = ActionTrie.of(WordTokenizer(), ["go north", "go south", "look", "look"])
    assert trie.allowed() == [1, 4]
    go = trie.walk([1])
    assert trie.allowed(go) == [2, 3]
    assert trie.allowed(trie.walk([1, 2])) == [0]  # the action is spelled: only the end
    assert trie.allowed(trie.walk([4])) == [0]
    assert trie.walk([2]) is None and trie.walk([1, 4]) is None
    assert trie.allowed(trie.walk([1, 3, 0])) == []  # after the end: nothing
    assert len(trie) == 1 + 5 + 2  # root, go/north/south/end/end, look/end


def test_an_action_that_prefixes_another_may_end_or_go_on():
    trie = ActionTrie.of(WordTokenizer(), ["go", "go north"])
    assert trie.allowed(trie.walk([1])) == [0, 2]


def test_turn_allowed_lists_each_positions_tokens_and_refuses_a_foreign_action():
    trie = ActionTrie.of(WordTokenizer(), ["go north", "go south", "look"])
    assert turn_allowed(trie, [1, 3, 0]) == [[1, 4], [2, 3], [0]]
    assert turn_allowed(trie, [1, 3]) == [[1, 4], [2, 3]]  # cut by max_new_tokens: a prefix
    with pytest.raises(ValueError, match="token 1 .* spells no admissible action"):
        turn_allowed(trie, [1, 4])


def test_episode_allowed_maps_constrained_turns_onto_input_positions():
    tok = WordTokenizer()
    first = Node(context_ids=[9, 9], action_ids=[1, 2, 0], admissible=["go north", "look"])
    free = Node(context_ids=[9], action_ids=[7, 7])
    part = Node(context_ids=[8], action_ids=[1], partial=True, admissible=["go south"])
    rest = Node(action_ids=[3, 0], admissible=["go south"])
    ep = Episode.from_path([first, free, part, rest])
    # ids: 9 9 | 1 2 0 | 9 | 7 7 | 8 | 1 | 3 0
    assert episode_allowed(tok, ep) == {2: [1, 4], 3: [2], 4: [0], 9: [1], 10: [3], 11: [0]}
    assert episode_allowed(tok, Episode.from_path([free])) == {}



def test_a_turn_off_its_trie_names_the_turn_node_action_and_list():
    ok = Node(id=3, context_ids=[9], action_ids=[4, 0], action_text="look", admissible=["look"])
    bad = Node(id=7, context_ids=[9], action_ids=[1, 4, 0], action_text="go look",
               admissible=["go north", "go south"])
    with pytest.raises(ValueError, match=r"turn 1 \(node 7, action 'go look'\) against its 2 admissible "
                       r"actions \('go north', 'go south'\): token 1 \(4\) .* spells no admissible action"):
        episode_allowed(WordTokenizer(), Episode.from_path([ok, bad]))

def test_mask_logits_keeps_allowed_ids_and_leaves_free_rows_alone():
    logits = torch.arange(10, dtype=torch.float32).view(2, 5)
    out = mask_logits(logits, torch.tensor([[3, 1], [-1, -1]]))
    inf = float("-inf")
    assert out.tolist() == [[inf, 1.0, inf, 3.0, inf], [5.0, 6.0, 7.0, 8.0, 9.0]]
    # token 0 with padding beside it: padding never clears an allowed id
    assert mask_logits(logits[:1], torch.tensor([[0, -1]])).tolist() == [[0.0, inf, inf, inf, inf]]
    assert allowed_tensor([[4], None, [1, 2]]).tolist() == [[4, -1], [-1, -1], [1, 2]]


def test_the_real_tokenizer_spells_actions_then_im_end(tokenizer):
    end = end_token_id(tokenizer)
    assert tokenizer.convert_ids_to_tokens(end) == "<|im_end|>"
    trie = ActionTrie.of(tokenizer, ["go to shelf 1", "go to shelf 10", "look"])
    go, look = tokenizer.encode("go", add_special_tokens=False), tokenizer.encode("look", add_special_tokens=False)
    assert trie.allowed() == sorted(go + look)
    one = trie.walk(tokenizer.encode("go to shelf 1", add_special_tokens=False))
    assert trie.allowed(one) == sorted([end, *tokenizer.encode("0", add_special_tokens=False)])


def _prompt(tokenizer):
    return render_ids(tokenizer, [{"role": "user", "content": "Where now?"}])


ACTIONS = ("go to shelf 1", "go to shelf 10", "take mug 1 from countertop 2", "look", "open drawer 3")


@pytest.mark.parametrize("deterministic", [False, True])
def test_hf_samples_only_admissible_replies_with_constrained_logprobs(tokenizer, tiny_model, deterministic):
    policy = HFPolicy(tiny_model, tokenizer, deterministic=deterministic)
    prompt, end = _prompt(tokenizer), end_token_id(tokenizer)
    params = [SamplingParams(seed=s, max_new_tokens=40, temperature=t) for s in range(4) for t in (1.0, 0.7)]
    results = policy.generate([GenerateRequest(prompt, p, admissible=ACTIONS) for p in params])
    seen = set()
    for p, res in zip(params, results, strict=True):
        assert res.finish_reason == "stop" and res.token_ids[-1] == end
        text = tokenizer.decode(res.token_ids[:-1])
        assert text in ACTIONS
        seen.add(text)
        # Hand reference: one full forward, masked to the trie, at the sampling temperature.
        trie = ActionTrie.of(tokenizer, ACTIONS)
        with torch.no_grad():
            logits = tiny_model(input_ids=torch.tensor([prompt + res.token_ids])).logits[0, len(prompt) - 1:-1]
        node = 0
        for k, t in enumerate(res.token_ids):
            allowed = trie.allowed(node)
            z = torch.logsumexp(logits[k, allowed].double() / p.temperature, 0)
            assert math.isclose(res.logprobs[k], float(logits[k, t] / p.temperature - z), abs_tol=1e-4)
            node = trie.child(node, t)
    assert len(seen) >= 2  # it samples, not always the same action


def test_hf_continues_a_forked_reply_inside_the_trie(tokenizer, tiny_model):
    policy = HFPolicy(tiny_model, tokenizer)
    head = tokenizer.encode("go to", add_special_tokens=False)
    res = policy.generate([GenerateRequest(_prompt(tokenizer) + head, SamplingParams(seed=1), admissible=ACTIONS,
                                           admissible_head=len(head))])[0]
    assert "go to" + tokenizer.decode(res.token_ids[:-1]) in ACTIONS
    bad = tokenizer.encode("jump", add_special_tokens=False)
    with pytest.raises(PolicyError, match="spell no admissible action"):
        policy.generate([GenerateRequest(_prompt(tokenizer) + bad, SamplingParams(seed=1), admissible=ACTIONS,
                                         admissible_head=len(bad))])
