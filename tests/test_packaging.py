"""Packaging stays honest: every package folder is installed, every __all__ name exists,
and importing agentrl does no heavy work."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAPPING = {"agentrl": "agentrl", "envs": "agentrl.envs", "sandboxes": "agentrl.sandboxes",
           "tools": "agentrl.tools"}


def _package_folders() -> set[str]:
    names = set()
    for folder, prefix in MAPPING.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            names.add(".".join((prefix, *rel)))
    return names


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    missing = _package_folders() - listed
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


@pytest.mark.parametrize("module", sorted(_package_folders()))
def test_all_names_exist(module):
    mod = importlib.import_module(module)
    for name in getattr(mod, "__all__", []):
        assert hasattr(mod, name), f"{module}.__all__ lists {name!r} but it is not defined"


def test_no_generic_top_level_names_are_installed():
    out = subprocess.run([sys.executable, "-c", "import tools"], capture_output=True, cwd="/")
    assert out.returncode != 0


def test_importing_agentrl_loads_no_model_and_no_torch():
    code = "import sys, agentrl; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
