"""The project installs one import name, ``retrieval``: the application folders are its subpackages."""

from __future__ import annotations

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
