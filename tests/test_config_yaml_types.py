"""A value YAML reads as another type than the text a key takes (``0123`` an octal int,
``1.0`` a float, ``~`` null) is an error that says to quote it."""

from __future__ import annotations

import pytest

from agentrl.errors import ConfigError
from agentrl.train.config import load_train_config


@pytest.mark.parametrize(("override", "read_as"), [
    ("policy.api_key=0123", "the int 83"),  # YAML 1.1: a leading 0 is octal
    ("policy.model=1.0", "the float 1.0"),
    ("rollout.out_dir=~", "null"),  # YAML's ~ is null, not the home folder
    ("policy.served_model=yes", "the bool True"),
])
def test_text_that_yaml_reads_as_another_type_says_to_quote_it(override, read_as):
    key = override.split("=", 1)[0]
    with pytest.raises(ConfigError, match=rf"{key}: Input should be a valid string \(YAML read the value "
                                          rf"as {read_as}: quote it to keep it text\)"):
        load_train_config(overrides=[override])
