"""POST /search with a `where` filter, against the real server over HTTP: exactly the top-k of
the matching rows (the fixture's index is Flat), in the JSON body or the query, with an upload too; a filter
matching nothing gives no results; a malformed one is a 422 that names the problem. Each test runs on the index
folder and on the same index pushed into a Milvus collection (FLAT)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from serve_fixtures import BACKENDS, BackgroundServer

from retrieval.serve.api import create_api

SERVED_FROM = BACKENDS  # each test on the index folder and on a Milvus collection of it


@pytest.fixture(scope="module")
def server(service):
    with BackgroundServer(create_api(service)) as running:
        yield running


def exact_filtered(service, embedding: np.ndarray, where: str, k: int) -> list[int]:
    """The slow top-k: every matching vector, scored with the query, best first."""
    index = service.current().index
    matching = index.matching_ids(where)
    vectors = index.reconstructed_vectors(matching)
    query = embedding / np.linalg.norm(embedding)
    return [int(matching[j]) for j in np.argsort(-(vectors @ query), kind="stable")[:k]]


def some_embedding(service, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(service.current().dim).astype(np.float32)


def test_the_json_where_gives_the_exact_top_k_of_the_matching_rows(server, service):
    labels = sorted({label for _, label in service.current().catalogue.labelled()})
    where = f'label in ("{labels[0]}", "{labels[1]}", "{labels[2]}") or id < 5'
    for seed in range(3):
        embedding = some_embedding(service, seed)
        body = {"embedding": embedding.tolist(), "k": 4, "where": where}
        response = httpx.post(server.url + "/search", json=body, timeout=30)
        assert response.status_code == 200, response.text
        assert [r["id"] for r in response.json()["results"]] == exact_filtered(service, embedding, where, 4)


def test_where_in_the_query_filters_an_upload(server, service, artifacts):
    query = artifacts.query_paths[0]
    split = "test" if len(service.current().index.matching_ids('split = "test"')) else None
    where = f'split = "{split}"' if split else f'label = "{artifacts.labels[0]}"'
    with open(query, "rb") as handle:
        response = httpx.post(server.url + "/search", params={"k": 5, "where": where},
                              files={"image": ("q.png", handle, "image/png")}, timeout=30)
    assert response.status_code == 200, response.text
    allowed = set(service.current().index.matching_ids(where).tolist())
    results = response.json()["results"]
    assert results and all(r["id"] in allowed for r in results)


def test_a_filter_matching_nothing_gives_an_empty_result(server, service):
    body = {"embedding": some_embedding(service).tolist(), "where": 'label = "no such label"'}
    response = httpx.post(server.url + "/search", json=body, timeout=30)
    assert response.status_code == 200 and response.json()["count"] == 0 and response.json()["results"] == []


@pytest.mark.parametrize(("where", "message"), [
    ('label == "x"', "expected a quoted string or a number at position 8"),
    ('label = "x"; DELETE FROM images', "unexpected character ';'"),
    ("colour = 'red'", "no column 'colour' in this index; the columns are: id, path, label"),
    ("label = 3", "column 'label' holds text"),
    (5, '"where" must be a string expression'),
    ("x" * 5000, "at most 4000"),
])
def test_a_malformed_filter_is_a_422_that_names_the_problem(server, service, where, message):
    body = {"embedding": some_embedding(service).tolist(), "where": where}
    response = httpx.post(server.url + "/search", json=body, timeout=30)
    assert response.status_code == 422, response.text
    assert message in response.json()["detail"]


def test_body_and_query_filters_must_agree(server, service):
    body = {"embedding": some_embedding(service).tolist(), "where": "id > 3"}
    response = httpx.post(server.url + "/search", params={"where": "id > 4"}, json=body, timeout=30)
    assert response.status_code == 422 and "differs between the JSON body and the query" in response.json()["detail"]
    same = httpx.post(server.url + "/search", params={"where": "id > 3"}, json=body, timeout=30)
    assert same.status_code == 200
