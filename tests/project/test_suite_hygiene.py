"""The test suite's own rules, checked statically over tests/*.py (no test runs): no module imports a test module
(shared helpers live in helper modules or conftest.py, so each test module can run, move or be renamed alone); tests
are named and explained by behaviour, never by a ticket number; and no module defines a test twice (the second
definition silently replaces the first, which then never runs)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections import Counter
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
MODULES = sorted(TESTS.rglob("*.py"))
TEST_MODULE = re.compile(r"^(tests\.)?test_\w+$")
# an import inside code run elsewhere (``python -c`` probes, scripts written by a test)
IMPORT_IN_TEXT = re.compile(r"^\s*(?:from\s+(?:tests\.)?test_\w+\s+import|import\s+(?:tests\.)?test_\w+)", re.MULTILINE)
TICKET_NUMBER = re.compile(r"\b(?:issue|ticket)s?\s*(?:#\s*)?\d+|(?<![\w&])#\d{1,5}\b", re.IGNORECASE)
TICKET_NAME = re.compile(r"(?:^|_)(?:issue|ticket)s?(?:_|$)", re.IGNORECASE)


def imported_test_modules(source: str) -> list[str]:
    """The test modules ``source`` imports: import statements anywhere (functions included), and import lines in
    its string constants."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if TEST_MODULE.match(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if TEST_MODULE.match(node.module):
                found.append(node.module)
            elif node.module == "tests":
                found += [f"tests.{alias.name}" for alias in node.names if TEST_MODULE.match(f"tests.{alias.name}")]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [match.group(0).strip() for match in IMPORT_IN_TEXT.finditer(node.value)]
    return found


def ticket_references(source: str) -> list[str]:
    """Ticket numbers in the comments and docstrings of ``source``, and ticket words in the names of its tests."""
    found = [token.string for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT and TICKET_NUMBER.search(token.string)]
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring and TICKET_NUMBER.search(docstring):
                found.append(docstring.splitlines()[0])
        if (isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and node.name.lower().startswith("test") and TICKET_NAME.search(node.name)):
            found.append(node.name)
    return found


def twice_defined_tests(source: str) -> list[str]:
    """Test functions defined twice in one namespace of ``source`` (the module, or one class)."""
    tree = ast.parse(source)
    found = []
    for scope in [tree, *(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef))]:
        names = Counter(node.name for node in scope.body
                        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"))
        found += [name for name, count in names.items() if count > 1]
    return found


@pytest.mark.parametrize(
    ("check", "offending", "clean"),
    [
        (imported_test_modules, "from {other} import helper\n", "from galleries import helper\n"),
        (imported_test_modules, "import tests.{other}\n", "import tests.galleries\n"),
        (imported_test_modules, "from tests import {other}\n", "from tests import galleries\n"),
        (imported_test_modules, "def f():\n    from tests.{other} import helper\n", "def f():\n    pass\n"),
        (imported_test_modules, 'PROBE = """\n    from {other} import helper\n"""\n', 'PROBE = "print(1)"\n'),
        (ticket_references, "x = 1  # fixed in {ticket}\n", "x = 1  # a plain comment\n"),
        (ticket_references, "x = 1  # see #{number}\n", 'x = "#102030"  # a colour in a string, not a comment\n'),
        (ticket_references, 'def test_x():\n    """{Ticket}: refused."""\n', 'def test_x():\n    """Refused."""\n'),
        (ticket_references, '"""Uploads ({ticket}.{number})."""\n', '"""Uploads."""\n'),
        (ticket_references, "def test_{ticket_word}_defaults():\n    pass\n", "def test_defaults():\n    pass\n"),
        (twice_defined_tests, "def test_a():\n    pass\ndef test_a():\n    pass\n", "def test_a():\n    pass\n"),
        (twice_defined_tests, "class TestX:\n    def test_a(self): ...\n    def test_a(self): ...\n",
         "class TestX:\n    def test_a(self): ...\nclass TestY:\n    def test_a(self): ...\n"),
    ],
)
def test_each_check_finds_what_it_looks_for_and_nothing_else(check, offending, clean):
    # the offending snippets are assembled here, so that this module's own text holds none of them
    parts = {"other": "test_" + "other", "ticket": "issue " + "12", "Ticket": "Issue " + "24", "number": "7",
             "ticket_word": "iss" + "ue"}
    assert check(offending.format(**parts)), offending
    assert check(clean) == [], clean


def offences(check) -> dict[str, list[str]]:
    found = {path.name: check(path.read_text(encoding="utf-8")) for path in MODULES}
    return {name: items for name, items in found.items() if items}


def test_no_module_imports_a_test_module():
    assert offences(imported_test_modules) == {}


def test_tests_are_named_and_explained_without_tracker_numbers():
    assert offences(ticket_references) == {}


def test_no_module_defines_a_test_twice():
    assert offences(twice_defined_tests) == {}


def fixture_names(source: str) -> set[str]:
    """The fixtures ``source`` defines at module level (functions decorated with ``pytest.fixture``)."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in node.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                if isinstance(target, ast.Attribute) and target.attr == "fixture":
                    names.add(node.name)
    return names


def test_no_module_redefines_a_conftest_fixture():
    """A fixture conftest.py shares is used as it is; a module's copy would drift from it."""
    shared = fixture_names((TESTS / "conftest.py").read_text(encoding="utf-8"))
    assert shared and fixture_names('@pytest.fixture(scope="module")\ndef artifacts():\n    pass\n') == {"artifacts"}
    copies = {path.name: sorted(fixture_names(path.read_text(encoding="utf-8")) & shared)
              for path in MODULES if path.name != "conftest.py"}
    assert {name: found for name, found in copies.items() if found} == {}


# a folder per package the tests in it test: the core's parts, the three layers above it, the command line, and
# checks of the whole project
TEST_FOLDERS = {"analysis", "core", "data", "index", "losses", "models", "text", "train", "serve", "export", "cli",
                "project"}


def test_test_modules_sit_in_the_folder_of_the_package_they_test():
    """The tests folder's top holds the shared helpers and conftest; each test module is in its package's folder."""
    misplaced = [str(path.relative_to(TESTS)) for path in TESTS.rglob("test_*.py")
                 if path.parent == TESTS or path.parent.name not in TEST_FOLDERS]
    assert not misplaced, f"test modules outside a package folder of tests/ ({sorted(TEST_FOLDERS)}): {misplaced}"
