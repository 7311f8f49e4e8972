"""The JSON API's contract with hostile clients: what a search body may hold, which files are served, the paths and
scores it answers with, a query that is a gallery item, and an OpenAPI document that tells the truth (checked by
schemathesis against a real server). Offline /docs and /redoc."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import sqlite3
import time
from pathlib import Path

import numpy as np
import pytest
from api_cases import run_checks, valid_case
from fastapi.testclient import TestClient
from PIL import Image
from sample_images import encode_png, png_bytes
from serve_fixtures import QUERY_COLOUR, QUERY_PNG, BackgroundServer

from retrieval.index import Index
from retrieval.index.shards import ShardStore
from retrieval.index.vectors import done_chunks
from retrieval.serve.api import create_api
from retrieval.serve.server import ServerConfig, build_app
from retrieval.serve.service import SearchService

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def stored(artifacts):
    """The index's own vectors (as saved in its shards) and their catalogue ids."""
    with Index.open(artifacts.index_dir) as index:
        done = index.catalogue.done_shards()
        ids, vectors = zip(*done_chunks(ShardStore(index.layout.shards), done), strict=True)
    return np.concatenate(ids), np.concatenate(vectors)


def gallery_root(artifacts) -> Path:
    """The deepest folder holding every gallery image: what response paths are relative to."""
    return Path(os.path.commonpath([str(p.resolve().parent) for p in artifacts.query_paths]))


def search_json(client, body: dict | str, query: str = "k=5"):
    if isinstance(body, str):  # raw JSON text (NaN, 1e400, ...)
        return client.post(f"/search?{query}", content=body, headers={"content-type": "application/json"})
    return client.post(f"/search?{query}", json=body)


# --- 1. embedding queries ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"embedding": ["0.5"] * 32}, "item 0 is a string"),  # NumPy would read "0.5" as a number
        ({"embedding": [1.0] * 31 + [True]}, "item 31 is a boolean"),  # and True as 1.0
        ({"embedding": [True] * 32}, "item 0 is a boolean"),
        ({"embedding": [0.1] * 5 + [None] + [0.1] * 26}, "item 5 is null"),
        ({"embedding": [[0.1]] * 32}, "nested lists are not accepted"),
        ({"embedding": [[1, [2]], 3] + [0.1] * 30}, "nested lists are not accepted"),  # ragged: no 500
        ({"embedding": [{}] * 32}, "item 0 is an object"),
        ({"embedding": "0.1, 0.2"}, "not a string"),
        ({"embedding": {"0": 1}}, "not an object"),
        ({"embedding": [0.1] * 31}, "dimension"),
        ('{"embedding": [NaN' + ", 0.1" * 31 + "]}", "item 0 is nan"),  # Python's json reads NaN
        ('{"embedding": [0.1, Infinity' + ", 0.1" * 30 + "]}", "item 1 is inf"),
        ('{"embedding": [1e400' + ", 0.1" * 31 + "]}", "item 0 is inf"),  # beyond float64: not finite
        ('{"embedding": [1' + "0" * 400 + ", 0.1" * 31 + "]}", "float64 range"),  # a 401-digit integer
        ({"embedding": [0.0] * 32}, "all zeros"),
        ({"embedding": [-0.0] * 16 + [0] * 16}, "all zeros"),
    ],
)
def test_embedding_must_be_finite_json_numbers(client, body, message):
    response = search_json(client, body)
    assert response.status_code == 422, response.text
    assert message in response.json()["detail"]


@pytest.mark.parametrize("scale", [1e30, 1e300, 1e-30, 1e-300, 5e-324 * 2**40])
def test_an_embedding_of_any_finite_magnitude_is_a_direction(client, stored, scale):
    """Scaled in float64 before normalising: a float32 norm overflows above ~1e19 and underflows below ~1e-23."""
    ids, vectors = stored
    vector = vectors[3].astype(np.float64)
    unit = search_json(client, {"embedding": vector.tolist()}).json()
    response = search_json(client, {"embedding": (vector * scale).tolist()})
    assert response.status_code == 200, response.text
    assert [r["id"] for r in response.json()["results"]] == [r["id"] for r in unit["results"]]
    assert response.json()["results"][0]["id"] == ids[3]
    assert np.allclose([r["score"] for r in response.json()["results"]], [r["score"] for r in unit["results"]])


def test_the_same_large_component_everywhere_is_a_valid_direction(client, stored):
    _, vectors = stored
    ones = np.ones(32) / np.sqrt(32)
    expected = np.sort(vectors @ ones)[::-1][:5]
    response = search_json(client, {"embedding": [1e30] * 32})  # every component 1e30: direction (1, ..., 1)
    assert response.status_code == 200, response.text
    assert np.allclose([r["score"] for r in response.json()["results"]], expected, atol=1e-5)


# --- 2. only regular files are served ----------------------------------------------------------------------
def item_id_of(service, path: Path) -> int:
    return service.search(path.read_bytes(), k=1).results[0].id  # a gallery image finds itself first


def test_a_symlink_that_replaced_a_gallery_file_is_not_followed(artifacts, service, client, tmp_path):
    path = artifacts.query_paths[9]
    image_id = item_id_of(service, path)
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
    aside = tmp_path / "aside.png"
    path.rename(aside)
    try:
        path.symlink_to(secret)
        response = client.get(f"/items/{image_id}/image")
        assert response.status_code == 404 and b"root:" not in response.content
        assert "replaced by a symlink" in response.json()["detail"]
        assert service.image_path(image_id) is None  # what the app opens by path: refused too
        path.unlink()
        os.mkfifo(path)  # a FIFO in its place: refused at once, not a read that waits for a writer
        started = time.monotonic()
        response = client.get(f"/items/{image_id}/image")
        assert response.status_code == 404 and "not a regular file" in response.json()["detail"]
        assert time.monotonic() - started < 5
        path.unlink()
        path.mkdir()
        assert client.get(f"/items/{image_id}/image").status_code == 404
        path.rmdir()
    finally:
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        elif path.is_symlink() or path.exists():
            path.unlink()
        aside.rename(path)
    served = client.get(f"/items/{image_id}/image")
    assert served.status_code == 200 and served.content == path.read_bytes()
    assert served.headers["content-type"] == "image/png"
    assert served.headers["content-length"] == str(path.stat().st_size)


def test_a_gallery_folder_swapped_for_a_symlink_out_of_the_gallery_is_not_followed(artifacts, service, client,
                                                                                    tmp_path):
    """A folder of the gallery replaced by a link to another folder holding a file of the same name (an image, so
    the content check would pass): not served; a link to a folder inside the gallery still is."""
    path = artifacts.query_paths[7]
    image_id = item_id_of(service, path)
    folder = path.parent
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / path.name).write_bytes(png_bytes(colour=(255, 0, 0)))  # a private picture under the catalogued name
    aside = folder.with_name(folder.name + "-aside")  # inside the gallery
    folder.rename(aside)
    try:
        folder.symlink_to(outside, target_is_directory=True)
        response = client.get(f"/items/{image_id}/image")
        assert response.status_code == 404 and response.content != (outside / path.name).read_bytes()
        assert "leads out of the gallery" in response.json()["detail"]
        assert service.image_path(image_id) is None  # what the app opens by path: refused too
        folder.unlink()
        folder.symlink_to(aside, target_is_directory=True)  # a link that stays inside the gallery is followed
        served = client.get(f"/items/{image_id}/image")
        assert served.status_code == 200 and served.content == (aside / path.name).read_bytes()
        folder.unlink()
        folder.symlink_to(os.path.relpath(outside, folder.parent), target_is_directory=True)  # relative, out
        assert client.get(f"/items/{image_id}/image").status_code == 404
        folder.unlink()
        folder.symlink_to(folder.name, target_is_directory=True)  # a link to itself: a loop ends, a 404
        looped = client.get(f"/items/{image_id}/image")
        assert looped.status_code == 404 and "not served" in looped.json()["detail"]
    finally:
        if folder.is_symlink():
            folder.unlink()
        aside.rename(folder)
    assert client.get(f"/items/{image_id}/image").content == path.read_bytes()


def test_a_catalogued_file_that_is_not_an_image_is_not_served(artifacts, service, client):
    """The content decides, not the name: a catalogued file whose bytes are no accepted image format is refused as
    missing (a catalogue built from another tool's metadata may name any file), and an image under another
    format's extension goes out as what it is."""
    path = artifacts.query_paths[8]
    image_id = item_id_of(service, path)
    original = path.read_bytes()
    try:
        path.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
        response = client.get(f"/items/{image_id}/image")
        assert response.status_code == 404 and b"root:" not in response.content
        assert "is not an image" in response.json()["detail"]
        jpeg = io.BytesIO()
        Image.open(io.BytesIO(original)).convert("RGB").save(jpeg, "JPEG")
        path.write_bytes(jpeg.getvalue())  # a JPEG under its .png name
        served = client.get(f"/items/{image_id}/image")
        assert served.status_code == 200 and served.content == jpeg.getvalue()
        assert served.headers["content-type"] == "image/jpeg"
    finally:
        path.write_bytes(original)
    assert client.get(f"/items/{image_id}/image").headers["content-type"] == "image/png"


@pytest.fixture(scope="module")
def aliased(artifacts, tmp_path_factory):
    """A copy of the index whose catalogued paths run through a symlinked folder, with ``gallery_root`` recorded
    in index.json (as the index builder writes it)."""
    root = tmp_path_factory.mktemp("aliased")
    alias = root / "alias"
    alias.symlink_to(gallery_root(artifacts).parent, target_is_directory=True)
    index_dir = root / "index"
    shutil.copytree(artifacts.index_dir, index_dir)
    real = str(gallery_root(artifacts).parent)
    with sqlite3.connect(index_dir / "catalogue.sqlite") as db:
        db.execute("UPDATE images SET path = ? || substr(path, ?)", (str(alias), len(real) + 1))
    info = json.loads((index_dir / "index.json").read_text())
    recorded = alias / gallery_root(artifacts).name / "train"
    (index_dir / "index.json").write_text(json.dumps(info | {"gallery_root": str(recorded)}))
    svc = SearchService(index_dir)
    yield svc, recorded
    svc.close()


def test_parent_folders_of_the_gallery_may_be_symlinks(artifacts, aliased):
    svc, recorded = aliased
    with TestClient(create_api(svc)) as client:
        path = artifacts.query_paths[0]
        hit = client.post("/search?k=1", files={"image": ("q.png", path.read_bytes(), "image/png")}).json()
        served = client.get(hit["results"][0]["image_url"])
    assert served.status_code == 200 and served.content == path.read_bytes()


# --- 6. paths relative to the gallery root, scores within [-1, 1] -------------------------------------------
def test_responses_give_paths_relative_to_the_gallery_root(artifacts, client):
    query = artifacts.query_paths[4]
    relative = query.resolve().relative_to(gallery_root(artifacts)).as_posix()
    response = client.post("/search?k=3", files={"image": ("q.png", query.read_bytes(), "image/png")})
    assert response.json()["results"][0]["path"] == relative  # e.g. train/0030-FE0F-20E3/noto.png
    item = client.get(f"/items/{response.json()['results'][0]['id']}")
    assert item.json()["path"] == relative
    for text in (response.text, item.text, client.get("/stats").text):
        assert str(artifacts.root) not in text and '"/' not in text.replace('"/items/', "")


def test_the_recorded_gallery_root_is_used_when_the_index_has_one(artifacts, aliased):
    svc, recorded = aliased
    train = [p for p in artifacts.query_paths if "train" in p.parts]
    response = svc.search(train[0].read_bytes(), k=1)
    assert response.results[0].path == train[0].resolve().relative_to(gallery_root(artifacts) / "train").as_posix()
    outside = next(p for p in artifacts.query_paths if "test" in p.parts)  # catalogued outside that root
    expected = "../test/" + outside.resolve().relative_to(gallery_root(artifacts) / "test").as_posix()
    assert svc.search(outside.read_bytes(), k=1).results[0].path == expected  # walks up: unique, never absolute


def test_scores_are_cosines_within_minus_one_and_one(artifacts, client, stored):
    """Float32 inner products of stored unit vectors with themselves come out a hair above 1 (1.0000002 here)."""
    ids, vectors = stored
    with Index.open(artifacts.index_dir) as index:
        scores, _ = index.search_arrays(vectors, 3)
    assert scores.max() <= 1.0 and scores[:, 0] == pytest.approx(1.0, abs=1e-6)
    for vector in vectors[:8]:
        results = search_json(client, {"embedding": vector.tolist()}, "k=2").json()["results"]
        assert all(-1.0 <= r["score"] <= 1.0 for r in results)


# --- 5. the JSON body: k, unknown keys, one query ----------------------------------------------------------
def test_k_in_the_json_body_is_honoured_and_must_agree_with_the_query(client, stored):
    vector = stored[1][0].tolist()
    assert search_json(client, {"embedding": vector, "k": 3}, "").json()["count"] == 3
    assert search_json(client, {"embedding": vector, "k": 4.0}, "").json()["count"] == 4  # JSON's integer 4
    assert search_json(client, {"embedding": vector, "k": 3}, "k=3").json()["count"] == 3
    assert search_json(client, {"embedding": vector}, "k=6").json()["count"] == 6
    conflict = search_json(client, {"embedding": vector, "k": 3}, "k=4")
    assert conflict.status_code == 422 and "3 in the JSON body but 4 in the query" in conflict.json()["detail"]
    for bad in ["3", True, 0, 1001, 2.5, None]:
        response = search_json(client, {"embedding": vector, "k": bad}, "")
        assert response.status_code == 422 and '"k" must be an integer' in response.json()["detail"], bad


def test_unknown_keys_and_two_queries_are_refused(client, stored):
    vector = stored[1][0].tolist()
    response = search_json(client, {"embedding": vector, "top_k": 3, "filter": "cats"})
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert "'filter', 'top_k'" in detail and "allowed keys: image, embedding, text, k" in detail
    many = search_json(client, {"embedding": vector} | {f"x{i:02d}" * 30: 1 for i in range(50)})
    assert many.status_code == 422 and "and 45 more" in many.json()["detail"] and len(many.text) < 600
    both = search_json(client, {"embedding": vector, "image": base64.b64encode(QUERY_PNG).decode()})
    assert both.status_code == 422 and "not both" in both.json()["detail"]
    neither = search_json(client, {"k": 3})
    assert neither.status_code == 422 and '"image"' in neither.json()["detail"]
    form = client.post("/search", files={"image": ("q.png", QUERY_PNG, "image/png"), "k": (None, "3")})
    assert form.status_code == 422 and "unknown multipart field(s): 'k'" in form.json()["detail"]


def test_a_deeply_nested_json_body_is_a_clear_400(client):
    response = search_json(client, '{"embedding": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert response.status_code == 400 and "nested too deeply" in response.json()["detail"]


def test_k_in_the_query_is_checked_by_the_one_check_and_documented(client):
    """The query's k is checked where every search checks it (check_k); the document still states the range."""
    for bad in (0, 1001):
        response = client.post(f"/search?k={bad}", json={"embedding": [1.0] * 32})
        assert response.status_code == 422, bad
        assert response.json()["detail"] == f"k must be an integer between 1 and 1000, got {bad}"
    (k,) = [p for p in client.get("/openapi.json").json()["paths"]["/search"]["post"]["parameters"] if p["name"] == "k"]
    assert k["schema"]["minimum"] == 1 and k["schema"]["maximum"] == 1000


def test_fastapi_validation_errors_have_the_string_detail_too(client):
    response = client.post("/search?k=ten", json={"embedding": [1.0] * 32})
    assert response.status_code == 422 and isinstance(response.json()["detail"], str)
    assert "query k" in response.json()["detail"] and '"ten"' in response.json()["detail"]


# --- 7. a query that is a gallery item; 8. notes ---------------------------------------------------------
def test_exclude_self_drops_the_gallery_item_with_the_query_bytes(artifacts, service, client):
    path = artifacts.query_paths[6]
    data = path.read_bytes()
    relative = path.resolve().relative_to(gallery_root(artifacts)).as_posix()
    plain = client.post("/search?k=4", files={"image": ("q.png", data, "image/png")}).json()
    assert plain["query_item"]["path"] == relative and plain["query_item"]["label"] == artifacts.labels[6]
    assert plain["results"][0]["id"] == plain["query_item"]["id"] and plain["excluded_self"] is False
    for response in (
        client.post("/search?k=4&exclude_self=true", files={"image": ("q.png", data, "image/png")}),
        search_json(client, {"image": base64.b64encode(data).decode()}, "k=4&exclude_self=true"),
    ):
        body = response.json()
        assert body["query_item"] == plain["query_item"] and body["excluded_self"] is True
        assert [r["id"] for r in body["results"]] == [r["id"] for r in plain["results"][1:]] + [
            body["results"][-1]["id"]
        ]
        assert body["count"] == 4 and plain["query_item"]["id"] not in [r["id"] for r in body["results"]]
    # the same pixels in other bytes are another file: not the gallery item (identity is the file's sha256)
    buffer = io.BytesIO()
    Image.open(path).save(buffer, format="PNG", compress_level=0)
    other = client.post("/search?k=2&exclude_self=true", files={"image": ("q.png", buffer.getvalue(), "image/png")})
    assert other.json()["query_item"] is None and other.json()["excluded_self"] is False
    vector = search_json(client, {"embedding": [0.1] * 32}, "k=2&exclude_self=true").json()
    assert vector["query_item"] is None and vector["notes"] == [] and plain["notes"] == []


def test_the_app_identifies_a_gallery_query_the_same_way(artifacts, service, client, tmp_path):
    """SearchTab.search and the API share SearchService's rule: same bytes, same item, left out of its results."""
    import gradio as gr

    from retrieval.serve.ui.search import ExampleSet, SearchTab
    from retrieval.serve.upload_cache import UploadRecords

    tab = SearchTab(service, ExampleSet(service, tmp_path, count=1), UploadRecords(gr.Blocks()))
    path = artifacts.query_paths[12]
    copy = tmp_path / "renamed.png"
    copy.write_bytes(path.read_bytes())  # another name, same bytes: still the gallery item
    tab.uploads.blocks.upload_file_set.update({str(path), str(copy)})  # as Gradio records uploaded files
    api = client.post("/search?k=5&exclude_self=true", files={"image": ("q.png", path.read_bytes(), "image/png")})
    items, text, _ = tab.search(str(path), 5)
    assert len(items) == 5 and f"Query is gallery image #{api.json()['query_item']['id']}" in text
    assert f"#{api.json()['query_item']['id']}" in tab.search(str(copy), 5)[1]


# --- 3. the OpenAPI document -----------------------------------------------------------------------------
def test_the_openapi_document_declares_every_status_and_body(client):
    doc = client.get("/openapi.json").json()
    search = doc["paths"]["/search"]["post"]
    # 401: only with a token configured; 403: a cross-origin request (serve.security)
    assert set(search["responses"]) == {"200", "400", "401", "403", "408", "413", "415", "422", "503"}
    assert search["responses"]["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorDetail")
    assert search["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/SearchResponseModel"
    )
    body = search["requestBody"]
    assert body["required"] and set(body["content"]) == {"multipart/form-data", "application/json"}
    embedding = body["content"]["application/json"]["schema"]["properties"]["embedding"]
    assert embedding["minItems"] == embedding["maxItems"] == 32
    notes = doc["components"]["schemas"]["SearchResponseModel"]["properties"]["notes"]
    assert notes["type"] == "array" and "animated" in notes["description"]
    image = doc["paths"]["/items/{item_id}/image"]["get"]["responses"]
    assert {"image/png", "image/jpeg", "image/webp"} <= set(image["200"]["content"]) and "404" in image
    assert set(doc["paths"]["/items/{item_id}"]["get"]["responses"]) == {"200", "401", "403", "404"}
    for route in ("/stats", "/health"):
        assert doc["paths"][route]["get"]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert "HTTPValidationError" not in doc["components"]["schemas"]  # FastAPI's list-shaped 422 is not sent
    batch = doc["paths"]["/search/batch"]["post"]
    assert set(batch["responses"]) == set(search["responses"])
    assert batch["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/BatchSearchResponseModel"
    )
    entries = doc["components"]["schemas"]["BatchSearchResponseModel"]["properties"]["results"]["items"]["anyOf"]
    assert [e["$ref"].rsplit("/", 1)[1] for e in entries] == ["SearchResponseModel", "BatchQueryErrorModel"]
    queries = batch["requestBody"]["content"]["application/json"]["schema"]["properties"]["queries"]
    assert queries["maxItems"] == 64 and queries["items"]["properties"]["embedding"]["minItems"] == 32
    files = batch["requestBody"]["content"]["multipart/form-data"]["schema"]["properties"]["image"]
    assert files["type"] == "array" and files["maxItems"] == 64


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_schemathesis_finds_no_disagreement_between_the_document_and_the_server(artifacts, service):
    """Every schemathesis check (status codes, content types, response schemas, positive data accepted, negative
    data refused, no 5xx) over examples, coverage, fuzzing and stateful phases, against a real server.

    One hook supplies what a schema cannot say about valid data: an ``image`` must be an image file (a real PNG,
    as schemathesis itself does for typed file uploads; each of POST /search/batch's files and JSON queries too),
    a ``where`` must be an expression of the filter language (a grammar, not a pattern), and ``k``, ``where``,
    ``exclude_self`` and ``rerank`` in the query and in the JSON body must agree.
    """
    import schemathesis
    from schemathesis.engine import StopReason

    image = png_bytes((16, 16), QUERY_COLOUR)
    config = schemathesis.Config.from_dict(
        {
            "seed": 1,
            "request-timeout": 10,  # seconds per request (max-time would not bound the run: it keeps fuzzing to it)
            "generation": {"max-examples": 25, "database": "none"},
            "cache": {"enabled": False},
        }
    )
    config.projects.override.checks.update(included_check_names=["all"])
    app, _ = build_app(ServerConfig(index_dir=artifacts.index_dir, ui=False), service=service)
    with BackgroundServer(app) as server:
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json", config=config)

        @schema.hook("map_case")
        def real_image_and_one_k(_context, case):
            return valid_case(case, image)

        started = time.monotonic()
        failures, cases, finished = run_checks(schema)
    elapsed = time.monotonic() - started
    assert finished is not None and not finished.failures
    assert failures == [], "\n\n".join(failures[:10])
    assert finished.stop_reason == StopReason.COMPLETED and cases >= 300, (finished.stop_reason, cases)
    assert elapsed < 60  # about 12 s on 2 busy cores


# --- 4. /docs and /redoc work offline ----------------------------------------------------------------------
@pytest.mark.parametrize(("page", "assets"), [("/docs", {"javascript", "css"}), ("/redoc", {"javascript"})])
def test_docs_pages_load_their_assets_from_this_server(client, page, assets):
    html = client.get(page)
    assert html.status_code == 200
    urls = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", html.text)
    urls += re.findall(r"""url:\s*['"]([^'"]+)['"]""", html.text)  # Swagger UI's openapi url
    assert urls and all(u.startswith("/") and not u.startswith("//") for u in urls), urls
    assert "http://" not in html.text and "https://" not in html.text and "cdn" not in html.text.lower()
    kinds = set()
    for url in urls:
        response = client.get(url)
        assert response.status_code == 200, url
        kind = response.headers["content-type"].split(";")[0]
        if url.endswith((".js", ".css")):
            assert len(response.content) > 50_000, url  # the real bundles, not a stub
            kinds.add(kind.split("/")[-1])
    assert assets <= kinds


def test_an_animated_query_is_searched_by_its_first_frame_and_the_response_says_so(client):
    frames = [Image.new("RGB", (48, 48), colour) for colour in ((200, 40, 40), (40, 200, 40))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    animated = client.post("/search?k=3", files={"image": ("anim.gif", buffer.getvalue())}).json()
    assert animated["notes"] == ["animated image: the first of its 2 frames was used"]
    still = client.post("/search?k=3", files={"image": ("still.png", encode_png(frames[0]))}).json()
    assert still["notes"] == [] and [r["id"] for r in still["results"]] == [r["id"] for r in animated["results"]]
