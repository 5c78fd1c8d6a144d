"""The import graph of ``agentrl``: no cycles, and training does not reach into the proxy.

Read statically from the source (every ``import`` and ``from ... import``, at
module level or inside functions; what sits under ``if TYPE_CHECKING:`` is
for type checkers only and is left out), so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"agentrl": ROOT / "agentrl", "agentrl.envs": ROOT / "envs",
            "agentrl.sandboxes": ROOT / "sandboxes", "agentrl.tools": ROOT / "tools"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if pkg == "agentrl" and parts and parts[0] in ("envs", "sandboxes", "tools"):
                continue  # not there: mapped from the top-level folders
            out[name] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The agentrl modules ``name`` imports at run time."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                for a in child.names:
                    found.add(a.name)
            elif isinstance(child, ast.ImportFrom):
                mod = child.module or ""
                if child.level:
                    mod = ".".join(base[:len(base) - child.level + 1] + ([mod] if mod else []))
                found.add(mod)
                for a in child.names:  # ``from pkg import module``
                    found.add(f"{mod}.{a.name}")
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := dfs(m)):
                return found
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (found := dfs(n)):
            return found
    return None


def test_the_graph_reads_lazy_imports_too():
    graph = _graph()
    assert "agentrl.train.sft" in graph["agentrl.train.trainer"]  # imported inside train()
    assert "agentrl.train.batch" in graph["agentrl.train.sft"]


def test_no_import_cycle_between_modules():
    graph = _graph()
    # A package's __init__ re-exports its modules: the cycles that matter run between modules.
    inits = {n for n, path in _modules().items() if path.name == "__init__.py"}
    modules_only = {n: {m for m in e if m not in inits} for n, e in graph.items() if n not in inits}
    assert _cycle(modules_only) is None, _cycle(modules_only)


def test_training_does_not_import_the_proxy():
    graph = _graph()
    bad = {n: sorted(m for m in e if m.startswith("agentrl.proxy")) for n, e in graph.items()
           if n.startswith("agentrl.train")}
    assert not {n: e for n, e in bad.items() if e}


def test_credit_and_losses_know_nothing_of_envs_http_or_the_loop():
    graph = _graph()
    for n, edges in graph.items():
        if n.startswith("agentrl.credit") or n in ("agentrl.train.loss", "agentrl.train.distill.signals"):
            bad = sorted(m for m in edges if m.startswith(("agentrl.envs", "agentrl.proxy", "agentrl.rollout",
                                                           "agentrl.train.trainer", "agentrl.sandboxes")))
            assert not bad, (n, bad)


def test_config_imports_nothing_from_rollout():
    """The config validates each allocator's options (``agentrl.allocator_options``) without
    importing the engine: nothing ``agentrl.config`` reaches, directly or not, is in rollout/."""
    graph = _graph()
    reached, todo = set(), ["agentrl.config"]
    while todo:
        for m in graph[todo.pop()] - reached:
            reached.add(m)
            todo.append(m)
    assert "agentrl.allocator_options" in reached  # the walk follows the config's imports
    assert not sorted(m for m in reached if m.startswith("agentrl.rollout"))


def test_the_learning_step_never_calls_back_into_the_trainer():
    """The run (``train.trainer``) calls the step; nothing under ``agentrl/train`` but the run's
    own entry points imports it back, not even for a type (a type would be a trainer handed down
    to call back into)."""
    above = {"agentrl.train", "agentrl.train.trainer", "agentrl.train.cli"}  # the run and what starts it
    for name, path in _modules().items():
        if not name.startswith("agentrl.train") or name in above:
            continue
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom | ast.Import) for a in n.names}
        modules = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "Trainer" not in names and not any(m.endswith("trainer") for m in modules | names), name


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
