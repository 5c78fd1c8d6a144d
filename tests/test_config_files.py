"""A config file that is not UTF-8 text is a ``ConfigError`` naming the file, not a traceback."""

from __future__ import annotations

import pytest

from agentrl.config import load_config
from agentrl.errors import ConfigError


def test_a_config_saved_as_latin_1_is_an_error_naming_the_file_and_the_byte(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b'rollout:\n  system_prompt: "caf\xe9"\n')  # an editor's Latin-1 "cafe" with an accent
    with pytest.raises(ConfigError, match=rf"cannot read config {path}: it is not UTF-8 text "
                                          r"\(byte 0xe9 at offset 30\); save it as UTF-8"):
        load_config(path)

