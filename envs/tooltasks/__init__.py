"""Tool tasks: envs solved with the tools and sandboxes of ``agentrl.tools``.

- ``agentrl/MathPython-v0``: numeric problems, with ``python`` and ``calculator``;
- ``agentrl/SearchQA-v0``: multi-hop questions over a generated encyclopedia, with ``search``;
- ``agentrl/BashFix-v0``: fix a generated repository's failing test, with ``bash`` and file tools.
"""

from .bash_fix import BashFixEnv, BashFixTask, make_repo, verify_repo
from .math_python import MathPythonEnv, make_math_task
from .search_qa import SearchQAEnv, make_world

__all__ = [
    "BashFixEnv",
    "BashFixTask",
    "MathPythonEnv",
    "SearchQAEnv",
    "make_math_task",
    "make_repo",
    "make_world",
    "verify_repo",
]
