"""One path per image: an image added from outside the gallery folder keeps its folders, every image's path is
unique, and the path shown (CLI, API, filters, export) is the one ``index remove`` accepts back."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from embedders import FakeEmbedder
from index_builds import load_models_as
from PIL import Image
from sample_images import write_images

from retrieval.cli.index import index_group, search_command
from retrieval.cli.main import main


def _jpeg(path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(path, "JPEG")


@pytest.fixture
def two_h_jpgs(tmp_path, monkeypatch):
    """An index of gallery ``g``, then ``more/horse/h.jpg`` and ``more2/stallion/h.jpg`` added from outside it."""
    load_models_as(monkeypatch, lambda path, providers="auto": FakeEmbedder())
    monkeypatch.setattr("retrieval.index.searchable.opening.load_model", lambda path, providers="auto": FakeEmbedder())
    write_images(tmp_path / "g" / "cat", 3)
    _jpeg(tmp_path / "more" / "horse" / "h.jpg", 101)
    _jpeg(tmp_path / "more2" / "stallion" / "h.jpg", 202)
    (tmp_path / "m.onnx").write_bytes(b"x")
    index = str(tmp_path / "idx")
    runner = CliRunner()
    built = runner.invoke(index_group, ["build", "--model", str(tmp_path / "m.onnx"), "--images",
                                        str(tmp_path / "g"), "--out", index, "--workers", "0"])
    assert built.exit_code == 0, built.output
    for folder in ("more", "more2"):
        added = runner.invoke(index_group, ["add", index, "--images", str(tmp_path / folder), "--workers", "0"])
        assert added.exit_code == 0, added.output
    return tmp_path, index


HORSE, STALLION = "../more/horse/h.jpg", "../more2/stallion/h.jpg"


def _exported_paths(index: str, out) -> list[str]:
    exported = CliRunner().invoke(index_group, ["export", index, "--out", str(out), "--overwrite"])
    assert exported.exit_code == 0, exported.output
    return sorted(pd.read_parquet(out)["path"])


def test_images_added_from_other_folders_keep_distinct_paths_in_export_search_and_filters(two_h_jpgs):
    tmp_path, index = two_h_jpgs
    assert _exported_paths(index, tmp_path / "t.parquet") == [
        HORSE, STALLION, "cat/img_000.png", "cat/img_001.png", "cat/img_002.png"]
    query = tmp_path / "more2" / "stallion" / "h.jpg"
    found = CliRunner().invoke(search_command, ["--index", index, "--model", "m.onnx", "-k", "1", "--json", str(query)])
    assert found.exit_code == 0, found.output
    top = json.loads(found.output)[0]["results"][0]
    assert top["path"] == STALLION and top["file"] == str(query.resolve())
    table = CliRunner().invoke(search_command, ["--index", index, "--model", "m.onnx", "-k", "1", str(query)])
    assert table.output.splitlines()[1].endswith(f"  {STALLION}")  # the table shows the same spelling
    for shown in (HORSE, STALLION):  # the shown path, copied into a filter, finds exactly that image
        where = CliRunner().invoke(search_command, ["--index", index, "--model", "m.onnx", "-k", "5", "--json",
                                                    "--where", f'path = "{shown}"', str(query)])
        assert where.exit_code == 0, where.output
        assert [r["path"] for r in json.loads(where.output)[0]["results"]] == [shown]


def test_the_api_names_each_added_image_by_its_own_path(two_h_jpgs):
    from fastapi.testclient import TestClient

    from retrieval.serve.api import create_api
    from retrieval.serve.service import SearchService

    tmp_path, index = two_h_jpgs
    service = SearchService(index, embedder=FakeEmbedder(), reload_interval_s=None)
    try:
        with TestClient(create_api(service)) as client:
            for shown, file in ((HORSE, "more/horse/h.jpg"), (STALLION, "more2/stallion/h.jpg")):
                data = (tmp_path / file).read_bytes()
                answer = client.post("/search?k=1", files={"image": ("q.jpg", data, "image/jpeg")}).json()
                assert answer["results"][0]["path"] == shown and answer["query_item"]["path"] == shown
                item = client.get(f"/items/{answer['results'][0]['id']}").json()
                assert item["path"] == shown
                filtered = client.post("/search", json={"embedding": [0.1] * 24, "k": 5,
                                                        "where": f'path = "{shown}"'}).json()
                assert [r["path"] for r in filtered["results"]] == [shown] and filtered["notes"] == []
    finally:
        service.close()


def test_a_filter_matching_nothing_is_answered_with_how_paths_compare(two_h_jpgs):
    from fastapi.testclient import TestClient

    from retrieval.serve.api import create_api
    from retrieval.serve.service import SearchService

    _, index = two_h_jpgs
    service = SearchService(index, embedder=FakeEmbedder(), reload_interval_s=None)
    try:
        with TestClient(create_api(service)) as client:
            for route, body in (("/search", {"embedding": [0.1] * 24, "where": 'path = "h.jpg"'}),
                                ("/search/batch", {"queries": [{"embedding": [0.1] * 24}], "where": 'path = "h.jpg"'})):
                answer = client.post(route, json=body).json()
                answer = answer["results"][0] if route.endswith("batch") else answer
                assert answer["results"] == []
                note = " ".join(answer["notes"])
                assert "the filter matches no image of the index" in note and 'path = "' in note
    finally:
        service.close()


def test_the_shown_path_is_accepted_by_remove_and_a_bare_file_name_is_answered_with_candidates(two_h_jpgs):
    tmp_path, index = two_h_jpgs
    bare = CliRunner().invoke(main, ["index", "remove", index, "--paths", "h.jpg"])
    assert bare.exit_code == 1
    assert "not in the catalogue: h.jpg" in bare.output
    assert f"catalogued images named h.jpg: {HORSE}, {STALLION}" in bare.output
    removed = CliRunner().invoke(index_group, ["remove", index, "--paths", HORSE])
    assert removed.exit_code == 0, removed.output
    assert _exported_paths(index, tmp_path / "after.parquet") == [
        STALLION, "cat/img_000.png", "cat/img_001.png", "cat/img_002.png"]
