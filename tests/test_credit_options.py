"""agentrl.credit_options and ``train.credit``: one typed options model per credit method, a plain
name or a mapping in the config, the old ``train.credit_options`` folded in with a warning."""

from __future__ import annotations

import pytest

from agentrl.credit import assign
from agentrl.credit_options import (
    CREDIT_OPTIONS,
    GAEOptions,
    GiGPOOptions,
    GRPOOptions,
    NoCreditOptions,
    TreeOptions,
    recorded_credit,
)
from agentrl.errors import ConfigError
from agentrl.train.config import TrainConfig, TrainRunConfig, load_train_config
from agentrl.types import Node, RolloutTree


def _credit(*overrides: str):
    return load_train_config(None, list(overrides)).train.credit


def test_a_plain_name_is_the_method_with_its_defaults_and_a_mapping_sets_options():
    assert TrainConfig().credit == GRPOOptions()
    assert _credit("train.credit=gigpo") == GiGPOOptions() == _credit("train.credit={name: gigpo}")
    got = _credit("train.credit={name: gigpo, gamma: 0.9, omega: 0.5}")
    assert isinstance(got, GiGPOOptions) and (got.gamma, got.omega, got.scale) == (0.9, 0.5, "std")
    # an override below a plain name sets one option of that method
    assert _credit("train.credit=tree", "train.credit.contrastive=true") == TreeOptions(contrastive=True)
    assert _credit("train.credit=none", "train.distill={teacher: expert}") == NoCreditOptions()
    assert TrainConfig(credit="gae", value_head={}).credit == GAEOptions()


def test_every_method_loads_by_name_and_its_dump_loads_back_the_same():
    for name, model in CREDIT_OPTIONS.items():
        cfg = load_train_config(None, [f"train.credit={name}"])
        assert cfg.train.credit == model()
        assert TrainRunConfig.model_validate(cfg.model_dump(mode="json")).train.credit == model()


OLD_AND_NEW = [
    ("grpo", "{eps: 0.001, outcome: success}", "eps: 0.001, outcome: success"),
    ("mc_grpo", "{scale: none}", "scale: none"),
    ("gigpo", "{gamma: 0.95, omega: 1.0, scale: none}", "gamma: 0.95, omega: 1.0, scale: none"),
    ("tree", "{contrastive: true, leaf_norm: none}", "contrastive: true, leaf_norm: none"),
    ("gdpo", "{weights: [1.0, 0.5], batch_norm: false}", "weights: [1.0, 0.5], batch_norm: false"),
    ("returns", "{gamma: 0.9, level: null}", "gamma: 0.9, level: null"),
    ("gae", "{gamma: 0.9, lam: 0.95}", "gamma: 0.9, lam: 0.95"),
]


@pytest.mark.parametrize(("name", "old", "new"), OLD_AND_NEW, ids=[x[0] for x in OLD_AND_NEW])
def test_old_credit_options_load_with_a_warning_naming_the_new_key(name, old, new):
    with pytest.warns(FutureWarning, match=r"train\.credit_options is deprecated.*use train\.credit: "
                      rf"\{{name: {name}, <option>: <value>\}}"):
        before = load_train_config(None, [f"train.credit={name}", f"train.credit_options={old}"])
    after = load_train_config(None, [f"train.credit={{name: {name}, {new}}}"])
    assert before.train.credit == after.train.credit
    assert before.train.credit != CREDIT_OPTIONS[name]()  # the options were not dropped
    assert before.model_dump() == after.model_dump()


def test_old_credit_options_alone_mean_grpo_and_never_mix_with_the_new_form():
    with pytest.warns(FutureWarning, match="train.credit_options"):
        assert _credit("train.credit_options={eps: 0.01}") == GRPOOptions(eps=0.01)
    with pytest.raises(ConfigError, match="give only train.credit"):
        load_train_config(None, ["train.credit={name: gigpo}", "train.credit_options={gamma: 0.9}"])
    with pytest.raises(ConfigError, match="train.credit_options: must be a mapping"):
        load_train_config(None, ["train.credit=gigpo", "train.credit_options=[1]"])


def test_a_bad_option_fails_at_load_naming_its_key_path():
    with pytest.raises(ConfigError, match=r"train\.credit\.gamma: Input should be less than or equal to 1"):
        load_train_config(None, ["train.credit={name: gigpo, gamma: 1.5}"])
    with pytest.raises(ConfigError, match=r"train\.credit\.gama: unknown key \(did you mean 'train\.credit\.gamma'\?\)"):
        load_train_config(None, ["train.credit={name: gigpo, gama: 0.5}"])
    with pytest.raises(ConfigError, match=r"train\.credit\.lam: unknown key"):  # lam is gae's, not returns'
        load_train_config(None, ["train.credit={name: returns, lam: 0.5}"])
    with pytest.raises(ConfigError, match=r"train\.credit\.level: Input should be 'turn', 'group', 'batch' or 'mixed'"):
        load_train_config(None, ["train.credit={name: gae, level: episode}"])
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match=r"train\.credit\.scale: Input should be"):
        load_train_config(None, ["train.credit=gigpo", "train.credit_options={scale: mad}"])


def test_an_unknown_method_lists_the_choices():
    with pytest.raises(ConfigError, match=r"train\.credit: unknown credit method 'gipgo' \(did you mean 'gigpo'\?\); "
                       r"valid: grpo, dr_grpo, rloo, mc_grpo, gigpo, tree, gdpo, returns, gae, none"):
        load_train_config(None, ["train.credit=gipgo"])
    with pytest.raises(ConfigError, match=r"train\.credit: name the credit method"):
        load_train_config(None, ["train.credit={gamma: 0.9}"])


def test_the_credit_rules_still_hold():
    with pytest.raises(ConfigError, match=r"train\.credit: value_fn cannot come from a config: set train\.value_head"):
        load_train_config(None, ["train.credit={name: gae, value_fn: x}"])
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="value_fn cannot come from a config"):
        load_train_config(None, ["train.credit=gae", "train.credit_options={value_fn: x}"])
    with pytest.raises(ConfigError, match="reward_fn cannot come from a config"):
        load_train_config(None, ["train.credit={name: gdpo, reward_fn: x}"])
    with pytest.raises(ConfigError, match="value_head is read by credit: 'gae' only, not 'gigpo'"):
        load_train_config(None, ["train.credit={name: gigpo}", "train.value_head={}"])
    with pytest.raises(ConfigError, match="credit: 'none' leaves nothing to learn from"):
        load_train_config(None, ["train.credit=none"])


def test_the_loaded_options_reach_assign():
    tree = RolloutTree()
    root = tree.add(Node(context_ids=[1], action_ids=[2], reward=0.0))
    for r in (1.0, 0.0):
        tree.add(Node(context_ids=[3], action_ids=[4], reward=r, terminated=True), root.id)
    credit = _credit("train.credit={name: returns, gamma: 0.5, level: null}")
    # rewards [0, 1] -> returns [0.5, 1]; [0, 0] -> [0, 0], not whitened
    assert [tokens for _, tokens in assign([tree], credit)] == [[0, 0.5, 0, 1.0], [0, 0, 0, 0]]


def test_a_recorded_run_names_its_credit_method_in_either_form():
    new = load_train_config(None, ["train.credit={name: gigpo, gamma: 0.9}"]).model_dump(mode="json")["train"]
    name, options = recorded_credit(new)
    assert name == "gigpo" and options["gamma"] == 0.9 and GiGPOOptions(**options).gamma == 0.9
    old = {"credit": "tree", "credit_options": {"contrastive": True}}  # a run recorded before the change
    assert recorded_credit(old) == ("tree", {"contrastive": True})
    assert recorded_credit({}) == ("grpo", {})
