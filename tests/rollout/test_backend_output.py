"""What a backend returns is checked where it enters the engine, naming the backend and field.

A backend returning numpy ids or numpy float logprobs played, then writing the run
failed after every episode (JSON takes neither int64 nor float32); lists of the
wrong length were stored, and broke the tree's token arrays later.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from agentrl.config import load_config
from agentrl.policy import MockPolicy
from agentrl.rollout import collect, summarize, write_run
from agentrl.types import read_trees


class NumpyBackend(MockPolicy):
    """Answers as a numpy-minded backend would: int64 ids, float32 logprobs and entropies."""

    def __init__(self, tokenizer, change):
        super().__init__(tokenizer, ["1"])
        self.change = change

    async def agenerate(self, request):
        return self.change(await super().agenerate(request))


def _numpy(res):
    return dataclasses.replace(res, token_ids=np.array(res.token_ids, dtype=np.int64),
                               logprobs=list(np.array(res.logprobs, dtype=np.float32)),
                               entropies=np.array(res.entropies, dtype=np.float32),
                               version=np.int64(res.version), cached_tokens=np.int32(0))


def test_numpy_ids_and_logprobs_are_taken_as_plain_numbers_and_the_run_is_written(tokenizer, tmp_path):
    trees = collect("agentrl/GuessNumber-v0", NumpyBackend(tokenizer, _numpy), load_config(), [0])
    write_run(tmp_path, trees, summarize(trees, 1.0))
    (back,) = read_trees(tmp_path / "trajectories.jsonl")
    node = next(n for n in trees[0].nodes.values() if n.action_ids)
    assert type(node.action_ids[0]) is int and type(node.logprobs[0]) is float
    assert type(node.entropies[0]) is float and type(node.version) is int
    assert [n.action_ids for n in back.nodes.values()] == [n.action_ids for n in trees[0].nodes.values()]
    json.dumps(trees[0].to_dict())


@pytest.mark.parametrize("change, field", [
    (lambda r: dataclasses.replace(r, logprobs=r.logprobs[:-1]), "logprobs"),
    (lambda r: dataclasses.replace(r, entropies=r.entropies + [0.0]), "entropies"),
    (lambda r: dataclasses.replace(r, token_ids=[str(t) for t in r.token_ids]), "token_ids"),
    (lambda r: dataclasses.replace(r, token_ids=[-1] * len(r.token_ids)), "token_ids"),
    (lambda r: dataclasses.replace(r, logprobs=[None] * len(r.logprobs)), "logprobs"),
    (lambda r: dataclasses.replace(r, logprobs=[float("nan")] * len(r.logprobs)), "logprobs"),
    (lambda r: dataclasses.replace(r, version="v2"), "version"),
    (lambda r: dataclasses.replace(r, top_logprobs=[[(1, -0.1)]]), "top_logprobs"),
    (lambda r: dataclasses.replace(r, finish_reason="max_tokens"), "finish_reason"),
    (lambda r: dataclasses.asdict(r), "result"),
])
def test_a_malformed_backend_output_fails_its_episode_naming_the_backend_and_field(tokenizer, change, field):
    (tree,) = collect("agentrl/GuessNumber-v0", NumpyBackend(tokenizer, change), load_config(), [0])
    errors = [n.error for n in tree.nodes.values() if n.error]
    assert errors and all(e.startswith(f"backend NumpyBackend returned a bad {field}") for e in errors), errors
