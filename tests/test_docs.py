"""The docs cannot rot: every code block runs, generated pages match the code, the site builds.

The pages are ``docs/*.md`` and ``README.md``. Code blocks, per page, in order, in one temporary folder (``examples/`` linked
into it), with the venv's ``bin`` first on PATH:

- ``python``: run in one namespace per page, so later blocks use earlier names;
- ``bash``/``sh``: run with ``bash -euo pipefail``;
- ``yaml``: loaded as a ``TrainRunConfig`` (a bad key fails), and its allocator
  and credit method built (``make_allocator``, ``ESTIMATORS``);
- ``toml``/``json``: parsed;
- ``text``: a diagram or an output, not code.

A block that must not run carries ``<!-- docs-test: skip -- REASON -->`` on the
line above it; ``<!-- docs-test: sub OLD => NEW -->`` replaces text before the
block runs, to shrink a budget (the page shows the real command);
``<!-- docs-test: needs PROGRAM -->`` runs it only where PROGRAM is on the
PATH (``make test`` installs the agent CLIs), and the page's test is then
reported skipped, with the reason, after its other blocks ran. Any other
language, or none, fails: say what a block is.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [*sorted(DOCS.glob("*.md")), README]  # the README's blocks run too: its env example must stay right
BY_NAME = {p.name: p for p in PAGES}
RUNS = {"python", "bash", "sh", "yaml", "toml", "json"}
NOT_CODE = {"text"}
_FENCE = re.compile(r"^```(\S*)\s*$")
_MARK = re.compile(r"^<!--\s*docs-test:\s*(skip|sub|needs)\b(.*?)-->\s*$")


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    skip: str | None = None
    subs: list[tuple[str, str]] = field(default_factory=list)
    needs: list[str] = field(default_factory=list)


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a page, with the docs-test marks on the lines just above each."""
    lines = path.read_text().splitlines()
    out, marks, i = [], [], 0
    while i < len(lines):
        line = lines[i]
        mark = _MARK.match(line.strip())
        fence = _FENCE.match(line)
        if mark:
            marks.append((mark.group(1), mark.group(2).strip()))
        elif fence:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            b = Block(path.name, i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n")
            for kind, arg in marks:
                if kind == "skip":
                    b.skip = arg.removeprefix("--").strip()
                elif kind == "needs":
                    b.needs += arg.split()
                else:
                    old, sep, new = arg.partition("=>")
                    assert sep, f"{path.name}:{i}: write docs-test: sub OLD => NEW"
                    b.subs.append((old.strip(), new.strip()))
            out.append(b)
            marks, i = [], end
        elif line.strip():
            marks = []  # a mark belongs to the block right below it
        i += 1
    return out


def test_every_block_says_what_it_is_and_every_skip_says_why():
    bad = []
    for page in PAGES:
        for b in blocks(page):
            if b.lang not in RUNS | NOT_CODE:
                bad.append(f"{b.page}:{b.line}: ```{b.lang or '(no language)'}``` (use one of {sorted(RUNS | NOT_CODE)})")
            if b.skip is not None and len(b.skip) < 10:
                bad.append(f"{b.page}:{b.line}: a skipped block must say why")
            for old, _ in b.subs:
                if old not in b.code:
                    bad.append(f"{b.page}:{b.line}: sub {old!r} is not in the block")
    assert not bad, "\n".join(bad)


_DRIVER = textwrap.dedent('''
    import json, subprocess, sys, tomllib

    import yaml

    def check_yaml(code):
        from agentrl.credit import ESTIMATORS
        from agentrl.rollout import make_allocator
        from agentrl.train.config import TrainRunConfig
        cfg = TrainRunConfig.model_validate(yaml.safe_load(code) or {})
        make_allocator(cfg.rollout.allocator)
        assert cfg.train.credit.name in ESTIMATORS or cfg.train.credit.name == "none", cfg.train.credit

    ns = {"__name__": "__main__"}
    for b in json.load(open(sys.argv[1])):
        where = f"{b['page']}:{b['line']}"
        print(f"----- {where} ({b['lang']})", flush=True)
        if b["lang"] == "python":
            exec(compile(b["code"], where, "exec"), ns)
        elif b["lang"] in ("bash", "sh"):
            rc = subprocess.run(["bash", "-euo", "pipefail", "-c", b["code"]]).returncode
            if rc:
                sys.exit(f"{where}: the block exited {rc}")
        elif b["lang"] == "yaml":
            check_yaml(b["code"])
        elif b["lang"] == "toml":
            tomllib.loads(b["code"])
        elif b["lang"] == "json":
            json.loads(b["code"])
''')


@pytest.mark.timeout(900)  # quickstart.md trains twice (tiny model): about 80 s here, more under load
@pytest.mark.parametrize("page", [p.name for p in PAGES if any(
    b.lang in RUNS and b.skip is None for b in blocks(p))])
def test_every_code_block_runs(page, tmp_path):
    import shutil

    todo, missing = [], []
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    for b in blocks(BY_NAME[page]):
        if b.lang not in RUNS or b.skip is not None:
            continue
        if absent := [p for p in b.needs if shutil.which(p, path=path) is None]:
            missing.append(f"{b.page}:{b.line} needs {', '.join(absent)}")
            continue
        code = b.code
        for old, new in b.subs:
            code = code.replace(old, new)
        todo.append({"page": b.page, "line": b.line, "lang": b.lang, "code": code})
    (tmp_path / "blocks.json").write_text(json.dumps(todo))
    (tmp_path / "driver.py").write_text(_DRIVER)
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE", "COLUMNS": "200"}
    res = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "blocks.json")],
                         cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"{page}: a code block failed\n{res.stdout[-6000:]}\n{res.stderr[-6000:]}"
    if missing:
        pytest.skip(f"the other blocks ran; not run: {'; '.join(missing)} (make test installs the agent "
                    "CLIs: .ci/harness-setup.sh)")


def _generate():
    sys.path.insert(0, str(DOCS))
    try:
        import generate
    finally:
        sys.path.remove(str(DOCS))
    return generate


def test_generated_pages_match_the_code():
    stale = [str(p.relative_to(ROOT)) for p, text in _generate().pages().items()
             if not p.exists() or p.read_text() != text]
    assert not stale, f"stale: {stale}; run `python docs/generate.py` and commit the result"


def test_algorithms_page_covers_every_allocator_credit_method_and_signal():
    from typing import get_args

    from agentrl.credit import ESTIMATORS
    from agentrl.rollout import ALLOCATORS
    from agentrl.train.distill import DistillConfig

    text = (DOCS / "algorithms.md").read_text()
    signals = get_args(DistillConfig.model_fields["signal"].annotation)
    names = [*ALLOCATORS, *ESTIMATORS, *signals]
    missing = [n for n in names if f"`{n}`" not in text]
    assert not missing, f"docs/algorithms.md has no paragraph naming {missing}"


def test_files_the_docs_name_exist():
    named = set()
    for page in PAGES:
        named |= set(re.findall(r"`((?:agentrl|envs|sandboxes|tools|tests|bench|examples|docs)/[\w./-]+\.\w+)`",
                                page.read_text()))
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"the docs name files the repo does not have: {missing}"


_SECTIONS = ("policy", "sampling", "env", "rollout", "distributed", "train", "sft")
# a backticked key path, not a call (`policy.agenerate(...)`)
_KEY = re.compile(r"`((?:" + "|".join(_SECTIONS) + r")(?:\.\w+)+)(?![\w.(])")


def _config_key_exists(path: str) -> bool:
    """Whether ``a.b.c`` is a key of ``TrainRunConfig`` (anything below a free-form map is; below
    a union of models, a key of any of them: ``rollout.allocator.depth``)."""
    from agentrl.config import _models_in
    from agentrl.train.config import TrainRunConfig

    models = [TrainRunConfig]
    for part in path.split("."):
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        if not fields:
            return not models  # below a map (env.kwargs.x) anything goes
        models = [sub for f in fields for sub in _models_in(f.annotation)]  # a union: any of its models
    return True


def test_config_keys_the_docs_name_exist():
    """A renamed or removed key leaves no page telling users to set it (old names of renamed
    keys are named only bare, as what the new key was called)."""
    named = {k for page in PAGES for k in _KEY.findall(page.read_text())}
    named |= {k for k in _KEY.findall((ROOT / "docs" / "generate.py").read_text())}
    assert len(named) > 30  # the pattern still finds the keys
    missing = sorted(k for k in named if not _config_key_exists(k))
    assert not missing, f"the docs name config keys that do not exist: {missing}"


def test_site_builds_strict_and_offline(tmp_path):
    try:
        import mkdocs  # noqa: F401
    except ImportError as e:
        pytest.skip(f"mkdocs missing ({e}): pip install -e '.[dev]' (make test does)")
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_PROXY": "*", "no_proxy": "*"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "site" / "architecture" / "index.html").exists()  # --strict failed on any warning


def test_readme_is_a_five_minute_read_and_its_links_resolve():
    """README.md is the entry, not the reference: at most 150 lines (move the rest into docs/),
    and every relative link in it names a file the repo has."""
    text = README.read_text()
    assert len(text.splitlines()) <= 150, "README.md is over 150 lines: move reference material into docs/"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = sorted(x for x in links if "://" not in x and not (ROOT / x).exists())
    assert not missing, f"README.md links to files the repo does not have: {missing}"
