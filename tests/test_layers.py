"""The architecture as tests: the declared import layers (import-linter, ``[tool.importlinter]`` in pyproject.toml),
no import cycle, no private name imported across modules, no recipe probed for what it has, a recipe as hooks plus
capabilities, a loop that fits on one screen, and docstrings and comments that say what the code does rather than
when or where it was measured."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import grimp

from conftest import REPO

PACKAGE = REPO / "finetune"
SOURCES = sorted(PACKAGE.rglob("*.py"))


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_import_layers_are_kept():
    proc = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "2 kept, 0 broken" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_the_independence_contract_catches_one_recipe_importing_another(tmp_path):
    """The ``independence`` contract is live: in a copy of the package where ``kto`` imports ``sft`` (through a
    shared-looking module, so the import is indirect), ``lint-imports`` breaks the contract and names both."""
    import shutil

    shutil.copytree(PACKAGE, tmp_path / "finetune", ignore=shutil.ignore_patterns("__pycache__", "configs"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "finetune" / "recipes" / "common" / "borrowed.py").write_text(
        "from finetune.recipes.sft import RECIPE  # noqa: F401\n")
    kto = tmp_path / "finetune" / "recipes" / "kto.py"
    kto.write_text(kto.read_text() + "\nfrom finetune.recipes.common import borrowed  # noqa: E402,F401\n")
    proc = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 1 and "1 kept, 1 broken" in out, out[-4000:] + proc.stderr[-2000:]
    assert "finetune.recipes.kto is not allowed to import finetune.recipes.sft" in out, out[-4000:]


def test_no_import_cycle():
    graph = grimp.build_graph("finetune", cache_dir=None)
    modules = sorted(graph.modules)
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph.find_modules_directly_imported_by(m)):
            if not n.startswith("finetune"):
                continue
            assert state.get(n) != 1, "import cycle: " + " -> ".join(path[path.index(n):] + [n]) if n in path else n
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in modules:
        if m not in state:
            visit(m, [m])


def test_no_private_name_crosses_modules():
    crossings = []
    for path in SOURCES + sorted((REPO / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("finetune"):
                crossings += [f"{path.relative_to(REPO)}:{node.lineno} {node.module}.{a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    assert not crossings, crossings


def test_no_recipe_is_probed_for_what_it_has():
    probes = [f"{p.relative_to(REPO)}:{i}" for p in SOURCES for i, line in enumerate(p.read_text().splitlines(), 1)
              if re.search(r"(hasattr|getattr)\(recipe\s*,", line)]
    assert not probes, probes


def test_a_recipe_is_hooks_plus_capabilities():
    """``Recipe`` holds its name, model class and :class:`Capabilities`, and otherwise only hooks (functions, or
    ``None`` for a hook whose default is ``None``); ``Capabilities`` holds only constants, and the parallel
    dimensions a recipe declares are ``DIMENSION`` names of :mod:`finetune.parallel`'s modules."""
    import dataclasses
    import importlib
    import pkgutil

    import pytest

    import finetune.parallel
    from finetune.recipes import RECIPES, Capabilities, Recipe, get_recipe

    known = {m.DIMENSION for info in pkgutil.iter_modules(finetune.parallel.__path__)
             if hasattr(m := importlib.import_module(f"finetune.parallel.{info.name}"), "DIMENSION")}
    assert {"sequence", "tensor"} <= known
    plain = {"name", "model_class", "capabilities"}
    hooks = [f for f in dataclasses.fields(Recipe) if f.name not in plain]
    assert [f.name for f in dataclasses.fields(Recipe)][:3] == ["name", "model_class", "capabilities"]
    assert all(str(f.type).startswith("Callable") for f in hooks), [(f.name, f.type) for f in hooks]
    assert not [f.name for f in dataclasses.fields(Capabilities) if "Callable" in str(f.type)]
    for name in RECIPES:
        r = get_recipe(name)
        assert r.name == name and isinstance(r.capabilities, Capabilities)
        hash(r.capabilities)  # plain, frozen data
        assert r.capabilities.parallel <= known, (name, r.capabilities.parallel - known)
        odd = [f.name for f in hooks if not (callable(getattr(r, f.name)) or getattr(r, f.name) is f.default is None)]
        assert not odd, (name, odd)
    with pytest.raises(TypeError):
        Capabilities(parallel="sequence")  # a str would answer "in" by substring


def test_the_loop_fits_one_screen_and_the_cli_only_dispatches():
    from finetune.training import trainer

    assert len(inspect.getsource(trainer.fit).splitlines()) <= 75  # docstring included
    assert len((PACKAGE / "cli.py").read_text().splitlines()) <= 80


def test_docstrings_and_comments_carry_no_history():
    """Measured figures live in docs/performance.md, history in CHANGELOG.md: no commit hash, date, issue number or
    "measured on" sentence in the package's docstrings and comments."""
    patterns = {"commit hash": r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}\b",
                "date": r"\b20[12]\d-\d\d(-\d\d)?\b", "issue number": r"\bissue \d+", "measurement": r"\bmeasured on\b",
                "who wrote it": r"\bsessions? that wrote\b|\bwas lent\b|\bwho wrote (it|this)\b"}
    found = []
    for path in SOURCES:
        text = path.read_text()
        prose = [node.value for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Constant)
                 and isinstance(node.value, str) and "\n" in node.value]  # docstrings (and other long strings)
        prose += [line.split("#", 1)[1] for line in text.splitlines() if "#" in line and not line.strip().startswith("\"")]
        for what, pattern in patterns.items():
            found += [f"{path.relative_to(REPO)}: {what}: {m.group(0)!r}" for chunk in prose
                      for m in re.finditer(pattern, chunk, re.I)]
    assert not found, found


def test_no_recipe_is_named_outside_the_recipes():
    """Generic code asks a recipe's Capabilities and hooks, never its name: adding a recipe touches one place."""
    named = []
    for path in SOURCES:
        if "recipes" in path.parts:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"recipe\s*(==|!=)\s*['\"]|recipe\s+(not\s+)?in\s+[(\[{]\s*['\"]", line):
                named.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not named, named
