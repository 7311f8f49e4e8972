"""Text queries on the server cost what they cost: a batch's texts are charged to the batches lane by their tokens (in
images' worth), so long texts cannot crowd image batches out of its queue, and a batch costlier than that queue is a
422; a text with no word to search by is a 422 (API, app, CLI), not a fixed list; a text model that fails on a query
is a 503 saying so, never a 500. Real index, real text towers (32 and 512 tokens)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient
from sample_images import png_bytes
from serve_fixtures import QUERY_COLOUR, BackgroundServer
from text_towers import small_text_model

from retrieval.cli.main import main
from retrieval.serve.api import create_api
from retrieval.serve.service import SearchService
from retrieval.serve.service.text import text_work

pytestmark = pytest.mark.timeout(300)

LONG = " ".join("abcdefghijklmnopqrstuvwxyz"[i % 26] for i in range(500))  # 1,000 characters, 502 tokens
WORDLESS = ["\u200b", "\x00\x01", "\u00ad", "\u0301", "\ufffd", "\U0001f34e"]


def model_hash(artifacts) -> str:
    import json

    return json.loads((artifacts.index_dir / "index.json").read_text())["model_hash"]


@pytest.fixture(scope="module")
def towers(artifacts, tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("cost_towers")
    return {length: small_text_model(root / f"text{length}.onnx", model_hash(artifacts), 32, max_length=length)
            for length in (32, 512)}


@pytest.fixture(scope="module")
def long_service(artifacts, towers):
    service = SearchService(artifacts.index_dir, text_model=towers[512], reload_interval_s=None)
    yield service
    service.close()


@pytest.mark.parametrize("text", WORDLESS)
def test_a_text_with_no_word_to_search_by_is_a_422(long_service, text):
    with TestClient(create_api(long_service)) as client:
        single = client.post("/search", json={"text": text})
        assert single.status_code == 422 and "has no word to search by" in single.json()["detail"], single.text
        batch = client.post("/search/batch", json={"queries": [{"text": "a red apple"}, {"text": f" {text} "}]})
        assert batch.status_code == 422 and batch.json()["detail"].startswith("queries[1]: text "), batch.text
        assert client.post("/search", json={"text": f"{text} apple"}).status_code == 200


def test_the_app_and_the_command_line_say_a_description_has_no_word(long_service, towers, artifacts, tmp_path):
    import gradio as gr

    from retrieval.serve.ui.search import ExampleSet, SearchTab
    from retrieval.serve.upload_cache import UploadRecords

    tab = SearchTab(long_service, ExampleSet(long_service, tmp_path, count=0), UploadRecords(gr.Blocks()))
    items, status, _ = tab.search(None, 5, [artifacts.labels[0]], text="\u200b\u00ad")
    assert items == [] and status.startswith("⚠️ **Cannot search by text:**") and "no word to search by" in status
    done = CliRunner().invoke(main, ["search", "--index", str(artifacts.index_dir), "--text", "a dog", "--text",
                                     "\ufffd", "--text-model", str(towers[512])])
    assert done.exit_code == 2 and "'--text'" in done.output and "no word to search by" in done.output, done.output


def test_a_batch_of_long_texts_costlier_than_the_lane_queue_is_a_422(long_service):
    with TestClient(create_api(long_service)) as client:
        started = time.perf_counter()
        refused = client.post("/search/batch", json={"queries": [{"text": LONG}] * 64})
        assert refused.status_code == 422 and "its texts cost as much as" in refused.json()["detail"], refused.text
        assert time.perf_counter() - started < 5  # refused before any text is embedded
        fits = client.post("/search/batch", json={"queries": [{"text": LONG}] * 4 + [{"text": "a dog"}] * 60})
        assert fits.status_code == 200 and fits.json()["count"] == 64


def test_one_long_text_search_is_charged_by_its_tokens_in_the_batches_lane(long_service, monkeypatch):
    """A single /search by a long text costs what a batch of it would (images' worth of its tokens) and waits in the
    batches lane, not as one search among the cheap ones; a short text stays a search."""
    from retrieval.serve.admission import WorkLane

    charged = []
    run = WorkLane.run

    async def recorded(self, fn, *args, cost=1, **kwargs):
        charged.append((self.name, cost))
        return await run(self, fn, *args, cost=cost, **kwargs)

    monkeypatch.setattr(WorkLane, "run", recorded)
    with TestClient(create_api(long_service)) as client:
        assert client.post("/search?k=3", json={"text": LONG}).status_code == 200
        long_cost = [entry for entry in charged if entry[0] != "parsing"]
        charged.clear()
        assert client.post("/search?k=3", json={"text": "a dog"}).status_code == 200
        short_cost = [entry for entry in charged if entry[0] != "parsing"]
    tokens = long_service.current().text.embedder.query_tokens([LONG])
    assert long_cost == [("batches", text_work(tokens))] and text_work(tokens) > 1
    assert short_cost == [("searches", 1)]


def test_long_text_batches_cannot_crowd_image_batches_out_of_the_lane(long_service):
    """The lane busy with a batch, long-text batches queue by their tokens: one fits the queue of 128 images' worth,
    the next is refused, and a 2-image batch still finds room (charged a query each, 16 of them filled it)."""
    release, started = threading.Event(), threading.Event()
    real = long_service.search_batch
    eight = {"queries": [{"text": LONG}] * 8}
    cost = text_work([502] * 8)

    def slow_batch(*args, **kwargs):
        started.set()
        release.wait(60)
        return real(*args, **kwargs)

    long_service.search_batch = slow_batch
    answers: dict[str, list[int]] = {"text": [], "holder": []}

    def post(kind: str, **body) -> None:
        answers[kind].append(httpx.post(f"{running.url}/search/batch", timeout=120, **body).status_code)

    try:
        app = create_api(long_service)
        lane = app.state.limits.batches
        assert lane.max_waiting - lane.max_waiting // 16 < cost <= lane.max_waiting  # one such batch fills it
        with BackgroundServer(app) as running:
            holder = threading.Thread(target=post, args=("holder",), kwargs={"json": {"queries": [{"text": "x"}]}})
            holder.start()
            assert started.wait(20)
            senders = [threading.Thread(target=post, args=("text",), kwargs={"json": eight}) for _ in range(16)]
            for sender in senders:
                sender.start()
                time.sleep(0.05)
            deadline = time.monotonic() + 20
            while len(answers["text"]) < 15 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sorted(answers["text"]) == [503] * 15 and lane.waiting == cost, (answers, lane.waiting)
            image = png_bytes((16, 16), QUERY_COLOUR)
            victim = threading.Thread(target=post, args=("holder",),
                                      kwargs={"files": [("image", ("q.png", image, "image/png"))] * 2})
            victim.start()
            time.sleep(0.5)
            assert lane.waiting == cost + 2  # queued, not refused
            release.set()
            for thread in (holder, victim, *senders):
                thread.join(120)
        assert answers["holder"] == [200, 200] and sorted(answers["text"]) == [200] + [503] * 15, answers
    finally:
        long_service.search_batch = real
        release.set()


class Failing:
    """A session that fails as onnxruntime does on a graph it cannot run."""

    def run(self, *args, **kwargs):
        raise RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Non-zero status code returned while "
                           "running Gather node")


def test_a_text_model_that_fails_on_a_query_is_a_503_not_a_500(artifacts, towers):
    service = SearchService(artifacts.index_dir, text_model=towers[32], reload_interval_s=None)
    try:
        service.current().text.embedder.session = Failing()
        with TestClient(create_api(service), raise_server_exceptions=False) as client:
            for route, body in (("/search", {"text": "a red apple"}),
                                ("/search/batch", {"queries": [{"text": "a red apple"}]})):
                answer = client.post(route, json=body)
                assert answer.status_code == 503, answer.text
                assert "text model failed" in answer.json()["detail"] and "Traceback" not in answer.text
    finally:
        service.close()
