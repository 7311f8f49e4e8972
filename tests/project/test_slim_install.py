"""The base install (no extras) searches (by image and by text), serves and indexes without torch; training names the
extra it needs.

One fresh virtual environment for the module (no system site packages): the project is copied and installed into it
with pip, without extras and not editable, as a user who only searches and serves would install it. Its wheels come
from the package index through pip's cache (a minute on the 2-core machine); the test is skipped, saying so, only when
the index cannot be reached. The ONNX model and the gallery are the serving tests' (made by this environment, which
has torch), and so is the small text tower of the text query.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from serve_fixtures import first_health, free_port

REPO = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT = 420
pytestmark = [pytest.mark.slow, pytest.mark.timeout(INSTALL_TIMEOUT + 180)]

# what pip prints when it cannot reach the package index (then the test is skipped, not failed)
UNREACHABLE = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
               "Network is unreachable", "ConnectTimeoutError", "No matching distribution found")
# the repository's top-level folders that are not the project (environments, outputs, caches)
NOT_THE_PROJECT = {".venv", ".git", "build", "dist", "artifacts", "runs", "data", ".pytest_cache", ".ruff_cache",
                   ".hypothesis", ".schemathesis", ".whl", ".gl"}


def copy_project(destination: Path) -> Path:
    """The project's files without environments, outputs and caches (a build in the checkout would write there)."""

    def ignore(folder: str, names: list[str]) -> set[str]:
        top = NOT_THE_PROJECT if Path(folder) == REPO else set()
        return {name for name in names if name in top or name == "__pycache__" or name.endswith(".egg-info")}

    return Path(shutil.copytree(REPO, destination, ignore=ignore))


class SlimEnv:
    """A virtual environment holding the base install; runs its ``retrieval`` command and its Python."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "bin"
        # nothing of this process's environment may leak in: its venv, its import path
        # (and byte code is written: the install leaves it out, so each module compiles once, on first import)
        self.env = {key: value for key, value in os.environ.items()
                    if key not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
        self.env["PATH"] = f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """``retrieval ARGS...`` of the environment."""
        return subprocess.run([str(self.bin / "retrieval"), *args], capture_output=True, text=True, timeout=timeout,
                              env=self.env, cwd=self.root)

    def python(self, code: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bin / "python"), "-c", code], capture_output=True, text=True, timeout=120,
                              env=self.env, cwd=self.root)


def slim_install_command(slim: SlimEnv) -> str:
    """What the base install names to add the train extra: installed from a folder, that folder's (not an index's)."""
    return f"pip install {shlex.quote(str(slim.root.parent / 'project') + '[train]')}"


@pytest.fixture(scope="module")
def slim(tmp_path_factory) -> SlimEnv:
    root = tmp_path_factory.mktemp("slim")
    source = copy_project(root / "project")
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=120)
    env = SlimEnv(root / "venv")
    try:
        # --no-compile: pip byte-compiles every module of every package it installs (gradio, matplotlib, pyarrow...),
        # half the install's time; the few modules these commands import compile when first imported
        # -c: the tested versions (constraints.txt), as make install takes them
        install = subprocess.run([str(env.bin / "python"), "-m", "pip", "install", "--quiet", "--no-compile",
                                  str(source), "-c", str(REPO / "constraints.txt")],
                                 capture_output=True, text=True, timeout=INSTALL_TIMEOUT, env=env.env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"pip install of the base install took over {INSTALL_TIMEOUT} s")
    if install.returncode != 0:
        if any(sign in install.stdout + install.stderr for sign in UNREACHABLE):
            pytest.skip(f"the package index is unreachable, so the base install cannot be installed: "
                        f"{install.stderr.strip().splitlines()[-1]}")
        pytest.fail(f"pip install of the base install failed:\n{install.stderr[-3000:]}")
    return env


@pytest.fixture(scope="module")
def built_index(slim, artifacts) -> Path:
    """An index built by the base install's ``retrieval index build`` with the ONNX model."""
    out = slim.root / "index"
    gallery = artifacts.query_paths[0].parents[1]  # a folder of class folders (emoji, or digits without the fonts)
    result = slim.run("index", "build", "--images", str(gallery), "--model", str(artifacts.model), "--out", str(out),
                      "--workers", "1", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["indexed"] > 0
    return out


def test_the_base_install_has_no_torch(slim):
    result = slim.python("import torch")
    assert result.returncode != 0 and "No module named 'torch'" in result.stderr


def test_the_command_line_and_its_help_work_without_torch(slim):
    for args in ([], ["train"], ["index", "build"], ["serve"]):
        result = slim.run(*args, "--help")
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.startswith("Usage: retrieval"), result.stdout[:500]
    assert slim_install_command(slim) in " ".join(slim.run("train", "--help").stdout.split())


def test_the_base_install_builds_searches_and_exports_an_index(slim, built_index, artifacts):
    query = artifacts.query_paths[0]
    search = slim.run("search", "--index", str(built_index), str(query), "-k", "3", "--json")
    assert search.returncode == 0, search.stderr[-3000:]
    (answer,) = json.loads(search.stdout)
    assert len(answer["results"]) == 3
    assert Path(answer["results"][0]["file"]).resolve() == query.resolve()  # the query is in the gallery

    exported = slim.run("index", "export", str(built_index), "--out", str(slim.root / "table"), "--json")
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert list((slim.root / "table").glob("*.parquet"))


def test_the_base_install_serves_the_api_and_the_app(slim, built_index, artifacts):
    import httpx

    port = free_port()
    server = subprocess.Popen([str(slim.bin / "retrieval"), "serve", "--index", str(built_index), "--port", str(port),
                               "--reload-interval", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=slim.env, cwd=slim.root)
    url = f"http://127.0.0.1:{port}"
    try:
        health = first_health(url, server, 90)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        search = httpx.post(f"{url}/search", params={"k": 2}, timeout=30,
                            files={"image": ("query.png", artifacts.query_paths[0].read_bytes(), "image/png")})
        assert search.status_code == 200, search.text
        assert len(search.json()["results"]) == 2
        assert httpx.get(f"{url}/", timeout=30).status_code == 200  # the Gradio app
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=60)


@pytest.fixture(scope="module")
def text_tower(built_index, tmp_path_factory) -> Path:
    """A small text.onnx (made here, with torch) for the image model of the base install's index."""
    from text_towers import small_text_model

    model_hash = json.loads((built_index / "index.json").read_text())["model_hash"]
    return small_text_model(tmp_path_factory.mktemp("slim_text") / "text.onnx", model_hash, 32)


def test_the_base_install_searches_by_text(slim, built_index, text_tower):
    search = slim.run("search", "--index", str(built_index), "--text", "a red apple", "--text-model", str(text_tower),
                      "-k", "3", "--json")
    assert search.returncode == 0, search.stderr[-3000:]
    (answer,) = json.loads(search.stdout)
    assert answer["query"] == "a red apple" and len(answer["results"]) == 3

    recorded = shutil.copytree(built_index, slim.root / "index-text")  # the other tests keep theirs as built
    assert slim.run("index", "text", str(recorded), "--text-model", str(text_tower)).returncode == 0
    again = slim.run("search", "--index", str(recorded), "--text", "a red apple", "-k", "3", "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout)[0]["results"] == answer["results"]


@pytest.mark.parametrize("args", [["train", "--dataset", "digits", "--out", "run"], ["export", "--checkpoint",
                                                                                    "best.pt", "--out", "m.onnx"]])
def test_a_command_that_trains_names_the_extra_it_needs(slim, args):
    result = slim.run(*args)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"Error: retrieval {args[0]} needs PyTorch, which the base install leaves out: "
                                     f"{slim_install_command(slim)}")
    assert "Traceback" not in result.stderr and not (slim.root / "run").exists()
