"""What may import what (docs/ARCHITECTURE.md, "Layers"): checked on every import statement of the source tree,
function-level imports included; no import cycle; how many modules the core's root holds."""

from __future__ import annotations

import ast
import re
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


def test_every_package_docstring_maps_its_modules_and_subpackages():
    missing = []
    for init in sorted(path for folder in FOLDERS for path in (REPO / folder).rglob("__init__.py")):
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        parts = [path.stem for path in init.parent.glob("*.py") if path != init]
        parts += [path.parent.name for path in init.parent.glob("*/__init__.py")]
        missing += [f"{init.parent.relative_to(REPO)}: {name}" for name in sorted(parts)
                    if f"``{name}``" not in docstring]
    assert not missing, "each package's docstring maps its modules, one line each (``name``: its job); missing:\n" \
        + "\n".join(missing)


def test_no_product_module_is_over_five_hundred_lines():
    long = [f"{path.relative_to(REPO)} ({lines})" for path in modules().values()
            if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, f"over {MAX_MODULE_LINES} lines: {', '.join(sorted(long))}; split each by job"


# The core's package order: a table in docs/ARCHITECTURE.md, read here (the one place it is written)
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
ORDER_HEADING = "### The core's package order"


def package_order(text: str) -> list[list[str]]:
    """The rows of the package-order table under ``ORDER_HEADING`` in ``text``, bottom first: each row's names
    (its second column's backticked names) as import names under ``retrieval.``."""
    lines = text.split(ORDER_HEADING, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| ---"))
    rows = []
    for line in lines[start + 1:]:
        if not line.startswith("|"):
            break
        rows.append([f"retrieval.{name}" for name in re.findall(r"`([\w.]+)`", line.split("|")[2])])
    return rows


def row_of(module: str, rank: dict[str, int]) -> str | None:
    """The name of the table that places ``module``: the longest that is it or a package above it."""
    parts = module.split(".")
    return next((name for end in range(len(parts), 0, -1) if (name := ".".join(parts[:end])) in rank), None)


def up_arrows(graph: dict[str, set[str]], found: dict[str, Path], rows: list[list[str]]) -> list[str]:
    """Each import of ``graph`` from a module placed by ``rows`` to one in a later row, with its fix; an
    ``__init__`` that imports nothing of ``found`` (a map) is in no row."""
    rank = {name: number for number, row in enumerate(rows, 1) for name in row}
    found_up = []
    for module in sorted(graph):
        home = row_of(module, rank)
        for target in sorted(graph[module]):
            there = row_of(target, rank)
            if home is None or there is None or (found[target].name == "__init__.py" and not graph[target]):
                continue
            if rank[there] > rank[home]:
                found_up.append(
                    f"{module} (row {rank[home]}, `{home.removeprefix('retrieval.')}`) imports {target} (row "
                    f"{rank[there]}, `{there.removeprefix('retrieval.')}`): move what it needs down to row "
                    f"{rank[home]} or below, or move {module.rpartition('.')[2]} up to row {rank[there]} or above")
    return found_up


CORE = {module: path for module, path in ALL.items() if layer_of(module) == "core"}


def test_no_import_runs_up_the_package_order():
    up = up_arrows(import_graph(ALL), ALL, package_order(ARCHITECTURE.read_text()))
    assert not up, f"imports that run up the core's package order (docs/ARCHITECTURE.md, {ORDER_HEADING[4:]!r}):\n" \
        + "\n".join(up)


def test_every_core_package_and_root_module_has_a_row():
    named = {name for row in package_order(ARCHITECTURE.read_text()) for name in row}
    packages = {module for module, path in CORE.items() if path.name == "__init__.py" and module != "retrieval"}
    roots = {module for module, path in CORE.items()
             if path.parent == REPO / "retrieval" and path.name != "__init__.py"}
    assert not (packages | roots) - named, f"give each a row in docs/ARCHITECTURE.md's package order: " \
        f"{', '.join(sorted((packages | roots) - named))}"
    assert not named - CORE.keys(), f"the package order names what does not exist: {sorted(named - CORE.keys())}"


def test_the_package_order_check_finds_a_planted_up_arrow(tmp_path):
    files = {
        "core/__init__.py": "",  # a map: in no row
        "core/low/__init__.py": "from core.low.base import BASE\n",
        "core/low/base.py": "BASE = 1\n",
        "core/low/late.py": "def load():\n    from core.high.top import TOP\n",  # up, inside a function
        "core/mid.py": "from core.low import BASE\nimport core.high.leaf\n",  # leaf is listed low: down
        "core/high/__init__.py": "",
        "core/high/top.py": "from core.mid import *\nTOP = 2\n",
        "core/high/leaf.py": "",
    }
    found = {}
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        found[name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")] = path
    table = (f"{ORDER_HEADING}\n| row | packages and modules | job |\n| --- | --- | --- |\n"
             "| 1 | `high.leaf`, `low` | bottom |\n| 2 | `mid` | |\n| 3 | `high` | top |\n\nafter\n")
    rows = [[name.replace("retrieval.", "core.", 1) for name in row] for row in package_order(table)]
    assert rows == [["core.high.leaf", "core.low"], ["core.mid"], ["core.high"]]
    up = up_arrows(import_graph(found), found, rows)
    assert len(up) == 1 and up[0].startswith("core.low.late (row 1, `core.low`) imports core.high.top (row 3"), up
    assert "move late up to row 3" in up[0]
    rows[0].remove("core.high.leaf")  # the leaf now takes its package's row: the middle imports up to it
    up = up_arrows(import_graph(found), found, rows)
    assert [line.split(" (")[0] for line in up] == ["core.low.late", "core.mid"]
