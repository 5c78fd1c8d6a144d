"""One job: a package's public names, imported from their modules on first use (PEP 562).

``agentrl.train`` and ``agentrl.policy`` export names whose modules import torch
and transformers. The CLI imports both packages to mount its commands, so an
eager ``__init__`` made ``agentrl envs list`` load torch (2.2 of its 3.4 s).
``from agentrl.train import Trainer`` and ``agentrl.train.Trainer`` still work:
the first use imports the module and keeps the name in the package.

Written by hand, not with ``lazy_loader``: it is one function over the
standard ``importlib``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib import import_module
from importlib.util import find_spec
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: dict[str, list[str]]
                 ) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``__all__``, ``__getattr__`` and ``__dir__`` for ``package``, whose public names are
    ``exports`` (a relative module, such as ``".batch"``, to the names it defines)."""
    where = {name: module for module, names in exports.items() for name in names}
    if len(where) != sum(map(len, exports.values())):
        raise ValueError(f"{package}: a name is exported by two modules")

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:  # a submodule, as an eager __init__ had imported them all: agentrl.train.step
            if not name.startswith("_") and find_spec(f"{package}.{name}") is not None:
                return import_module(f"{package}.{name}")
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(module, package), name)
        setattr(sys.modules[package], name, value)  # the next lookup skips this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return sorted(where), __getattr__, __dir__
