"""The display columns: which manifest columns (a title, a price) every answer carries, recorded in index.json and
read for each answer from the catalogue in one query; their values bounded and printable; an index that records
none answers as before (no ``columns``); a Milvus collection answers with the same columns as the folder."""

from __future__ import annotations

import json
import sqlite3

import numpy as np
import pytest
from shop_gallery import CONTROL_TITLE, HTML_TITLE, LONG_TITLE, build_shop_index

from retrieval.errors import ParameterError
from retrieval.index import Index
from retrieval.index.display_columns import (
    DISPLAY_COLUMNS,
    MAX_DISPLAY_CHARS,
    check_display_columns,
    default_display_columns,
    display_text,
    display_values,
    parse_column_list,
    record_display_columns,
    shown_value,
)
from retrieval.index.live import Snapshot


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
    return build_shop_index(tmp_path_factory.mktemp("shop"))


def query_vectors(index: Index, ids: list[int]) -> np.ndarray:
    """The stored vectors of ``ids``: queries whose top hit is that row."""
    return index.reconstructed_vectors(np.asarray(ids, dtype=np.int64))


def test_the_defaults_are_the_title_like_columns_the_price_and_the_keyword_columns():
    assert default_display_columns(["sku", "price", "title", "brand"]) == ["title", "price"]
    assert default_display_columns(["product_name", "caption", "colour"], ["colour", "missing"]) == [
        "product_name", "caption", "colour"]
    assert default_display_columns(["sku", "brand"]) == []
    assert parse_column_list(" title, ,price ") == ["title", "price"] and parse_column_list("") == []


def test_an_unknown_column_is_refused_listing_the_columns_there_are():
    with pytest.raises(ParameterError, match=r"names 'titel', which is no manifest column of the index; the columns "
                                             r"are: brand, price, title") as caught:
        check_display_columns(["title", "titel"], ["brand", "price", "title"])
    assert caught.value.param == "display_columns"
    with pytest.raises(ParameterError, match="keeps no manifest columns"):
        check_display_columns(["title"], [])
    assert check_display_columns(["price", "title", "price"], ["title", "price"]) == ["price", "title"]


def test_values_are_one_printable_line_bounded_and_numbers_stay_numbers():
    assert shown_value(CONTROL_TITLE) == "Line one Line two [31m txet desrever end"
    long = shown_value(LONG_TITLE)
    assert len(long) == MAX_DISPLAY_CHARS and long.endswith("…")
    assert shown_value(HTML_TITLE) == HTML_TITLE  # text, not markup: each page escapes it as it shows it
    assert shown_value(12.5) == 12.5 and shown_value(3) == 3
    assert shown_value(float("nan")) is None and shown_value(float("inf")) is None
    assert shown_value(True) is None and shown_value([1]) is None and shown_value("  \n ") is None
    assert display_values('{"title": "Kettle", "price": "9.99", "sku": "x"}', ["title", "price", "brand"]) == {
        "title": "Kettle", "price": "9.99", "brand": None}
    assert display_values("not json", ["title"]) == {"title": None}
    assert display_values("[1, 2]", ["title"]) == {"title": None}


def test_display_text_puts_the_title_first_and_the_price_beside_it():
    assert display_text({"price": "9.99", "title": "Kettle", "brand": "Acme"}) == "Kettle · 9.99 · brand: Acme"
    assert display_text({"title": None, "price": None}) is None
    assert display_text({"name": "Can", "price": 2.5}) == "Can · 2.5"


def test_the_build_records_the_defaults_and_every_answer_carries_them(shop):
    info = json.loads((shop / "index.json").read_text())
    assert info[DISPLAY_COLUMNS] == ["title", "price"]
    with Index.open(shop) as index:
        ids = index.ids[:5].tolist()
        found = index.search(query_vectors(index, ids), 3)
        rows = index.catalogue.metadata_of(ids)
    for image_id, results in zip(ids, found, strict=True):
        top = results[0]
        assert top.id == image_id
        expected = json.loads(rows[image_id])
        assert top.columns["price"] == expected["price"]
        assert top.columns["title"] == shown_value(expected["title"])
        assert all(set(r.columns) == {"title", "price"} for r in results)
        assert top.to_dict()["columns"] == top.columns


def test_columns_are_read_in_one_catalogue_query_per_answer(shop):
    with Index.open(shop) as index:
        statements: list[str] = []
        index.catalogue.db.set_trace_callback(statements.append)
        index.search(query_vectors(index, index.ids[:8].tolist()), 5)
        index.catalogue.db.set_trace_callback(None)
    assert sum("FROM metadata" in s for s in statements) == 1, statements


def test_a_snapshot_and_a_re_ranked_search_carry_the_columns_too(shop):
    from retrieval.rerank import RerankConfig

    with Snapshot.open(shop) as snapshot:
        vectors = query_vectors(snapshot, snapshot.ids[:2].tolist())
        plain = snapshot.search(vectors, 4)
        reranked = snapshot.search(vectors, 4, rerank=RerankConfig(method="qe"))
    assert all(r.columns is not None and r.columns["title"] for results in plain + reranked for r in results)


def test_changing_the_columns_changes_the_answers_and_none_gives_paths_only(shop):
    summary = record_display_columns(shop, ["sku", "brand"])
    assert summary["available_columns"] == ["brand", "price", "sku", "title"]
    assert summary["replaced_display_columns"] == ["title", "price"]
    with Index.open(shop) as index:
        top = index.search(query_vectors(index, [1]), 1)[0][0]
        assert top.columns == {"sku": "SKU-00", "brand": None}  # the first row has no brand
    record_display_columns(shop, [])
    with Index.open(shop) as index:
        top = index.search(query_vectors(index, [1]), 1)[0][0]
        assert top.columns is None and "columns" not in top.to_dict()
    with pytest.raises(ParameterError, match="the columns are: brand, price, sku, title"):
        record_display_columns(shop, ["colour"])
    assert record_display_columns(shop, None)[DISPLAY_COLUMNS] == ["title", "price"]


def test_an_index_of_a_folder_gallery_answers_without_columns(tmp_path):
    index_dir = build_shop_index(tmp_path, manifest=False)
    assert DISPLAY_COLUMNS not in json.loads((index_dir / "index.json").read_text())
    with Index.open(index_dir) as index:
        results = index.search(query_vectors(index, [1, 2]), 3)
    assert all(r.columns is None and "columns" not in r.to_dict() for rs in results for r in rs)
    assert record_display_columns(index_dir)[DISPLAY_COLUMNS] == []


def test_a_catalogue_row_of_hostile_json_shows_nothing_of_it(shop, tmp_path):
    """Metadata that is not an object, not JSON or huge is a row with no values, never an error."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(shop, copy)
    record_display_columns(copy, ["title", "price"])
    db = sqlite3.connect(copy / "catalogue.sqlite")
    db.execute("UPDATE metadata SET data = ? WHERE id = 1", ("[not json",))
    db.execute("UPDATE metadata SET data = ? WHERE id = 2", (json.dumps({"title": "x" * 3_000_000}),))
    db.execute("UPDATE metadata SET data = ? WHERE id = 3", (json.dumps({"title": {"nested": 1}, "price": 1e400}),))
    db.commit()
    db.close()
    with Index.open(copy) as index:
        found = index.search(query_vectors(index, [1, 2, 3]), 1)
    assert [r[0].columns for r in found] == [{"title": None, "price": None}] * 3


def test_a_milvus_collection_answers_with_the_folders_columns(shop, tmp_path):
    pytest.importorskip("pymilvus")
    pytest.importorskip("milvus_lite")
    from retrieval.index.milvus.milvus_collection import MilvusPlace
    from retrieval.index.milvus.milvus_index import MilvusIndex
    from retrieval.index.milvus.milvus_push import push_index

    record_display_columns(shop, ["title", "price", "brand"])
    place = MilvusPlace.checked(str(tmp_path / "milvus.db"), "shop")
    push_index(shop, place, index_type="FLAT", progress=False)
    with Index.open(shop) as local, MilvusIndex(place) as remote:
        vectors = query_vectors(local, local.ids[:6].tolist())
        here, there = local.search(vectors, 4), remote.search(vectors, 4)
        # the collection keeps a column whose every value reads as a number as numbers (its filters compare them
        # so); the folder answers with the manifest's text as written ("10.50" stays "10.50")
        assert [[(r.id, {**r.columns, "price": float(r.columns["price"])}) for r in rs] for rs in here] == [
            [(r.id, r.columns) for r in rs] for rs in there]
        assert all(isinstance(r.columns["price"], float) for rs in there for r in rs)
        assert remote.columns_of([2])[2]["title"] == HTML_TITLE
    record_display_columns(shop, ["sku"])  # a push again brings the new choice along
    push_index(shop, place, progress=False)
    with MilvusIndex(place) as remote:
        assert remote.search(vectors[:1], 1)[0][0].columns == {"sku": "SKU-00"}
    record_display_columns(shop, None)


def test_a_hand_edited_index_json_shows_only_names_a_manifest_could_have():
    from retrieval.index.display_columns import checked_columns
    from retrieval.records.index_info import IndexInfo

    def recorded(data: dict) -> list[str]:
        return checked_columns(IndexInfo.from_json(data).catalogue.display_columns)

    names = ["title", "<script>", "a b", "x" * 65, 3, None, "price", "ünï"]
    assert recorded({DISPLAY_COLUMNS: names}) == ["title", "price"]
    assert recorded({DISPLAY_COLUMNS: "title"}) == [] and recorded({}) == []
