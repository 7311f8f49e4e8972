"""What may import what (docs/ARCHITECTURE.md, "Layers"): checked on every import statement of the source tree,
function-level imports included; no import cycle; how many modules the core's root holds."""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
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


def import_statements(path: Path, module: str, scripts: bool = True) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(module named, names taken from it) of each import statement of ``path``, relative imports resolved: ``import
    a.b`` is ("a.b", ()), ``from a import b, c`` ("a", ("b", "c")); ``scripts=False`` leaves out a top-level ``if
    __name__ == "__main__":`` block, which runs only in the module ``__main__``, one that nothing imports."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    script_only = set() if scripts else {id(node) for block in tree.body if _runs_as_script(block)
                                         for node in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in script_only:
            continue
        if isinstance(node, ast.Import):
            yield from ((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            yield base, tuple(alias.name for alias in node.names)


def _runs_as_script(node: ast.stmt) -> bool:
    """Whether ``node`` is ``if __name__ == "__main__":``."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and [type(op) for op in test.ops] == [ast.Eq]
            and [getattr(c, "value", None) for c in test.comparators] == ["__main__"])


def imported_names(path: Path, module: str) -> set[str]:
    """Every module an import statement of ``path`` names, relative imports resolved."""
    names = set()
    for base, members in import_statements(path, module):
        names.add(base)
        names.update(f"{base}.{member}" for member in members)  # `from pkg import module`
    return names


def import_graph(found: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the modules of ``found`` it imports}, function-level imports included. ``import pkg`` and ``from pkg
    import name`` reach pkg's ``__init__``; ``from pkg import submodule`` reaches the submodule, as ``import
    pkg.submodule`` does. Both also reach the ``__init__`` of each package above it that the importer is not in (Python
    runs those first); not those of its own packages, whose ``__init__`` runs or ran already and may import a
    submodule that imports its siblings meanwhile."""
    graph = {}
    for module, path in found.items():
        home = module if path.name == "__init__.py" else module.rpartition(".")[0]
        arrows = set()
        for base, members in import_statements(path, module, scripts=False):
            submodules = {f"{base}.{member}" for member in members} & found.keys()
            arrows |= submodules
            if not members or len(submodules) < len(members):  # `import pkg`, or a name pkg's __init__ defines
                arrows.add(base)
        arrows |= {above for target in arrows for above in _packages_above(target)
                   if home != above and not home.startswith(above + ".")}
        graph[module] = (arrows & found.keys()) - {module}
    return graph


def _packages_above(module: str) -> list[str]:
    """``a.b.c`` -> ``a``, ``a.b``."""
    parts = module.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts))]


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules of each strongly connected component of more than one module, sorted."""
    reach = {module: _reachable(graph, module) for module in graph}
    components = {frozenset(other for other in reach[module] if module in reach[other])
                  for module in graph if module in reach[module]}
    return sorted(sorted(component) for component in components)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules ``start`` reaches by one arrow or more (itself only through a cycle)."""
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def shortest_loop(graph: dict[str, set[str]], start: str) -> list[str]:
    """The shortest path from ``start`` back to itself (``start`` lies on a cycle)."""
    before: dict[str, str] = {}
    todo = deque([start])
    while todo:
        module = todo.popleft()
        for nxt in sorted(graph[module]):
            if nxt not in before:
                before[nxt] = module
                if nxt == start:
                    path = [start, before[start]]
                    while path[-1] != start:
                        path.append(before[path[-1]])
                    return path[::-1]
                todo.append(nxt)
    raise AssertionError(f"{start} lies on no cycle")


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


def test_no_import_cycle():
    graph = import_graph(ALL)
    cycles = import_cycles(graph)
    assert not cycles, "import cycles; move what both sides share into a module both import:\n" + "\n".join(
        f"{len(cycle)} modules: {', '.join(cycle)} (e.g. {' -> '.join(shortest_loop(graph, cycle[0]))})"
        for cycle in cycles)


def test_the_cycle_check_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": {"b"}, "e": {"a"}, "f": set()}
    assert import_cycles(graph) == [["a", "b", "c", "d"]]
    assert shortest_loop(graph, "d") == ["d", "b", "d"]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_follows_what_python_runs(tmp_path):
    files = {
        "pkg/__init__.py": "from pkg.sub import helper\nfrom pkg.names import NAME\n",
        "pkg/sub.py": "from pkg import sibling\n\ndef helper():\n    from . import late\n",
        "pkg/sibling.py": "",
        "pkg/late.py": "",
        "pkg/names.py": "from pkg import helper\nNAME = 1\n",  # a name the __init__ defines: a real cycle
        "outside.py": "import pkg.sibling\n\nif __name__ == '__main__':\n    import tool\n",
        "tool.py": "import outside\n",
    }
    found = {}
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        found[name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")] = path
    graph = import_graph(found)
    assert graph == {"pkg": {"pkg.sub", "pkg.names"}, "pkg.sub": {"pkg.sibling", "pkg.late"}, "pkg.sibling": set(),
                     "pkg.late": set(), "pkg.names": {"pkg"}, "outside": {"pkg", "pkg.sibling"}, "tool": {"outside"}}
    assert import_cycles(graph) == [["pkg", "pkg.names"]]


# The core's root holds the contracts every layer shares and a few leaves; everything else lives in a subpackage
# (docs/ARCHITECTURE.md, "Layers"). The package's __init__ and __main__ are not counted: every package has them.
MAX_ROOT_MODULES = 12


def test_the_core_root_holds_at_most_twelve_modules():
    root = sorted(path.name for path in (REPO / "retrieval").glob("*.py")
                  if path.name not in {"__init__.py", "__main__.py"})
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules directly in retrieval/ (at most {MAX_ROOT_MODULES})" \
        f": {', '.join(root)}; move one into the subpackage it belongs to"


# The index package keeps the catalogue, the folder's layout and the read side at its root; the rest by role in its
# subpackages (faiss_backend, milvus, embedding, curation, writing, formats: each package's docstring is its map).
MAX_INDEX_ROOT_MODULES = 15
MAX_MODULE_LINES = 500  # a module longer than this holds more than one job: split it by job


def test_the_index_package_root_holds_at_most_fifteen_modules():
    root = sorted(path.name for path in (REPO / "retrieval" / "index").glob("*.py") if path.name != "__init__.py")
    assert len(root) <= MAX_INDEX_ROOT_MODULES, \
        f"{len(root)} modules directly in retrieval/index/ (at most {MAX_INDEX_ROOT_MODULES}): {', '.join(root)}"


def test_every_subpackage_docstring_names_each_of_its_modules():
    missing = []
    for package in (REPO / "retrieval" / "index").glob("*/__init__.py"):
        text = package.read_text()
        missing += [f"{package.parent.name}.{path.stem}" for path in package.parent.glob("*.py")
                    if path.name != "__init__.py" and f"``{path.stem}``" not in text]
    assert not missing, f"not in their package's docstring map: {', '.join(missing)}"


def test_no_product_module_is_over_five_hundred_lines():
    long = [f"{path.relative_to(REPO)} ({lines})" for path in modules().values()
            if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, f"over {MAX_MODULE_LINES} lines: {', '.join(sorted(long))}; split each by job"
