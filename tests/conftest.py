"""Fixtures shared by the serving tests: the small real index of ``serve_fixtures``, a service and an API client,
and the browser tests' browser and screenshot folder; and the suite's offline mode for pretrained weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from serve_fixtures import shared_artifacts

# OpenMP threads (torch, scikit-learn, faiss) that wait for work sleep instead of spinning: on a machine whose cores
# are busy with other work (the suite's own servers and subprocesses, or CI neighbours), spinning threads took
# scikit-learn's t-SNE of 16 points from 0.2 s to 5-45 s and KMeans 50 times longer. Set before any test module loads
# an OpenMP runtime (it reads the variable once); it reaches the tests' subprocesses too.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Tests never download: pretrained weights come from local caches or shipped packages only (a test of the online
# path removes this and fakes the download). Set here, it reaches the CLI's subprocesses too.
os.environ.setdefault("RETRIEVAL_OFFLINE", "1")

# Ray sends no usage statistics from the tests (they never use the network), and Ray Data starts no thread that polls
# for them: that thread outlives ray.shutdown() and logs a traceback every few seconds, and Python 3.11 formats one
# with ast.parse, which is not thread-safe there ("AST constructor recursion depth mismatch" in a test parsing the
# sources at the same time). It reaches the tests' subprocesses and Ray's workers too.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# The serving imports stay inside the fixtures: test modules that never serve (tests/project/test_cuda.py on a GPU
# machine without the web stack, say) must not need fastapi to be collected.


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return shared_artifacts(tmp_path_factory)


@pytest.fixture(scope="module")
def served_from(request) -> str:
    """Where ``service`` serves the index from: the folder, unless a module lists ``SERVED_FROM`` (then each)."""
    return getattr(request, "param", "folder")


def pytest_generate_tests(metafunc):
    backends = getattr(metafunc.module, "SERVED_FROM", None)
    if backends and "served_from" in metafunc.fixturenames:
        metafunc.parametrize("served_from", backends, indirect=True, scope="module")


@pytest.fixture(scope="module")
def service(artifacts, served_from, tmp_path_factory):
    from serve_fixtures import served_by

    yield from served_by(served_from, artifacts, tmp_path_factory)


@pytest.fixture(scope="module")
def client(service):
    from fastapi.testclient import TestClient

    from retrieval.serve.api import create_api

    with TestClient(create_api(service)) as c:
        yield c


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    """Where the browser tests save screenshots: $RETRIEVAL_SCREENSHOTS (the README's are docs/screenshots), else a
    temporary folder; resolved, since a test may change the working folder."""
    folder = Path(os.environ.get("RETRIEVAL_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots")).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium under Playwright for the browser tests' pages (skips when either is missing)."""
    from browser_pages import CHROMIUM, CHROMIUM_ARGS, playwright_or_skip

    with playwright_or_skip().sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield launched
        launched.close()
