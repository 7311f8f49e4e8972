"""POST /search/batch against the real server over HTTP: a batch answers exactly what the same
queries sent one by one to POST /search answer (images, embeddings, both mixed, with `where` and exclude_self), its
images go through the model in one call, an unreadable image is answered by an error in its place, and the limits
(queries per batch, body size) are enforced and named."""

from __future__ import annotations

import base64
import socket

import httpx
import numpy as np
import pytest
from PIL import Image
from sample_images import encode_png, png_bytes
from serve_fixtures import QUERY_COLOUR, BackgroundServer

from retrieval.serve.api import create_api
from retrieval.serve.defaults import MAX_BATCH_QUERIES
from retrieval.serve.service.checks import batch_upload_bytes

pytestmark = pytest.mark.timeout(300)
SAME_FIELDS = ("k", "count", "query_item", "excluded_self", "notes")


@pytest.fixture(scope="module")
def server(service):
    with BackgroundServer(create_api(service)) as running:
        yield running


def post_files(server, images: list[bytes], **params):
    files = [("image", (f"q{i}.png", data, "image/png")) for i, data in enumerate(images)]
    return httpx.post(server.url + "/search/batch", params=params, files=files, timeout=60)


def post_json(server, body, **params):
    return httpx.post(server.url + "/search/batch", params=params, json=body, timeout=60)


def one_by_one(server, queries: list[dict], **params) -> list[dict]:
    """The same queries through POST /search, one request each."""
    answers = []
    for query in queries:
        response = httpx.post(server.url + "/search", params=params, json=query, timeout=60)
        assert response.status_code == 200, response.text
        answers.append(response.json())
    return answers


def assert_same(batch: list[dict], single: list[dict]) -> None:
    """Same ids, paths, names and labels in the same order, scores within float noise, the same query facts."""
    assert len(batch) == len(single)
    for got, want in zip(batch, single, strict=True):
        assert {key: got[key] for key in SAME_FIELDS} == {key: want[key] for key in SAME_FIELDS}
        strip = [{key: r[key] for key in ("id", "path", "name", "label", "image_url")} for r in got["results"]]
        assert strip == [{key: r[key] for key in ("id", "path", "name", "label", "image_url")} for r in want["results"]]
        assert np.allclose([r["score"] for r in got["results"]], [r["score"] for r in want["results"]], atol=1e-5)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def embedding(service, seed: int) -> list[float]:
    return np.random.default_rng(seed).standard_normal(service.current().dim).tolist()


def test_a_batch_of_images_answers_what_the_same_searches_answer_one_by_one(server, artifacts):
    images = [path.read_bytes() for path in artifacts.query_paths[:6]]
    single = one_by_one(server, [{"image": b64(data)} for data in images], k=5)
    response = post_files(server, images, k=5)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["count"] == 6 and len(body["results"]) == 6
    assert_same(body["results"], single)
    assert all(answer["query_item"] is not None for answer in body["results"])  # gallery images: identified
    assert {"decode_ms", "embed_ms", "search_ms", "total_ms", "batch_size"} <= set(body["results"][0]["timing"])
    as_json = post_json(server, {"queries": [{"image": b64(data)} for data in images], "k": 5})
    assert as_json.status_code == 200, as_json.text
    assert_same(as_json.json()["results"], single)


def test_exclude_self_applies_to_each_image_query(server, artifacts):
    images = [path.read_bytes() for path in artifacts.query_paths[6:10]]
    single = one_by_one(server, [{"image": b64(data)} for data in images], k=4, exclude_self="true")
    batch = post_files(server, images, k=4, exclude_self="true").json()["results"]
    assert_same(batch, single)
    for answer in batch:  # each query left out its own gallery item, and only that one
        assert answer["excluded_self"] and answer["query_item"]["id"] not in [r["id"] for r in answer["results"]]
        assert answer["count"] == 4
    in_body = post_json(server, {"queries": [{"image": b64(data)} for data in images], "k": 4, "exclude_self": True})
    assert_same(in_body.json()["results"], single)


def test_a_batch_of_embeddings_and_a_mixed_batch(server, service, artifacts):
    queries = [{"embedding": embedding(service, seed)} for seed in range(5)]
    single = one_by_one(server, queries, k=7)
    response = post_json(server, {"queries": queries, "k": 7})
    assert response.status_code == 200, response.text
    assert_same(response.json()["results"], single)
    assert "embed_ms" not in response.json()["results"][0]["timing"]
    mixed = [queries[0], {"image": b64(artifacts.query_paths[11].read_bytes())}, queries[1],
             {"image": b64(artifacts.query_paths[12].read_bytes())}]
    response = post_json(server, {"queries": mixed}, k=3)
    assert response.status_code == 200, response.text
    assert_same(response.json()["results"], one_by_one(server, mixed, k=3))


def test_where_applies_to_every_query(server, service, artifacts):
    labels = sorted({label for _, label in service.current().catalogue.labelled()})
    where = f'label in ("{labels[0]}", "{labels[1]}") or id < 3'
    allowed = set(service.current().index.matching_ids(where).tolist())
    queries = [{"embedding": embedding(service, seed)} for seed in range(3)]
    queries.append({"image": b64(artifacts.query_paths[20].read_bytes())})
    response = post_json(server, {"queries": queries, "where": where, "k": 4})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert all(r["id"] in allowed for answer in results for r in answer["results"])
    assert_same(results, one_by_one(server, [q | {"where": where} for q in queries], k=4))
    uploads = post_files(server, [artifacts.query_paths[20].read_bytes()], k=4, where=where)
    assert_same(uploads.json()["results"], results[-1:])
    conflict = post_json(server, {"queries": queries, "where": "id > 3"}, where="id > 4")
    assert conflict.status_code == 422 and "differs between the JSON body and the query" in conflict.text


def test_an_unreadable_image_is_named_in_its_place_and_the_others_are_answered(server, artifacts):
    good = [artifacts.query_paths[i].read_bytes() for i in (1, 2)]
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 300, 3), np.uint8))
    response = post_files(server, [good[0], b"this is not an image", good[1], encode_png(noise)], k=3)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert response.json()["count"] == 4
    assert results[1]["status"] == 400 and "not an image" in results[1]["error"]
    assert results[3]["status"] == 413 and "over the limit" in results[3]["error"]  # the per-image limit
    assert_same([results[0], results[2]], one_by_one(server, [{"image": b64(data)} for data in good], k=3))
    as_json = post_json(server, {"queries": [{"image": "%%% not base64 %%%"}, {"image": b64(good[0])}], "k": 3})
    assert as_json.status_code == 200, as_json.text
    first, second = as_json.json()["results"]
    assert first == {"error": first["error"], "status": 400} and "not valid base64" in first["error"]
    assert second["count"] == 3


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"queries": []}, 422, f"1 to {MAX_BATCH_QUERIES} queries"),
    ({"queries": {"image": "x"}}, 422, '"queries": a list'),
    ({"image": "x"}, 422, "unknown key(s) in the JSON body: 'image'"),
    ({"queries": [{"embedding": [0.1] * 32}, "x"]}, 422, "queries[1] must be an object"),
    ({"queries": [{"embedding": [0.1] * 32, "image": "x"}]}, 422, "queries[0]: send either"),
    ({"queries": [{"vector": [0.1] * 32}]}, 422, "unknown key(s) in queries[0]: 'vector'"),
    ({"queries": [{"embedding": [0.1] * 32}, {"embedding": [0.1] * 31}]}, 422, "queries[1]: 'embedding'"),
    ({"queries": [{"image": 5}]}, 422, "queries[0]: 'image' must be a string"),
    ({"queries": [{"embedding": [0.1] * 32}], "k": 0}, 422, '"k" must be an integer'),
    ({"queries": [{"embedding": [0.1] * 32}], "exclude_self": "yes"}, 422, '"exclude_self" must be true or false'),
    ({"queries": [{"embedding": [0.1] * 32}], "where": 'label == "x"'}, 422, "position 8"),
    ([1, 2], 422, '{"queries": [{"image": BASE64}'),
])
def test_a_malformed_batch_is_refused_whole_and_the_problem_named(server, body, status, message):
    response = post_json(server, body)
    assert response.status_code == status, response.text
    assert message in response.json()["detail"]


def test_more_queries_than_the_limit_are_refused_naming_it(server, service):
    queries = [{"embedding": embedding(service, 0)}] * (MAX_BATCH_QUERIES + 1)
    response = post_json(server, {"queries": queries})
    assert response.status_code == 422 and f"1 to {MAX_BATCH_QUERIES} queries" in response.json()["detail"]
    files = post_files(server, [png_bytes((8, 8), QUERY_COLOUR)] * (MAX_BATCH_QUERIES + 1))
    assert files.status_code == 422 and f"at most {MAX_BATCH_QUERIES}" in files.json()["detail"]
    at_limit = post_json(server, {"queries": queries[:MAX_BATCH_QUERIES], "k": 2})
    assert at_limit.status_code == 200 and at_limit.json()["count"] == MAX_BATCH_QUERIES


def test_an_oversized_body_is_refused_before_it_is_read(server, service):
    limit = batch_upload_bytes(service.max_upload_bytes) * 4 // 3 + 64 * 1024
    assert limit > service.max_upload_bytes * 4 // 3  # room for many images, unlike POST /search
    with socket.create_connection((server.host, server.port), timeout=30) as sock:  # declare it, send none of it
        sock.sendall(f"POST /search/batch HTTP/1.1\r\nHost: {server.host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {limit + 1}\r\nConnection: close\r\n\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and f"over the limit of {limit} bytes".encode() in answer
    streamed = httpx.post(server.url + "/search/batch", content=iter([b"x" * 2**20] * (limit // 2**20 + 2)),
                          headers={"content-type": "application/json"}, timeout=60)  # chunked: counted as read
    assert streamed.status_code == 413


def test_the_images_of_a_batch_go_through_the_model_in_one_call(server, service, artifacts):
    images = [path.read_bytes() for path in artifacts.query_paths[:40]]  # more than the micro-batcher's max_batch
    batcher = service.current().batcher
    calls, rows, sizes = batcher.calls, batcher.rows, list(batcher.batch_sizes)
    response = post_files(server, images, k=1)
    assert response.status_code == 200, response.text
    assert batcher.calls - calls == 1 and batcher.rows - rows == len(images)
    grown = [i for i, (after, before) in enumerate(zip(batcher.batch_sizes, sizes, strict=True)) if after != before]
    assert grown == [min(len(images), batcher.max_batch + 1)]  # one call of all 40 rows (the slot for > max_batch)
    results = response.json()["results"]
    assert all(answer["timing"]["batch_size"] == len(images) for answer in results)
    assert [answer["results"][0]["id"] for answer in results] == [answer["query_item"]["id"] for answer in results]
    calls = batcher.calls
    post_json(server, {"queries": [{"embedding": embedding(service, 1)}] * 3})
    assert batcher.calls == calls  # embeddings are not embedded again


def test_stats_give_the_batch_limits(server, service):
    limits = httpx.get(server.url + "/stats", timeout=60).json()["limits"]
    assert limits["max_batch_queries"] == MAX_BATCH_QUERIES
    assert limits["max_batch_upload_bytes"] == batch_upload_bytes(service.max_upload_bytes) == 200_000 * 64
