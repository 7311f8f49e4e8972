"""Text queries over HTTP and in the app: POST /search and /search/batch with {"text": ...} embedded by the server's
text model and searched as an embedding is (filters and re-ranking apply), bounded (422: empty, too long, lone
surrogates, not a string, two queries at once), a server without a text model saying how to start one, a --text-model
for another image model refused at start, the record of `retrieval index text` taken up at a reload, the OpenAPI
document offering "text" only while the server has a text model (checked by schemathesis), /stats saying so, and the
Search tab's description box. Real index, real ONNX files."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from api_cases import run_checks, valid_case
from click.testing import CliRunner
from fastapi.testclient import TestClient
from sample_images import png_bytes
from serve_fixtures import QUERY_COLOUR, QUERY_PNG, BackgroundServer
from text_towers import own_and_foreign_towers

from retrieval.serve.api import create_api
from retrieval.serve.service import SearchService
from retrieval.serve.service.text import TextQuery
from retrieval.text.text_index import record_text_model
from retrieval.text.text_onnx import TextEmbedder, TextModelError

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def towers(artifacts, tmp_path_factory) -> dict[str, Path]:
    """A text tower for the shared index's image model, and one for another image model."""
    root = tmp_path_factory.mktemp("serve_towers")
    return own_and_foreign_towers(artifacts.index_dir, root, "fedcba9876543210")


@pytest.fixture(scope="module")
def text_service(artifacts, towers):
    service = SearchService(artifacts.index_dir, max_upload_bytes=200_000, text_model=towers["own"],
                            reload_interval_s=None)
    yield service
    service.close()


@pytest.fixture(scope="module")
def text_client(text_service):
    with TestClient(create_api(text_service)) as client:
        yield client


def embedding_of(towers, text: str) -> list[float]:
    return TextEmbedder(towers["own"]).embed([text])[0].tolist()


def ids(response) -> list[int]:
    return [r["id"] for r in response.json()["results"]]


def test_a_text_query_is_searched_as_its_embedding_is(text_client, towers):
    response = text_client.post("/search", json={"text": "  a red apple ", "k": 5})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["count"] == 5 and body["query_item"] is None and body["excluded_self"] is False
    assert {"embed_ms", "search_ms", "total_ms"} <= set(body["timing"])
    same = text_client.post("/search?k=5", json={"embedding": embedding_of(towers, "a red apple")})
    assert ids(response) == ids(same)
    assert np.allclose([r["score"] for r in body["results"]], [r["score"] for r in same.json()["results"]],
                       atol=1e-5)


def test_filters_and_reranking_apply_to_a_text_query(text_client, artifacts):
    label = artifacts.labels[6]
    filtered = text_client.post("/search?k=5", json={"text": "a smiling face", "where": f'label = "{label}"'})
    assert filtered.status_code == 200 and {r["label"] for r in filtered.json()["results"]} == {label}
    in_query = text_client.post("/search", params={"k": 5, "where": f'label = "{label}"'},
                                json={"text": "a smiling face"})
    assert ids(in_query) == ids(filtered)
    reranked = text_client.post("/search?k=4&rerank=qe", json={"text": "a smiling face"})
    assert reranked.status_code == 200 and reranked.json()["rerank"]["method"] == "qe"
    assert all("rerank_score" in r for r in reranked.json()["results"])


@pytest.mark.parametrize(("body", "message"), [
    ({"text": ""}, "text is empty"),
    ({"text": " \n\t "}, "text is empty"),
    ({"text": "x" * 1001}, "at most 1000"),
    ({"text": 5}, "text must be a string"),
    ({"text": None}, "text must be a string (words, in quotes), got null"),
    ({"text": ["a red apple"]}, "text must be a string"),
    ('{"text": "an apple \\ud800"}', "lone surrogate"),
    ({"text": "a red apple", "embedding": [1.0] * 32}, 'not both "embedding" and "text"'),
    ({"text": "a red apple", "image": base64.b64encode(QUERY_PNG).decode()}, 'not both "image" and "text"'),
])
def test_a_text_is_bounded_before_any_work(text_client, body, message):
    if isinstance(body, str):
        response = text_client.post("/search", content=body, headers={"content-type": "application/json"})
    else:
        response = text_client.post("/search", json=body)
    assert response.status_code == 422, response.text
    assert message in response.json()["detail"]


def test_a_batch_embeds_its_texts_together_and_answers_each_in_place(text_client, towers):
    vector = embedding_of(towers, "a dog")
    response = text_client.post("/search/batch?k=3", json={"queries": [
        {"text": "a red apple"}, {"embedding": vector}, {"text": "a dog"},
        {"image": base64.b64encode(QUERY_PNG).decode()}]})
    assert response.status_code == 200, response.text
    answers = response.json()["results"]
    assert [a["count"] for a in answers] == [3, 3, 3, 3]
    assert [r["id"] for r in answers[2]["results"]] == [r["id"] for r in answers[1]["results"]]
    single = text_client.post("/search?k=3", json={"text": "a red apple"})
    assert [r["id"] for r in answers[0]["results"]] == ids(single)
    assert answers[0]["timing"]["batch_size"] == 2  # the two texts in one call of the text model
    bad = text_client.post("/search/batch", json={"queries": [{"text": "a dog"}, {"text": ""}]})
    assert bad.status_code == 422 and bad.json()["detail"].startswith("queries[1]: text is empty")


def test_a_server_without_a_text_model_says_how_to_start_one(client):
    response = client.post("/search", json={"text": "a red apple"})
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert "has no text model" in detail and "--text-model" in detail and "retrieval index text" in detail
    batch = client.post("/search/batch", json={"queries": [{"embedding": [1.0] * 32}, {"text": "a dog"}]})
    assert batch.status_code == 422 and batch.json()["detail"].startswith("queries[1]: this server has no text")
    service = client.get("/stats").json()["service"]
    assert service["text_search"] is False and service["text_model"] is None


def test_stats_name_the_text_model_without_server_paths(text_client, towers, artifacts):
    stats = text_client.get("/stats")
    service = stats.json()["service"]
    assert service["text_search"] is True
    assert service["text_model"] == {"text_model_path": "text.onnx",
                                     "text_model_hash": TextEmbedder(towers["own"]).model_hash,
                                     "image_model_hash": service["model_hash"], "embedding_dim": 32}
    assert str(towers["own"].parent) not in stats.text and str(artifacts.root) not in stats.text


def test_the_openapi_document_offers_text_only_with_a_text_model(text_client, client):
    def bodies(document: dict) -> tuple[dict, dict]:
        search = document["paths"]["/search"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        batch = document["paths"]["/search/batch"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        return search, batch["properties"]["queries"]["items"]

    for schema in bodies(text_client.get("/openapi.json").json()):
        assert schema["properties"]["text"]["maxLength"] == 1000 and schema["properties"]["text"]["minLength"] == 1
        assert {"required": ["text"]} in schema["oneOf"] and len(schema["oneOf"]) == 3
    for schema in bodies(client.get("/openapi.json").json()):
        assert "text" not in schema["properties"] and len(schema["oneOf"]) == 2


def test_a_text_model_for_another_image_model_refuses_the_start(artifacts, towers):
    index_hash = json.loads((artifacts.index_dir / "index.json").read_text())["model_hash"]
    with pytest.raises(TextModelError) as refused:
        SearchService(artifacts.index_dir, text_model=towers["foreign"], reload_interval_s=None)
    assert "fedcba9876543210" in str(refused.value) and index_hash in str(refused.value)
    from retrieval.cli.main import main

    result = CliRunner().invoke(main, ["serve", "--index", str(artifacts.index_dir), "--no-ui", "--text-model",
                                       str(towers["foreign"])])
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"Error: --text-model {towers['foreign']} was trained for image model "
                                    "fedcba9876543210") and index_hash in result.output
    assert "Traceback" not in result.output


def test_a_recorded_text_model_is_taken_up_at_the_next_reload(artifacts, towers, tmp_path):
    index_dir = Path(shutil.copytree(artifacts.index_dir, tmp_path / "index"))
    service = SearchService(index_dir, reload_interval_s=None)
    try:
        with TestClient(create_api(service)) as client:
            assert client.post("/search", json={"text": "a dog"}).status_code == 422
            assert "text" not in json.dumps(client.get("/openapi.json").json()["paths"]["/search"]["post"][
                "requestBody"]["content"]["application/json"]["schema"]["properties"])
            record_text_model(index_dir, towers["own"])
            time.sleep(0.01)  # a new modification time for index.json, whatever the file system's resolution
            assert service.reload()
            answered = client.post("/search?k=3", json={"text": "a dog"})
            assert answered.status_code == 200 and answered.json()["count"] == 3
            assert "text" in client.get("/openapi.json").json()["paths"]["/search"]["post"]["requestBody"][
                "content"]["application/json"]["schema"]["properties"]
            kept = service.current().text.embedder

            info = json.loads((index_dir / "index.json").read_text())  # the recorded file replaced since
            (index_dir / "index.json").write_text(json.dumps(info | {"text_model_hash": "00000000deadbeef"}))
            assert service.reload()
            refused = client.post("/search", json={"text": "a dog"})
            detail = refused.json()["detail"]
            assert refused.status_code == 422 and "cannot search by text now" in detail
            assert "text_model_hash 00000000deadbeef" in detail and str(tmp_path) not in detail
            assert "--text-model" in detail
            stats = client.get("/stats").json()["service"]
            assert stats["text_search"] is False and "00000000deadbeef" in stats["text_model_problem"]

            (index_dir / "index.json").write_text(json.dumps(info))
            assert service.reload() and service.current().text.embedder is not None
            assert service.current().text.embedder is not kept  # a new state loads what it records again
    finally:
        service.close()


def test_the_search_tab_searches_by_description(text_service, service, artifacts, tmp_path):
    import gradio as gr

    from retrieval.serve.ui.search import ExampleSet, SearchTab
    from retrieval.serve.upload_cache import UploadRecords

    tab = SearchTab(text_service, ExampleSet(text_service, tmp_path, count=0), UploadRecords(gr.Blocks()))
    items, status, _ = tab.search(None, 5, text="a red apple")
    assert len(items) == 5 and status.startswith("Searched by the description `a red apple`.")
    expected = text_service.search(TextQuery("a red apple"), 5).results
    assert [caption.rsplit(" · ", 1)[1] for _, caption in items] == [r.path for r in expected]
    label = artifacts.labels[2]
    items, status, _ = tab.search(None, 5, [label], None, "qe", "a red apple")
    assert items and all(f" · {label}" in caption for _, caption in items) and "Re-ranked by" in status
    path = str(artifacts.query_paths[0])
    tab.uploads.blocks.upload_file_set.add(path)
    _, status, _ = tab.search(path, 3, text="a red apple")  # the description wins over the image
    assert "the image was not used" in status
    _, status, _ = tab.search(None, 3, text=" " * 3)  # a blank description, no image: both ways are named
    assert "Upload, paste or pick an image, or describe what you look for in words, first" in status
    _, status, _ = tab.search(None, 3, text="x" * 1001)
    assert status.startswith("⚠️ **Cannot search by text:**") and "at most 1000" in status

    plain = SearchTab(service, ExampleSet(service, tmp_path, count=0), UploadRecords(gr.Blocks()))
    _, status, _ = plain.search(None, 3, text="")  # no text model: only the image is asked for
    assert "Upload, paste or pick an image first" in status
    items, status, _ = plain.search(None, 3, text="a red apple")
    assert items == [] and status.startswith("⚠️ **Cannot search by text:**") and "--text-model" in status
    assert tab.description_settings()["interactive"] is True  # what each page load sets the box to
    off = plain.description_settings()
    assert off["interactive"] is False and "--text-model" in off["info"] and "retrieval index text" in off["info"]


# a fresh process: the server's text search and `retrieval search --text`, then the torch modules they loaded
WITHOUT_TORCH = """
import sys
from retrieval.cli.main import main
from retrieval.serve.service import SearchService
from retrieval.serve.service.text import TextQuery

service = SearchService(sys.argv[1], text_model=sys.argv[2], reload_interval_s=None)
assert len(service.search(TextQuery("a red apple"), k=3).results) == 3
service.close()
main(["search", "--index", sys.argv[1], "--text", "a dog", "--text-model", sys.argv[2], "-k", "2", "--json"],
     prog_name="retrieval", standalone_mode=False)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "torchvision")))[:5])
"""


def test_text_search_loads_no_torch(artifacts, towers):
    result = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, str(artifacts.index_dir), str(towers["own"])],
                            capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-3000:]
    *answer, loaded = result.stdout.strip().splitlines()
    assert loaded == "[]" and len(json.loads("\n".join(answer))[0]["results"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_schemathesis_finds_no_disagreement_on_text_queries(artifacts, text_service):
    """The searches' document with "text" (a server with a text model) against the server: every check, positive and
    negative data, as tests/serve/test_api_contract.py runs them for the rest of the API."""
    import schemathesis
    from schemathesis.engine import StopReason

    from retrieval.serve.server import ServerConfig, build_app

    image = png_bytes((16, 16), QUERY_COLOUR)
    config = schemathesis.Config.from_dict({
        "seed": 2, "request-timeout": 10, "generation": {"max-examples": 20, "database": "none"},
        "cache": {"enabled": False}})
    config.projects.override.checks.update(included_check_names=["all"])
    app, _ = build_app(ServerConfig(index_dir=artifacts.index_dir, ui=False), service=text_service)
    with BackgroundServer(app) as server:
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json", config=config).include(
            path_regex="^/search")

        texts = []  # the positive cases that hold a text query: schemathesis must have sent some

        @schema.hook("map_case")
        def real_image_valid_where_and_one_value(_context, case):
            """The contract test's valid data (``api_cases.valid_case``); the positive cases that hold text kept."""
            positive = case.meta is not None and case.meta.generation.mode.is_positive
            if positive and isinstance(case.body, dict):
                queries = case.body.get("queries") if isinstance(case.body.get("queries"), list) else []
                if "text" in case.body or any(isinstance(query, dict) and "text" in query for query in queries):
                    texts.append(case.body)
            return valid_case(case, image)

        failures, cases, finished = run_checks(schema)
    assert failures == [], "\n\n".join(failures[:10])
    assert finished is not None and finished.stop_reason == StopReason.COMPLETED and cases >= 50, cases
    assert len(texts) >= 5, texts


def test_the_page_says_text_search_is_there_only_where_it_is(text_service, service):
    from retrieval.serve.ui.shared import GalleryFacts

    with_text = GalleryFacts.of(text_service).intro_markdown(text_service)
    assert "describe what you look for in words" in with_text and "an embedding or a text" in with_text
    without = GalleryFacts.of(service).intro_markdown(service)
    assert "describe" not in without and "an image file or an embedding" in without


def test_text_queries_keep_answering_while_the_recorded_text_model_file_is_overwritten_deleted_or_a_fifo(
        artifacts, towers, tmp_path):
    """The served text model is the one read when the state opened: its file overwritten with junk, deleted or
    replaced by a FIFO changes no answer; a reload that finds it so refuses text queries naming the problem (422),
    never a 500, and a FIFO does not block it."""
    index_dir = Path(shutil.copytree(artifacts.index_dir, tmp_path / "index"))
    model = Path(shutil.copy(towers["own"], tmp_path / "text.onnx"))
    record_text_model(index_dir, model)
    service = SearchService(index_dir, reload_interval_s=None)
    try:
        with TestClient(create_api(service)) as client:
            expected = ids(client.post("/search?k=5", json={"text": "a red dog"}))
            for spoil in (lambda: model.write_bytes(b"\x00junk" * 1000), lambda: None, lambda: os.mkfifo(model)):
                model.unlink(missing_ok=True)
                spoil()  # junk in its place, no file, a FIFO
                answer = client.post("/search?k=5", json={"text": "a red dog"})  # the served state's own model
                assert answer.status_code == 200 and ids(answer) == expected, answer.text
                time.sleep(0.01)
                (index_dir / "index.json").touch()
                started = time.monotonic()
                service.reload()  # a new state looks for the recorded file again: a FIFO must not block it
                assert time.monotonic() - started < 10
                answer = client.post("/search?k=5", json={"text": "a red dog"})
                assert answer.status_code in (200, 422), answer.text  # served, or refused naming the problem
                assert answer.status_code == 422 or ids(answer) == expected
                assert client.get("/health").status_code == 200 and client.get("/stats").status_code == 200
    finally:
        service.close()
