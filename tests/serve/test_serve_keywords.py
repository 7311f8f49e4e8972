"""Text queries over HTTP on an index with a keyword index (`index build --text-columns`): answered by keywords
alone on a server with no text model, fused with the text model's ranks on one with it; each result's ``source``
in POST /search and /search/batch, filters kept, hostile text answered (never a 500), the client reading it. Real
index, real ONNX models."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from keyword_catalogue import build_catalogue_index, ids_by_title
from text_towers import small_text_model

from retrieval.client.results import SearchResults
from retrieval.serve.api import create_api
from retrieval.serve.service import SearchService

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_keywords")
    index_dir, _ = build_catalogue_index(root)
    model_hash = json.loads((index_dir / "index.json").read_text())["model_hash"]
    return index_dir, ids_by_title(index_dir), small_text_model(root / "text.onnx", model_hash, 24)


@pytest.fixture(scope="module")
def keywords_only(catalogue):
    service = SearchService(catalogue[0], max_upload_bytes=200_000, reload_interval_s=None)
    with TestClient(create_api(service)) as client:
        yield client
    service.close()


@pytest.fixture(scope="module")
def fused(catalogue):
    service = SearchService(catalogue[0], max_upload_bytes=200_000, text_model=catalogue[2], reload_interval_s=None)
    with TestClient(create_api(service)) as client:
        yield client
    service.close()


def test_a_server_without_a_text_model_answers_by_keywords(keywords_only, catalogue):
    by_title = catalogue[1]
    response = keywords_only.post("/search", json={"text": "claw hammers", "k": 5})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["id"] for r in results] == [by_title["Claw hammer, steel"]] and results[0]["source"] == "keyword"
    assert SearchResults.from_json(response.json()).hits[0].source == "keyword"


def test_a_batch_of_texts_is_answered_per_query_with_filters(keywords_only, catalogue):
    by_title = catalogue[1]
    response = keywords_only.post("/search/batch", json={"queries": [{"text": "garden"}, {"text": "mallet"}],
                                                         "where": 'brand = "Bosch"'})
    assert response.status_code == 200, response.text
    answers = response.json()["results"]
    assert [r["id"] for r in answers[0]["results"]] == [by_title["Garden hose 20 m"]]
    assert [r["id"] for r in answers[1]["results"]] == [by_title["Rubber mallet"]]


@pytest.mark.parametrize("text", ['title:x NEAR("a" b) *', "\u0000 garden", "🔨" * 300, '"' * 999, "c0: AND OR"])
def test_hostile_text_is_answered_never_a_server_error(keywords_only, fused, text):
    for client in (keywords_only, fused):
        response = client.post("/search", json={"text": text, "k": 3})
        assert response.status_code in (200, 422), response.text


def test_with_a_text_model_each_hit_says_where_it_came_from(fused, catalogue):
    by_title = catalogue[1]
    response = fused.post("/search", json={"text": "garden shears", "k": 5})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert len(results) == 5 and results[0]["id"] == by_title["Garden shears"]
    assert results[0]["source"] in ("keyword", "both") and "vector" in {r["source"] for r in results}
    batch = fused.post("/search/batch", json={"queries": [{"text": "garden shears"}], "k": 5})
    assert batch.status_code == 200, batch.text
    body = batch.json()
    first = body["results"][0]["results"]
    assert [r["id"] for r in first] == [r["id"] for r in results]
    assert [r["source"] for r in first] == [r["source"] for r in results]
