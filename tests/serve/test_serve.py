"""Search service, HTTP API (TestClient), Gradio app (gradio_client) and a small load test on a real index."""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image
from sample_images import encode_png
from serve_fixtures import QUERY_PNG, BackgroundServer

from retrieval.data.synthetic import bomb_png
from retrieval.index import Index
from retrieval.onnx_runtime import OnnxEmbedder
from retrieval.serve.api import create_api
from retrieval.serve.batcher import MicroBatcher
from retrieval.serve.images import QueryError
from retrieval.serve.server import ServerConfig, build_app
from retrieval.serve.service.answers import SearchResponse

pytestmark = pytest.mark.timeout(300)


def gallery_relative(artifacts, path) -> str:
    """How responses give a gallery path: relative to the folder holding the whole gallery."""
    root = os.path.commonpath([str(p.resolve().parent) for p in artifacts.query_paths])
    return path.resolve().relative_to(root).as_posix()


def upload(client, data: bytes, k: int | str = 5, name: str = "q.png"):
    return client.post(f"/search?k={k}", files={"image": (name, data, "image/png")})


# --- the service ------------------------------------------------------------------------------------
def test_service_matches_direct_index_search(artifacts, service):
    """Every gallery image finds itself first, with the same ids and scores as Index.search_images."""
    embedder = OnnxEmbedder(artifacts.model)
    with Index.open(artifacts.index_dir, embedder=embedder) as index:
        expected = index.search_images(artifacts.query_paths[:6], k=4)
    for path, want in zip(artifacts.query_paths[:6], expected, strict=True):
        got = service.search(Image.open(path).convert("RGB"), k=4)
        assert [r.id for r in got.results] == [r.id for r in want]
        assert np.allclose([r.score for r in got.results], [r.score for r in want], atol=1e-5)
        assert got.results[0].path == gallery_relative(artifacts, path)
        assert got.results[0].score == pytest.approx(1, abs=1e-4)
        assert {"embed_ms", "search_ms", "total_ms", "batch_size"} <= set(got.timing)


def test_service_excludes_ids_and_accepts_embeddings(artifacts, service):
    vector = OnnxEmbedder(artifacts.model).embed([artifacts.query_paths[0]])[0]
    full = service.search(vector, k=5)
    without_self = service.search(vector * 3.0, k=4, exclude_ids=(full.results[0].id,))  # scale: normalised
    assert [r.id for r in without_self.results] == [r.id for r in full.results[1:5]]
    with pytest.raises(QueryError, match="dimension") as wrong:
        service.search(vector[:-1], k=3)
    assert wrong.value.status == 422
    with pytest.raises(QueryError, match="all zeros"):
        service.search(np.zeros_like(vector), k=3)


def test_concurrent_service_searches_are_batched_and_correct(artifacts, service):
    """16 threads at once: each gets its own image's results (no mix-up inside a shared batch)."""
    images = [Image.open(p).convert("RGB") for p in artifacts.query_paths[:16]]
    barrier = threading.Barrier(16)

    def one(i: int) -> int:
        barrier.wait()
        return service.search(images[i], k=1).results[0].id

    before = service.current().batcher.stats()
    with ThreadPoolExecutor(16) as pool:
        found = list(pool.map(one, range(16)))
    rows = service.current().catalogue.rows(found)
    assert [rows[i]["path"] for i in found] == [str(p.resolve()) for p in artifacts.query_paths[:16]]
    after = service.current().batcher.stats()
    calls, requests = after["model_calls"] - before["model_calls"], after["requests"] - before["requests"]
    assert requests == 16 and calls < 16  # some requests shared a model call
    assert after["largest_batch"] >= 2


def test_batcher_groups_waiting_requests_and_propagates_errors():
    seen: list[int] = []

    def double(batch: np.ndarray) -> np.ndarray:
        seen.append(len(batch))
        if (batch < 0).any():
            raise ValueError("negative input")
        return batch * 2

    batcher = MicroBatcher(double, max_batch=8, max_wait_ms=200)
    try:
        assert np.array_equal(batcher.run(np.ones((1, 2))).embeddings, np.full((1, 2), 2.0))
        slots = [batcher.reservation() for _ in range(3)]
        submits = [slot.__enter__() for slot in slots]  # three callers still preparing their input
        futures = [submit(np.full((1, 2), float(i))) for i, submit in enumerate(submits)]
        for slot in slots:
            slot.__exit__(None, None, None)
        results = [f.result(5) for f in futures]
        assert [r.embeddings[0, 0] for r in results] == [0.0, 2.0, 4.0]
        assert results[0].batch_size == 3 and seen[-1] == 3  # one model call for the three
        with pytest.raises(ValueError, match="negative input"):
            batcher.run(-np.ones((1, 2)))
        assert batcher.run(np.ones((2, 2))).embeddings.shape == (2, 2)  # the worker survived the error
        started = time.perf_counter()
        lone = batcher.run(np.ones((1, 2)))
        assert (
            time.perf_counter() - started < 0.15 and lone.wait_ms < 150
        )  # nobody else coming: no 200 ms wait
    finally:
        batcher.close()


def test_leave_one_out_matches_a_slow_reference(artifacts, service):
    """Per-class Recall@1 against a brute-force loop over the stored embeddings."""
    embedder = OnnxEmbedder(artifacts.model)
    vectors = embedder.embed(artifacts.query_paths)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    labels = artifacts.labels
    correct: dict[str, list[bool]] = {}
    for i in range(len(vectors)):
        best, best_score = None, -np.inf
        for j in range(len(vectors)):
            score = float(np.dot(vectors[i].astype(np.float64), vectors[j].astype(np.float64)))
            if j != i and score > best_score:
                best, best_score = j, score
        correct.setdefault(labels[i], []).append(labels[best] == labels[i])
    loo = service.leave_one_out()
    assert loo.queries == len(vectors)
    assert loo.recall_at_1 == pytest.approx(np.mean([v for vs in correct.values() for v in vs]))
    for c in loo.classes:
        assert c.recall_at_1 == pytest.approx(np.mean(correct[c.label]))
        assert all(f.top1_label != c.label for f in c.failures)
    assert [c.recall_at_1 for c in loo.classes] == sorted(c.recall_at_1 for c in loo.classes)


# --- the HTTP API ------------------------------------------------------------------------------------
def test_search_by_upload_base64_and_embedding(artifacts, client):
    query = artifacts.query_paths[3]
    data = query.read_bytes()
    by_upload = upload(client, data, k=7)
    assert by_upload.status_code == 200, by_upload.text
    body = by_upload.json()
    assert body["k"] == 7 and body["count"] == 7 and len(body["results"]) == 7
    first = body["results"][0]
    assert first["path"] == gallery_relative(artifacts, query) and first["label"] == artifacts.labels[3]
    assert set(first) >= {"id", "score", "label", "path", "image_url"}
    assert body["timing"]["embed_ms"] > 0 and body["timing"]["search_ms"] > 0
    scores = [r["score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True)

    by_base64 = client.post("/search?k=7", json={"image": base64.b64encode(data).decode()})
    assert [r["id"] for r in by_base64.json()["results"]] == [r["id"] for r in body["results"]]
    data_url = client.post(
        "/search?k=2", json={"image": "data:image/png;base64," + base64.b64encode(data).decode()}
    )
    assert data_url.json()["results"][0]["id"] == first["id"]

    vector = OnnxEmbedder(artifacts.model).embed([query])[0].tolist()
    by_embedding = client.post("/search?k=7", json={"embedding": vector})
    assert by_embedding.status_code == 200
    assert [r["id"] for r in by_embedding.json()["results"]] == [r["id"] for r in body["results"]]
    assert "embed_ms" not in by_embedding.json()["timing"]


def test_k_larger_than_gallery_returns_everything(artifacts, client):
    response = upload(client, artifacts.query_paths[0].read_bytes(), k=1000)
    assert response.status_code == 200 and response.json()["count"] == len(artifacts.query_paths)


@pytest.mark.parametrize("k", [0, -1, 1001, "ten"])
def test_k_out_of_range_is_422(artifacts, client, k):
    response = upload(client, artifacts.query_paths[0].read_bytes(), k=k)
    assert response.status_code == 422 and "k" in response.text


@pytest.mark.parametrize(
    ("payload", "status", "message"),
    [
        (b"this is not an image at all", 400, "not an image"),
        (b"", 400, "empty"),
        (QUERY_PNG[:60], 400, "could not be decoded"),  # truncated PNG
        (bomb_png(), 400, "decompression bomb"),  # 200000 x 200000 pixels declared in a tiny file
        (
            encode_png(Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 300, 3), np.uint8))),
            413,
            "over the limit",
        ),
    ],
)
def test_bad_uploads_get_clear_4xx(client, payload, status, message):
    response = upload(client, payload)
    assert response.status_code == status, response.text
    assert message in response.json()["detail"]


def test_pixel_limit_is_a_bomb_guard(client):
    big = encode_png(Image.new("RGB", (2100, 2000), (10, 10, 10)))  # 4.2 MP > 4 MP limit, small file
    response = upload(client, big)
    assert response.status_code == 400 and "decompression bomb" in response.json()["detail"]


def test_oversized_body_is_refused_before_parsing(client):
    response = client.post("/search", content=b"x" * 400_000, headers={"content-type": "application/json"})
    assert response.status_code == 413
    response = client.post("/search", json={"image": base64.b64encode(b"y" * 250_000).decode()})
    assert response.status_code == 413


@pytest.mark.parametrize(
    ("kwargs", "status", "message"),
    [
        ({"json": {"embedding": [0.1, 0.2, 0.3]}}, 422, "dimension"),
        ({"json": {"embedding": [[0.1] * 32]}}, 422, "flat list"),
        ({"json": {"embedding": ["a"] * 32}}, 422, "numbers"),
        ({"json": {"embedding": [0.0] * 32}}, 422, "all zeros"),
        ({"json": {"image": "%%% not base64 %%%"}}, 400, "base64"),
        ({"json": {"something": 1}}, 422, "unknown key(s) in the JSON body: 'something'"),
        ({"json": {}}, 422, '"image"'),
        ({"json": [1, 2]}, 422, "object"),
        ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 400, "not valid JSON"),
        ({"content": b"raw", "headers": {"content-type": "text/plain"}}, 415, "multipart"),
        ({"files": {"other": ("q.png", QUERY_PNG, "image/png")}}, 422, "unknown multipart field(s): 'other'"),
        ({"files": {"image": (None, "text")}}, 400, "must be a file"),
    ],
)
def test_bad_json_and_form_bodies(client, kwargs, status, message):
    response = client.post("/search?k=3", **kwargs)
    assert response.status_code == status, response.text
    assert message in response.json()["detail"]


def test_items_and_item_images(artifacts, client):
    hit = upload(client, artifacts.query_paths[5].read_bytes(), k=1).json()["results"][0]
    item = client.get(f"/items/{hit['id']}")
    assert item.status_code == 200
    assert item.json()["path"] == hit["path"] and item.json()["label"] == artifacts.labels[5]
    image = client.get(hit["image_url"])
    assert image.status_code == 200 and image.headers["content-type"] == "image/png"
    assert image.content == artifacts.query_paths[5].read_bytes()


@pytest.mark.parametrize(
    "path",
    [
        "/items/999999",
        "/items/999999/image",
        "/items/0/image",
        "/items/-1/image",
        "/items/abc/image",
        "/items/../../etc/passwd",
        "/items/..%2F..%2Fetc%2Fpasswd/image",
        "/items/%2e%2e/%2e%2e/etc/passwd",
        "/items/1%00/image",
        "/items/..%252F..%252Fetc%252Fpasswd/image",
        "/items/%2Fetc%2Fpasswd/image",
        "/items/1/../../../etc/passwd",
        "/items/%C2%B2",  # a non-ASCII digit
        "/items/99999999999999999999999/image",  # beyond SQLite's integer range
        "/items/" + "9" * 5000,
    ],
)
def test_items_outside_the_catalogue_are_404(client, path):
    response = client.get(path)
    assert response.status_code == 404, (path, response.status_code, response.text[:200])
    assert b"root:" not in response.content


def test_removed_or_missing_files_are_not_served(artifacts, service, client, tmp_path):
    hit = upload(client, artifacts.query_paths[7].read_bytes(), k=1).json()["results"][0]
    path = artifacts.query_paths[7]
    moved = tmp_path / "moved.png"
    path.rename(moved)
    try:
        assert client.get(f"/items/{hit['id']}/image").status_code == 404
    finally:
        moved.rename(path)
    assert client.get(f"/items/{hit['id']}/image").status_code == 200


def test_stats_and_health(artifacts, client):
    assert upload(client, artifacts.query_paths[0].read_bytes()).status_code == 200  # the batcher counts it
    health = client.get("/health").json()
    assert health == {"status": "ok", "vectors": len(artifacts.query_paths), "embedding_dim": 32}
    stats = client.get("/stats").json()
    assert stats["index"]["vectors"] == len(artifacts.query_paths) and stats["index"]["index_key"] == "Flat"
    assert stats["index"]["recall_1_at_1"] == pytest.approx(1.0)
    assert stats["index"]["latency"]["p50_ms"] > 0
    assert stats["service"]["embedding_dim"] == 32 and stats["limits"]["max_upload_bytes"] == 200_000
    assert stats["batcher"]["requests"] >= 1
    # the yardstick the app reads a query's best score against: each image's best score to another one
    neighbours = stats["index"]["neighbour_similarity"]
    assert neighbours["images"] == len(artifacts.query_paths) and neighbours["quantile"] == 0.01
    assert -1 <= neighbours["floor"] <= neighbours["median"] <= 1


class BlockingService:
    """Stands in for SearchService where a search must stay busy until the test lets it finish."""

    max_upload_bytes, max_pixels = 1000, 1000

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def current(self) -> SimpleNamespace:
        return SimpleNamespace(dim=2)  # the served state's one fact the API reads before a search

    def search(self, query, k, *_, **__):
        self.started.set()
        self.release.wait(30)
        return SearchResponse([], k)


def test_full_queue_answers_503_and_a_free_slot_serves():
    import httpx

    blocking = BlockingService()
    app = create_api(blocking, concurrency=1, max_queue=0)
    with BackgroundServer(app) as server, ThreadPoolExecutor(1) as pool:
        first = pool.submit(httpx.post, server.url + "/search?k=2", json={"embedding": [1, 0]}, timeout=30)
        assert blocking.started.wait(30)
        busy = httpx.post(server.url + "/search?k=2", json={"embedding": [1, 0]}, timeout=30)
        blocking.release.set()
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1" and "busy" in busy.text
        assert first.result().status_code == 200  # the one holding the slot was served
        assert (
            httpx.post(server.url + "/search?k=2", json={"embedding": [1, 0]}, timeout=30).status_code == 200
        )


# --- the whole server: Gradio UI and API on one port -------------------------------------------------
@pytest.fixture(scope="module")
def live_server(artifacts, service):
    app, _ = build_app(ServerConfig(index_dir=artifacts.index_dir, report=artifacts.report), service=service)
    with BackgroundServer(app) as server:
        yield server


def test_gradio_client_search_returns_k_results(artifacts, live_server):
    from gradio_client import Client, handle_file

    client = Client(live_server.url + "/", verbose=False)
    gallery, timing, _query = client.predict(handle_file(str(artifacts.query_paths[2])), 6, [], "",
                                             api_name="/search")
    assert len(gallery) == 6
    assert all(item["image"] and item["caption"] for item in gallery)
    # a gallery example is recognised by its pixels: it is left out of its own results, which are marked
    assert "left out of its own results" in timing
    for item in gallery:  # ✓ exactly for the results with the query's label
        mark, _score, _, label = item["caption"].split(" ")[:4]
        assert mark == ("✓" if label == artifacts.labels[2] else "✗")
    assert f"label **{artifacts.labels[2]}**" in timing


def test_api_and_ui_share_the_port(live_server):
    import httpx

    assert httpx.get(live_server.url + "/health").json()["status"] == "ok"
    page = httpx.get(live_server.url + "/")
    assert page.status_code == 200 and "gradio" in page.text.lower()


def test_traversal_attempts_on_the_full_server_are_404(live_server):
    """Raw request paths (not normalised by a client), with the Gradio app mounted at / behind the API."""
    import http.client

    for path in [
        "/items/../../etc/passwd",
        "/items/..%2F..%2Fetc%2Fpasswd/image",
        "/items/%2e%2e/%2e%2e/etc/passwd",
        "/items/1/../../../../etc/passwd",
        "/items/999999/image",
        "/items/..%5C..%5Cetc%5Cpasswd/image",
        "/../../../../etc/passwd",
    ]:
        connection = http.client.HTTPConnection(live_server.host, live_server.port, timeout=30)
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read()
        connection.close()
        assert response.status in (400, 404), (path, response.status)
        assert b"root:" not in body


def test_load_16_clients_no_errors(artifacts, live_server):
    """A smaller run of benchmarks/serve_load.py: 16 concurrent clients, 96 searches over loopback."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "serve_load", Path(__file__).parents[2] / "benchmarks/serve_load.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    run_load = module.run_load
    result = run_load(
        live_server.url,
        [p.read_bytes() for p in artifacts.query_paths],
        clients=16,
        searches=96,
        k=10,
        time_limit_s=60,
    )
    assert result["errors"] == 0, result["error_examples"]
    assert result["completed"] == 96 and result["p99_ms"] >= result["p50_ms"] > 0


def test_cli_refuses_missing_index_with_the_build_command(tmp_path):
    from click.testing import CliRunner

    from retrieval.cli.serve import serve_command

    result = CliRunner().invoke(serve_command, ["--index", str(tmp_path / "nope")])
    assert result.exit_code != 0 and "make demo" in result.output and "no search index" in result.output


def test_report_table_for_train_and_evaluate_reports(artifacts, tmp_path):
    from retrieval.serve.report_files import load_report
    from retrieval.serve.report_plots import curves_plot, recall_plot, triplet_plot

    train = load_report(artifacts.report)
    headers, rows = train.metrics_table()
    assert headers[0] == "metric" and headers[1] == "start (epoch 0)" and headers[-1] == "last"
    assert [r[0] for r in rows][:4] == ["recall@1", "recall@2", "recall@4", "recall@8"]
    assert {"map@r", "r_precision", "nmi", "f1"} <= {r[0] for r in rows}
    assert recall_plot(train).size[0] > 100 and curves_plot(train).size[0] > 100 and triplet_plot(train)
    metrics = json.loads(artifacts.report.read_text())["last"]
    evaluation = tmp_path / "eval_report.json"
    evaluation.write_text(
        json.dumps(
            {
                "format": "retrieval-report/1",
                "kind": "evaluate",
                "metrics": metrics,
                "checkpoint": str(artifacts.report.parent / "best.pt"),
            }
        )
    )
    report = load_report(evaluation)
    assert report.metrics_table()[0] == ["metric", "metrics"]
    assert recall_plot(report) is not None  # drawn from the metrics
    assert curves_plot(report) is not None  # metrics.jsonl next to the checkpoint
    not_a_report = tmp_path / "x.json"
    not_a_report.write_text("{}")
    with pytest.raises(ValueError, match="not a report"):
        load_report(not_a_report)


def test_the_report_box_only_opens_reports_under_the_allowed_folders(artifacts, service, tmp_path, monkeypatch):
    from retrieval.serve.ui.evaluation import REPORT_REFUSED, EvaluationTab

    monkeypatch.chdir(tmp_path)
    tab = EvaluationTab(service, artifacts.report)
    shown = tab.open_report("/etc/passwd")
    assert shown[0] == REPORT_REFUSED and shown[1]["value"] is None and shown[1]["visible"] is False
    # the pictures' tabs hidden, their pictures and the map's note empty: nothing of another report stays
    assert all(part.constructor_args["visible"] is False for part in shown[2:] if not isinstance(part, dict))
    assert all(not part.get("value") for part in shown[2:] if isinstance(part, dict))
    outside = tmp_path.parent / "elsewhere.json"
    outside.write_text(artifacts.report.read_text())
    try:
        assert tab.open_report(str(outside))[0] == REPORT_REFUSED
    finally:
        outside.unlink()
    assert "Cannot open" not in tab.open_report(str(artifacts.report))[0]  # the configured report opens
    inside = tmp_path / "huge.json"
    inside.write_bytes(b" " * (50 * 2**20 + 1))
    assert tab.open_report(str(inside))[0] == REPORT_REFUSED
