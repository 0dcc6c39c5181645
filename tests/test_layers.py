"""The package's folders are its layers (issue 20), and imports only go down them:

    faces (ringshm/: __init__, __main__, cli, demo)
      → server → engine → runtime → model → transport
        → base (ringshm/: errors, config, model_config, generation_params, version, the C extension _C)

A module may import its own folder and the folders below it, never one above or beside it (model may import
transport: the op table a stage answers; transport may not import model). Every import in every module is
read, function-level ones included. The top folder holds only the faces and the base, so an old flat module
path cannot come back unnoticed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ringshm"
FACES = {"ringshm", "ringshm.__main__", "ringshm.cli", "ringshm.demo"}
BASE = {"ringshm.errors", "ringshm.config", "ringshm.model_config", "ringshm.generation_params", "ringshm.version",
        "ringshm._C"}
RANK = {"transport": 1, "model": 2, "runtime": 3, "engine": 4, "server": 5}  # base 0, faces 6


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(name: str) -> tuple[int, str]:
    """(rank, folder) of a module ``ringshm...``; raises for a module that is in no layer."""
    if name in FACES:
        return 6, ""
    if name in BASE:
        return 0, ""
    folder = name.split(".")[1]
    if folder not in RANK:
        raise AssertionError(f"{name} belongs to no layer: put it in a layer folder, or name it a face or base")
    return RANK[folder], folder


def imports_of(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every ringshm module ``path`` imports, at any depth of its code."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "ringshm"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: ``from . import x`` in package p is p.x
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.split(".")[0] != "ringshm":
                continue
            for a in node.names:  # ``from ringshm.transport import ring`` imports the module ringshm.transport.ring
                sub = f"{base}.{a.name}"
                found.append((node.lineno, sub if _is_module(sub) else base))
    return found


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").exists() or (PACKAGE / rel / "__init__.py").exists() or name in BASE


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_the_top_folder_holds_only_the_faces_and_the_base():
    top = {module_name(p) for p in PACKAGE.glob("*.py")}
    assert top <= FACES | BASE, f"modules outside any layer folder: {sorted(top - FACES - BASE)}"
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(RANK)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_module_imports_only_its_own_folder_and_the_folders_below(path):
    here = module_name(path)
    rank, folder = layer(here)
    wrong = []
    for line, name in imports_of(path):
        their_rank, their_folder = layer(name)
        if their_rank > rank or (their_rank == rank and their_folder != folder and rank not in (0, 6)):
            wrong.append(f"line {line}: {name}")
    assert not wrong, f"{here} ({folder or 'top'}) imports upward or sideways: {wrong}"


def test_every_folder_says_what_it_is_for_and_what_it_may_import():
    for folder in RANK:
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or ""
        assert "May import" in doc and len(doc.splitlines()) <= 3, f"ringshm/{folder}/__init__.py: {doc!r}"
