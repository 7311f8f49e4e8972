"""Display columns through the server: every result of POST /search (image, embedding and text queries), the query's
own gallery item and GET /items/{id} carry the index's display columns, documented in the OpenAPI; the Python client
reads them (``.columns``, ``.title``); the app captions each result with its title and price and shows its path when
it is clicked; an index that shows no columns answers as before."""

from __future__ import annotations

import re

import gradio as gr
import httpx
import pytest
from serve_fixtures import BackgroundServer
from shop_gallery import HTML_TITLE, LONG_TITLE, build_shop_index

from retrieval.client import RetrievalClient
from retrieval.client import results as client_results
from retrieval.index.display_columns import MAX_DISPLAY_CHARS, TITLE_COLUMNS, record_display_columns
from retrieval.serve.page_text import markdown_text
from retrieval.serve.server import ServerConfig, build_app
from retrieval.serve.ui.search import ExampleSet, SearchTab
from retrieval.serve.upload_cache import UploadRecords


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
    root = tmp_path_factory.mktemp("served-shop")
    index_dir = build_shop_index(root)
    app, service = build_app(ServerConfig(index_dir=index_dir))
    with BackgroundServer(app) as server:
        yield root / "shop", index_dir, server, service
    service.close()


def upload(gallery, name: str) -> tuple[str, bytes, str]:
    colour = name.split("_")[0]
    return ("q.png", (gallery / colour / f"{name}.png").read_bytes(), "image/png")


def test_every_result_and_the_query_item_carry_the_title_and_price(shop):
    gallery, _, server, _ = shop
    answer = httpx.post(f"{server.url}/search?k=3", files={"image": upload(gallery, "red_0")}, timeout=60).json()
    assert answer["query_item"]["columns"] == {"title": "Red kettle #0", "price": "10.0"}
    assert answer["results"][0]["columns"] == {"title": "Red kettle #0", "price": "10.0"}
    assert all(set(r["columns"]) == {"title", "price"} for r in answer["results"])
    hostile = httpx.post(f"{server.url}/search?k=1", files={"image": upload(gallery, "red_1")}, timeout=60).json()
    assert hostile["results"][0]["columns"]["title"] == HTML_TITLE  # as text: JSON carries it, each page escapes it
    long = httpx.post(f"{server.url}/search?k=1", files={"image": upload(gallery, "blue_1")}, timeout=60).json()
    assert len(long["results"][0]["columns"]["title"]) == MAX_DISPLAY_CHARS
    assert long["results"][0]["columns"]["title"].startswith(LONG_TITLE[:100])


def test_an_embedding_query_and_an_item_carry_them_too(shop):
    _, index_dir, server, service = shop
    with service.acquire() as state:
        vector = state.index.reconstructed_vectors(state.index.ids[:1])[0]
        first = int(state.index.ids[0])
    answer = httpx.post(f"{server.url}/search", json={"embedding": vector.tolist(), "k": 2}, timeout=60).json()
    assert answer["results"][0]["id"] == first and answer["results"][0]["columns"]["title"] == "Red kettle #0"
    item = httpx.get(f"{server.url}/items/{first}", timeout=60).json()
    assert item["columns"] == {"title": "Red kettle #0", "price": "10.0"}


def test_the_openapi_documents_the_columns(shop):
    _, _, server, _ = shop
    schemas = httpx.get(f"{server.url}/openapi.json", timeout=60).json()["components"]["schemas"]
    for model in ("Result", "QueryItemModel", "ItemModel"):
        described = schemas[model]["properties"]["columns"]
        assert "display columns" in described["description"] and "title" in described["description"]
        assert "columns" not in schemas[model].get("required", [])


def test_the_client_reads_the_columns_and_the_title(shop):
    gallery, _, server, _ = shop
    with RetrievalClient(server.url, timeout=60) as client:
        found = client.search(image=gallery / "green" / "green_3.png", k=2)
        item = client.item(found[0].id)
    assert found[0].columns == {"title": "Green watering can #3", "price": "11.75"}
    assert found[0].title == "Green watering can #3" and found.query_item.title == "Green watering can #3"
    assert item.title == "Green watering can #3" and item.columns == found[0].columns


def test_the_client_knows_the_servers_title_columns():
    assert client_results.TITLE_COLUMNS == TITLE_COLUMNS


@pytest.mark.parametrize("columns", [[1, 2], {"title": {"nested": 1}}, {"price": float("inf")}, "title"])
def test_the_client_refuses_columns_of_the_wrong_shape(columns):
    hit = {"id": 1, "path": "a.png", "name": "a.png", "label": None, "score": 0.5, "image_url": "/items/1/image",
           "columns": columns}
    with pytest.raises(ValueError, match="columns"):
        client_results.SearchHit.from_json(hit)


def test_a_hit_without_columns_has_no_title():
    hit = client_results.SearchHit.from_json({"id": 1, "path": "a.png", "name": "a.png", "label": None,
                                              "score": 0.5, "image_url": "/items/1/image"})
    assert hit.columns is None and hit.title is None


def test_the_app_captions_results_with_their_title_and_shows_the_path_of_a_clicked_one(shop, tmp_path):
    gallery, _, _, service = shop
    tab = SearchTab(service, ExampleSet(service, tmp_path, count=0), UploadRecords(gr.Blocks()))
    query = str(gallery / "red" / "red_0.png")
    tab.uploads.blocks.upload_file_set.add(query)
    items, status, _ = tab.search({"path": query, "orig_name": "q.png"}, 3)
    captions = [caption for _, caption in items]
    assert captions[0].startswith("✓ Red kettle #3 · 10.75 · ") and captions[0].endswith(" · red · #4")
    assert not any("red/red_" in caption for caption in captions)  # titles, not file paths
    shown = tab.selected(captions[0])
    assert shown == f"**Selected #4:** `red/red_3.png` · label `red` · {markdown_text('Red kettle #3 · 10.75')}"
    hostile = next(c for c in captions if "kettle · " in c and "<img" in c)
    assert HTML_TITLE in hostile  # Gradio shows a caption as text (the browser test checks the page)
    assert re.search(r"(?<!\\)<", tab.selected(hostile)) is None  # Markdown: every tag of the title escaped
    assert tab.selected("no id here") == "" and tab.selected(None) == "" and tab.selected("x · #999999") == ""


def test_an_index_showing_no_columns_answers_and_captions_with_paths(shop, tmp_path):
    gallery, index_dir, server, service = shop
    record_display_columns(index_dir, [])
    try:
        service.live.reload()
        answer = httpx.post(f"{server.url}/search?k=2&exclude_self=true", files={"image": upload(gallery, "red_0")},
                            timeout=60).json()
        assert all("columns" not in r for r in answer["results"]) and "columns" not in answer["query_item"]
        tab = SearchTab(service, ExampleSet(service, tmp_path, count=0), UploadRecords(gr.Blocks()))
        query = str(gallery / "red" / "red_0.png")
        tab.uploads.blocks.upload_file_set.add(query)
        items, _, _ = tab.search({"path": query, "orig_name": "q.png"}, 2)
        assert [caption.rsplit(" · ", 1)[1] for _, caption in items] == [r["path"] for r in answer["results"]]
    finally:
        record_display_columns(index_dir, None)
        service.live.reload()


def test_a_text_query_answered_by_keywords_carries_the_columns(tmp_path):
    """An index whose keyword index holds the titles (no text model): a text query's hits carry the display
    columns, the keyword columns among them by default."""
    from embedders import write_projection_onnx
    from shop_gallery import write_shop

    from retrieval.index import IngestOptions, build_index

    manifest = write_shop(tmp_path / "shop")
    build_index(manifest, tmp_path / "index", model=write_projection_onnx(tmp_path / "model.onnx", dim=16),
                options=IngestOptions(batch_size=8, workers=0, progress=False), text_columns=["title", "sku"])
    assert record_display_columns(tmp_path / "index")["display_columns"] == ["title", "price", "sku"]
    app, service = build_app(ServerConfig(index_dir=tmp_path / "index"))
    try:
        with BackgroundServer(app) as server:
            answer = httpx.post(f"{server.url}/search", json={"text": "watering can", "k": 3}, timeout=60).json()
    finally:
        service.close()
    assert answer["results"], answer
    assert all(r["columns"]["title"].startswith("Green watering can") for r in answer["results"]), answer
    assert all(r["columns"]["sku"].startswith("SKU-1") for r in answer["results"])
