"""The suite runs on the tested versions: constraints.txt pins every distribution ``make install`` puts in .venv (pip,
the project's dependencies with the extras the Makefile names, and theirs), ``make install`` installs with it, and
these tests check the running environment against it, so that a fresh machine or CI that got other versions fails
here, by name, instead of somewhere else (milvus-lite 3 turned its one-file store into a folder).

The one exception to "pinned means installed": the distributions that only some platforms install
(``PLATFORM_SPECIFIC``: torch's CUDA libraries and triton, Linux only) may be missing where nothing installed
requires them. Where something does (Linux), they are checked like every other."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import tomllib
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "constraints.txt"
PROJECT = "retrieval"
# torch's CUDA libraries and triton: its wheels require them on Linux only
PLATFORM_SPECIFIC = re.compile(r"(cuda|nvidia)-.+|triton")
# installed by `make install` itself (its first pip line), not as anyone's dependency
INSTALLED_BY_MAKE = {"pip"}
PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.!]*)")  # NAME==VERSION; no +local, URL or marker
MAKE_INSTALL = re.compile(r'pip install --quiet -e "\.\[([a-z,]+)\]"')


def how_to_fix() -> str:
    return ("To install the tested set: make install (it runs `.venv/bin/python -m pip install -e "
            f"\".[{','.join(make_install_extras())}]\" -c constraints.txt`). To make the versions installed the tested "
            "set on purpose: refresh constraints.txt with the commands in its header, then run make test.")


def pins() -> dict[str, tuple[str, str]]:
    """constraints.txt: canonical name -> (the line, the pinned version)."""
    found: dict[str, tuple[str, str]] = {}
    malformed, repeated = [], []
    for line in CONSTRAINTS.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = PIN.fullmatch(line)
        if not match:
            malformed.append(line)
            continue
        name = canonicalize_name(match.group(1))
        if name in found:
            repeated.append(line)
        found[name] = (line, match.group(2))
    assert not malformed, (f"constraints.txt: every line pins one version from the package index, NAME==VERSION "
                           f"(no local +build, URL, path or marker): {malformed}")
    assert not repeated, f"constraints.txt pins these twice: {repeated}"
    return found


def make_install_extras() -> list[str]:
    install = MAKE_INSTALL.search((REPO / "Makefile").read_text(encoding="utf-8"))
    assert install, "the Makefile's install line was not found"
    return install.group(1).split(",")


def applies(requirement: Requirement, extras: frozenset[str]) -> bool:
    """Whether ``requirement`` holds here for a distribution installed with ``extras``."""
    marker: Marker | None = requirement.marker
    return marker is None or any(marker.evaluate({"extra": extra}) for extra in extras | {""})


def required_here() -> tuple[dict[str, str], list[str]]:
    """What the project with make install's extras requires on this platform and Python, from the installed
    distributions' metadata: canonical name -> a distribution that requires it; and the names required but missing."""
    required_by: dict[str, str] = {PROJECT: "make install"}
    extras_seen: dict[str, frozenset[str]] = {}
    missing: list[str] = []
    todo = [(PROJECT, frozenset(make_install_extras()))]
    while todo:
        name, extras = todo.pop()
        seen = extras_seen.get(name)
        if seen is not None and extras <= seen:
            continue
        extras_seen[name] = extras = extras | (seen or frozenset())
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            missing.append(f"{name} (required by {required_by[name]})")
            continue
        for line in requires:
            requirement = Requirement(line)
            if applies(requirement, extras):
                dependency = canonicalize_name(requirement.name)
                required_by.setdefault(dependency, name)
                todo.append((dependency, frozenset(requirement.extras)))
    return required_by, missing


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def same_version(installed: str, pinned: str) -> bool:
    try:
        return Version(installed) == Version(pinned)
    except InvalidVersion:
        return installed == pinned


def test_every_pinned_distribution_is_installed_at_its_pin():
    required_by, _ = required_here()
    problems = []
    for name, (line, pinned) in sorted(pins().items()):
        installed = installed_version(name)
        if installed is None:
            if name in required_by:
                problems.append(f"{line}: not installed (required by {required_by[name]})")
            elif not PLATFORM_SPECIFIC.fullmatch(name):
                problems.append(f"{line}: not installed, and nothing installed requires it")
        elif not same_version(installed, pinned):
            problems.append(f"{line}: {installed} is installed")
    assert not problems, ("The installed versions are not the tested ones (constraints.txt):\n  "
                          + "\n  ".join(problems) + "\n" + how_to_fix())


def test_every_distribution_the_install_requires_is_pinned_and_installed():
    """A distribution make install brings without a pin would take whatever version a fresh machine finds."""
    required_by, missing = required_here()
    pinned = pins()
    unpinned = sorted(f"{name} (required by {by})" for name, by in required_by.items()
                      if name != PROJECT and name not in pinned)
    stale = sorted(name for name in pinned if name not in required_by and name not in INSTALLED_BY_MAKE
                   and installed_version(name) is not None)
    problems = ([f"not in constraints.txt: {name}" for name in unpinned]
                + [f"required, not installed: {name}" for name in missing]
                + [f"pinned and installed, but nothing requires it: {name}" for name in stale])
    assert not problems, ("constraints.txt does not hold exactly what make install installs:\n  "
                          + "\n  ".join(problems) + "\n" + how_to_fix())


def test_every_dependency_pyproject_names_is_pinned_within_its_range():
    """Each requirement of the base install and of make install's extras has a pin its range accepts (a refresh can
    not pin torch 2.13.0, nor a major past an upper bound)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    requirements = list(project["dependencies"])
    for extra in make_install_extras():
        requirements += project["optional-dependencies"][extra]
    pinned = pins()
    problems = []
    for line in requirements:
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        if name == PROJECT or not applies(requirement, frozenset()):
            continue
        if name not in pinned:
            problems.append(f"{line}: not in constraints.txt")
        elif not requirement.specifier.contains(pinned[name][1], prereleases=True):
            problems.append(f"{line}: constraints.txt pins {pinned[name][0]}, outside the range")
    assert not problems, ("pyproject.toml and constraints.txt disagree:\n  " + "\n  ".join(problems)
                          + "\nPin each in constraints.txt (refresh it with the commands in its header).")


def test_make_install_installs_the_pinned_set():
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    stamp = re.search(r"^\$\(STAMP\):(.*)$", makefile, re.MULTILINE)
    assert stamp and "constraints.txt" in stamp.group(1).split(), "a change to constraints.txt re-installs"
    pip_lines = [line for line in makefile.splitlines() if "-m pip install" in line]
    assert pip_lines and all(" -c constraints.txt" in line for line in pip_lines), pip_lines


def test_the_readme_names_the_pinned_versions():
    """The README's install section names the main versions of the tested set: they are constraints.txt's."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    paragraph = re.search(r"^The versions are one tested set:.*?(?:\n\n|\Z)", readme, re.MULTILINE | re.DOTALL)
    assert paragraph, "the README's paragraph on the tested versions was not found"
    named = re.findall(r"(?<![\w-])([a-z][a-z0-9-]*)\s+(\d+\.\d+\.\d+)\b", paragraph.group(0))  # torch 2.14.1
    assert len(named) >= 5, named
    pinned = {name: version for name, (_, version) in pins().items()}
    wrong = [f"{name} {version} (constraints.txt: {pinned.get(canonicalize_name(name), 'no pin')})"
             for name, version in named if not same_version(version, pinned.get(canonicalize_name(name), ""))]
    assert not wrong, f"README.md names versions other than constraints.txt's pins: {wrong}"
