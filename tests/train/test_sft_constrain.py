"""SFT under ``rollout.constrain: admissible``: expert turns are scored as the constrained sampler
draws them (``sft.constrain``), over the actions the env listed for each turn."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from agentrl.env import make_env
from agentrl.train import load_train_config
from agentrl.train.batch import constrain_samples, samples_from_credit, score_samples
from agentrl.train.cli import app
from agentrl.train.sft import expert_tree, sft_constrains

ENV = "agentrl/ALFWorld-v0"
KWARGS = {"max_steps": 10, "families": ["pick_and_place_simple"], "max_receptacles": 6}  # make run's level
ALF = [f"env.id={ENV}", "env.kwargs={max_steps: 10, families: [pick_and_place_simple], max_receptacles: 6}",
       "rollout.max_turns=10", "rollout.max_context_tokens=2048"]


def _nodes(tree):
    return list(tree.nodes.values())


def test_expert_turns_record_their_admissible_actions_only_when_constrained(tokenizer):
    free = load_train_config(None, ALF)
    con = load_train_config(None, [*ALF, "rollout.constrain=admissible", "sft.constrain=true"])
    off = load_train_config(None, [*ALF, "rollout.constrain=admissible"])  # the default: the whole vocabulary
    follow = load_train_config(None, [*ALF, "rollout.constrain=admissible", "sft.constrain=null"])
    assert [sft_constrains(c) for c in (free, con, off, follow)] == [False, True, False, True]
    for seed in (3, 11):
        t_free, t_con = (expert_tree(ENV, tokenizer, c, seed) for c in (free, con))
        assert t_con.meta["expert_success"] and len(_nodes(t_con)) >= 2
        assert all(n.admissible is None for n in _nodes(t_free))
        assert all(n.admissible is None for n in _nodes(expert_tree(ENV, tokenizer, off, seed)))
        assert all(n.admissible and n.action_text in n.admissible for n in _nodes(t_con))
        env = make_env(ENV, **KWARGS)
        try:  # the first turn's list is the reset's; the second's is the first step's
            _, info = env.reset(seed=seed)
            first = _nodes(t_con)[0]
            assert first.admissible == info["admissible_actions"]
            assert _nodes(t_con)[1].admissible == env.step(first.action_text)[4]["admissible_actions"]
        finally:
            env.close()


def test_constrained_expert_tokens_are_scored_over_the_allowed_ids_only(tokenizer, tiny_model):
    """Hand-checkable: a token with one allowed id has log-prob exactly 0 (it carries no loss);
    any other scores at least its free log-prob, the same logits renormalised over fewer ids."""
    cfg = load_train_config(None, [*ALF, "rollout.constrain=admissible", "sft.constrain=true"])
    tree = expert_tree(ENV, tokenizer, cfg, 3)
    items = [(ep, [float(m) for m in ep.loss_mask]) for ep in tree.episodes()]
    con, free = samples_from_credit(items), samples_from_credit(items)
    n = constrain_samples(con, tokenizer)
    assert n == sum(s.n_action for s in con) > 0  # every expert token is constrained
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    (sc_con,), _ = score_samples(tiny_model, con, 4096, pad, 1.0)
    (sc_free,), _ = score_samples(tiny_model, free, 4096, pad, 1.0)
    forced = choice = 0
    for t, ids in con[0].allowed.items():
        assert con[0].input_ids[t] in ids
        if len(ids) == 1:
            forced += 1
            assert float(sc_con.logprobs[t]) == 0.0
        else:
            choice += 1
            assert float(sc_con.logprobs[t]) >= float(sc_free.logprobs[t]) - 1e-5
            assert float(sc_free.logprobs[t]) < 0.0
    assert forced > 0 and choice > 0
    assert sum(sc_con.logprobs) > sum(sc_free.logprobs)


def test_sft_constrain_true_needs_constrained_rollouts():
    with pytest.raises(Exception, match="sft.constrain=true") as e:
        load_train_config(None, [*ALF, "sft.constrain=true"])
    assert "rollout.constrain=admissible" in str(e.value)


def test_an_sft_run_under_the_constraint_reports_its_constrained_tokens_and_learns(tmp_path):
    """``agentrl sft`` with rollout.constrain=admissible: every expert turn is constrained, and the
    constrained NLL of the expert's actions falls."""
    torch.set_num_threads(1)
    args = ["sft", "--no-progress", "--out", str(tmp_path), "--episodes", "4"]
    for item in [*ALF, "rollout.constrain=admissible", "sft.constrain=true", "policy.model=tiny-random",
                 "policy.backend=hf",
                 "sft.epochs=2", "sft.lr=5e-3", "sft.minibatch_size=4", "train.evaluation.episodes=0",
                 "train.micro_batch_tokens=4096", "train.output.tensorboard=false", "train.output.plot=false",
                 "train.checkpointing.export_hf=false"]:
        args += ["--set", item]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    sft = next(r for r in rows if r["phase"] == "sft")
    assert sft["sft/free_turns"] == 0
    assert sft["sft/constrained_tokens"] == sft["sft/action_tokens"] > 0
    assert sft["sft/nll_before"] > sft["sft/nll_after"] > 0.0


def test_an_expert_action_the_env_did_not_list_stays_free_and_is_counted(tmp_path, tokenizer):
    """Turn 1's expert action is missing from the list (as WebShop's oracle search can be) and
    turn 2's env lists nothing: both train over the whole vocabulary, the run warns and counts
    them; turn 3 is constrained. Non-string actions are listed as strings, as rollouts do."""
    import io

    from rich.console import Console

    from agentrl.env import TextEnv, register_env
    from agentrl.train.trainer import train

    class Unlisted(TextEnv):
        actions = ["jump", "look", "take 1"]

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.turn = 0
            return "a room", {"instruction": "act", "admissible_actions": ["look", "wait"], "tools": []}

        def expert_action(self):
            return self.actions[self.turn]

        def step(self, action):
            self.turn += 1
            listed = [] if self.turn == 1 else ["take 1", 2]
            return "ok", float(self.turn == 3), self.turn == 3, False, {"admissible_actions": listed}

    register_env("agentrl/UnlistedTest-v0", Unlisted)
    over = ["env.id=agentrl/UnlistedTest-v0", "rollout.max_turns=3", "rollout.constrain=admissible",
            "sft.constrain=true"]
    tree = expert_tree("agentrl/UnlistedTest-v0", tokenizer, load_train_config(None, over), 0)
    assert [n.admissible for n in _nodes(tree)] == [None, None, ["take 1", "2"]]
    torch.set_num_threads(1)
    buf = io.StringIO()
    cfg = load_train_config(None, [*over, "policy.model=tiny-random", "policy.backend=hf", "sft.episodes=2",
                                   "sft.minibatch_size=2", "sft.epochs=1", "train.steps=0",
                                   "train.evaluation.episodes=0", "train.output.tensorboard=false",
                                   "train.output.plot=false", "train.checkpointing.export_hf=false",
                                   f"train.output.dir={tmp_path}"])
    train(cfg, progress=False, console=Console(file=buf, width=300))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    sft = next(r for r in rows if r["phase"] == "sft")
    assert sft["sft/free_turns"] == 4  # two free turns in each of the two episodes
    n_take = len(tokenizer.encode("take 1", add_special_tokens=False)) + 1
    assert sft["sft/constrained_tokens"] == 2 * n_take
    assert "2 expert turn(s)" not in buf.getvalue() and "4 expert turn(s) took an action" in buf.getvalue()
