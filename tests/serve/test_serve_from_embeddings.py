"""Serving an index built from embeddings (`retrieval index build --embeddings`): it has no model, so POST /search
answers an "embedding" and refuses an image (one query or a batch) with a 422 that says what to send; /stats and
/health work; the app's upload is refused with the same words."""

from __future__ import annotations

import base64

import gradio as gr
import numpy as np
import pytest
from fastapi.testclient import TestClient
from index_builds import write_embeddings_folder
from sample_images import png_bytes

from retrieval.index import build_from_embeddings
from retrieval.index.embedding.engine import IngestOptions
from retrieval.serve.api import create_api
from retrieval.serve.service import SearchService
from retrieval.serve.ui.search import ExampleSet, SearchTab
from retrieval.serve.upload_cache import UploadRecords

DIM = 16


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served_embeddings")
    vectors = np.random.default_rng(0).standard_normal((30, DIM)).astype(np.float32)
    metadata = {"path": [f"photos/{i}.jpg" for i in range(30)], "label": [f"c{i % 3}" for i in range(30)]}
    write_embeddings_folder(root / "in", [vectors], [metadata])
    build_from_embeddings(root / "in", root / "idx", options=IngestOptions(progress=False))
    service = SearchService(root / "idx", reload_interval_s=None)
    yield root, vectors, service
    service.close()


def test_the_api_answers_embeddings_and_refuses_images_saying_what_to_send(served):
    root, vectors, service = served
    with TestClient(create_api(service)) as client:
        found = client.post("/search?k=3", json={"embedding": vectors[4].tolist()})
        assert found.status_code == 200, found.text
        top = found.json()["results"][0]
        assert (top["id"], top["path"], top["label"]) == (5, "photos/4.jpg", "c1")
        image = client.post("/search?k=3", files={"image": ("q.png", png_bytes(), "image/png")})
        assert image.status_code == 422 and "built from embeddings and has no model" in image.json()["detail"]
        assert f'send an "embedding" (a list of {DIM} numbers)' in image.json()["detail"]
        batch = client.post("/search/batch", json={"queries": [{"embedding": vectors[0].tolist()},
                                                               {"image": base64.b64encode(png_bytes()).decode()}]})
        assert batch.status_code == 422 and batch.json()["detail"].startswith("queries[1]: this index was built")
        stats = client.get("/stats")
        assert stats.status_code == 200, stats.text
        body = stats.json()
        assert body["service"]["model_hash"] is None and body["service"]["input_size"] is None
        assert body["index"]["recall_10_at_10"] == 1.0 and body["index"]["model"]["embeddings_dir"] == "in"
        assert str(root) not in stats.text
        assert client.get("/health").json()["vectors"] == 30


def test_the_app_refuses_an_upload_with_the_api_words(served, tmp_path):
    _, _, service = served
    tab = SearchTab(service, ExampleSet(service, tmp_path, count=2), UploadRecords(gr.Blocks()))
    (tmp_path / "q.png").write_bytes(png_bytes())
    tab.uploads.blocks.upload_file_set.add(str(tmp_path / "q.png"))
    items, status, _ = tab.search({"path": str(tmp_path / "q.png"), "orig_name": "q.png"}, 3)
    assert items == [] and status.startswith("⚠️ **Cannot search with an image:**"), status
    assert "built from embeddings" in status
