"""What may import what (docs/ARCHITECTURE.md, "Layers"): checked on every import statement of the source tree,
function-level imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# folder -> import name of the package it installs as (pyproject's package-dir)
FOLDERS = {"retrieval": "retrieval", "train": "retrieval.train", "serve": "retrieval.serve",
           "export": "retrieval.export", "cli": "retrieval.cli"}
APPS = ("retrieval.train", "retrieval.serve", "retrieval.export", "retrieval.cli")
# layer -> the application layers it may import (every layer may import the core)
MAY_IMPORT = {
    "core": set(),
    "retrieval.train": set(),
    "retrieval.export": set(),
    "retrieval.serve": set(),
    "retrieval.cli": set(APPS),
}


# `python -m retrieval` starts the command line: it belongs to the CLI's layer
ENTRY_POINTS = {"retrieval.__main__": "retrieval.cli"}


def layer_of(module: str) -> str:
    """The layer a module belongs to: one of APPS, or "core"."""
    if module in ENTRY_POINTS:
        return ENTRY_POINTS[module]
    return next((app for app in APPS if module == app or module.startswith(app + ".")), "core")


def modules() -> dict[str, Path]:
    """{import name: file} of every module the project installs."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imported_names(path: Path, module: str) -> set[str]:
    """Every module an import statement of ``path`` names, relative imports resolved."""
    names = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return names


ALL = modules()


@pytest.mark.parametrize("module", sorted(ALL))
def test_each_module_imports_only_what_its_layer_may(module):
    own = layer_of(module)
    allowed = MAY_IMPORT[own] | {own}
    bad = sorted(name for name in imported_names(ALL[module], module)
                 if name.split(".")[0] in {"retrieval", *FOLDERS} and layer_of(name) not in allowed | {"core"})
    assert not bad, f"{module} ({own}) may not import {bad}"


def test_no_module_imports_the_old_top_level_names():
    bad = {module: sorted(n for n in imported_names(path, module) if n.split(".")[0] in set(FOLDERS) - {"retrieval"})
           for module, path in ALL.items()}
    assert not {m: names for m, names in bad.items() if names}
