"""The project installs one import name, ``retrieval``: the application folders are its subpackages; the base install
has no torch, and every extra's distributions are known to ``retrieval.extras``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
APP_FOLDERS = {"train": "retrieval.train", "serve": "retrieval.serve", "export": "retrieval.export",
               "cli": "retrieval.cli"}


def setuptools_config() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_installed_under_retrieval():
    config = setuptools_config()
    assert {folder: package for package, folder in config["package-dir"].items()} == APP_FOLDERS
    expected = set()
    for init in REPO.glob("*/**/__init__.py"):
        folder = init.parent.relative_to(REPO)
        top, *rest = folder.parts
        if top == "retrieval":
            expected.add(".".join(folder.parts))
        elif top in APP_FOLDERS:
            expected.add(".".join([APP_FOLDERS[top], *rest]))
    assert set(config["packages"]) == expected


def test_no_other_top_level_name_is_importable_outside_the_repository(tmp_path):
    code = ("import importlib.util; import retrieval.train, retrieval.serve, retrieval.export, retrieval.cli; "
            "print([n for n in ('train', 'serve', 'export', 'cli') if importlib.util.find_spec(n)])")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def requirement_names(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` name, normalised (``Pillow>=10`` -> ``pillow``), without their extras."""
    return {re.match(r"[A-Za-z0-9._-]+", r).group(0).lower().replace("_", "-") for r in requirements}


def test_the_extras_module_knows_what_each_extra_installs():
    """A command names the extra of a missing module (retrieval.extras): every distribution of the train, track and ray
    extras is known there, under the extra that lists it, and none of the base install is."""
    from retrieval.extras import EXTRA_MODULES

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for extra, modules in EXTRA_MODULES.items():
        assert set(modules.values()) == requirement_names(extras[extra]) - {"retrieval"}, extra
    known = {distribution for modules in EXTRA_MODULES.values() for distribution in modules.values()}
    assert not known & requirement_names(project["dependencies"])


def test_the_base_install_has_no_torch_and_make_install_has_every_extra_the_suite_needs():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not requirement_names(project["dependencies"]) & {"torch", "torchvision", "timm", "tensorboard"}
    assert "torch" in requirement_names(project["optional-dependencies"]["train"])
    install = re.search(r'pip install --quiet -e "\.\[([a-z,]+)\]"', (REPO / "Makefile").read_text())
    assert install and {"train", "dev", "ray", "track"} <= set(install.group(1).split(","))
