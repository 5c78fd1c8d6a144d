"""From a hostile review of model loading: a model that cannot load is a ``PolicyError``
naming it, which the commands print as ``error: ...`` with exit code 2, not a traceback."""

from __future__ import annotations

import pytest

from agentrl.errors import PolicyError
from agentrl.models import load_model, load_tokenizer


@pytest.mark.parametrize(("config", "said"), [
    ('{"model_type": "llama"}', "no file named model.safetensors"),   # the weights not copied
    ("{not json", "not a valid JSON file"),                             # a torn copy
    ('{"model_type": "nosuchtype"}', "does not recognize this architecture"),
])
@pytest.mark.parametrize("load", [load_model, load_tokenizer])
def test_a_folder_transformers_cannot_load_is_a_policy_error_naming_it(tmp_path, config, said, load):
    """transformers' OSError or ValueError went up through every command as a traceback (exit 1)."""
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(PolicyError, match=rf"model '{tmp_path}': cannot load its "):
        load(str(tmp_path))
    if load is load_model:
        with pytest.raises(PolicyError, match=said):
            load(str(tmp_path))


def test_a_misspelt_model_name_suggests_the_registered_one():
    with pytest.raises(PolicyError, match=r"unknown model 'tiny-randm' \(did you mean 'tiny-random'\?\)"):
        load_tokenizer("tiny-randm")


def test_a_path_that_does_not_exist_is_said_to_be_missing(tmp_path):
    with pytest.raises(PolicyError, match=rf"model '{tmp_path}/gone': no such folder"):
        load_model(str(tmp_path / "gone"))


def test_a_model_file_instead_of_its_folder_is_said_to_be_a_file(tmp_path):
    """A weights file (model.safetensors, a .gguf) given as policy.model was 'unknown model'."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    with pytest.raises(PolicyError, match=rf"model '{weights}' is a file: give the folder that holds it"):
        load_model(str(weights))
