"""Fixtures shared by the serving tests: the small real index of ``serve_fixtures``, a service and an API client."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from serve_fixtures import shared_artifacts

from serve.api import create_api
from serve.service import SearchService


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return shared_artifacts(tmp_path_factory)


@pytest.fixture(scope="module")
def service(artifacts):
    svc = SearchService(artifacts.index_dir, max_upload_bytes=200_000, max_pixels=4_000_000)
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def client(service):
    with TestClient(create_api(service)) as c:
        yield c
