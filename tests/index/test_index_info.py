"""index.json's typed record (``IndexInfo``): read from and written back to the same bytes, an index.json from before
the newer keys loads, keys it does not know survive a writer's read-modify-write, and its fields name the keys."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from embedders import FakeEmbedder
from index_builds import QUICK

from retrieval.data.synthetic import write_digits
from retrieval.index import Index, add_images, build_index
from retrieval.index.layout import IndexLayout
from retrieval.records.index_info import KNOWN_KEYS, IndexInfo

# An index.json as an early version wrote it: none of the keys added since (relative paths, outputs, labels, text)
OLD_INFO = {
    "format": "retrieval-index/1",
    "model_path": "/models/model.onnx",
    "model_hash": "8612811ca395e7c9",
    "embedding_dim": 24,
    "model_normalized": True,
    "similarity": "inner product of L2-normalised vectors (cosine)",
    "gallery_root": "/data/gallery",
    "index_key": "Flat",
    "params": {},
    "count": 12,
}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("info")
    write_digits(root / "gallery", 12)
    write_digits(root / "more", 4, start=12)
    build_index(root / "gallery", root / "idx", embedder=FakeEmbedder(), options=QUICK)
    return root


def test_a_built_index_json_round_trips_to_the_same_bytes(built, tmp_path):
    written = (built / "idx" / "index.json").read_bytes()
    data = json.loads(written)
    record = IndexInfo.from_json(data)
    assert record.to_json() == data and list(record.to_json()) == list(data)  # same keys, same order
    copy = IndexLayout(tmp_path)
    copy.write_info(record)
    assert copy.info.read_bytes() == written
    assert IndexLayout(built / "idx").read_record() == record


def test_the_fields_hold_the_keys_the_file_holds(built):
    record = IndexLayout(built / "idx").read_record()
    data = json.loads((built / "idx" / "index.json").read_text())
    assert record.format == "retrieval-index/1"
    assert record.model.hash == data["model_hash"] == FakeEmbedder().model_hash
    assert record.model.embedding_dim == data["embedding_dim"] == 24 and record.model.normalized is True
    assert record.catalogue.gallery_root == str((built / "gallery").resolve())
    assert record.catalogue.gallery_relative == "../gallery"
    assert record.vectors.index_key == "Flat" and record.vectors.count == 12 and record.vectors.params == {}
    assert record.text.hash is None and record.calibrations.text_no_match is None and record.extra == {}
    assert record.has_model


def test_an_index_json_from_before_the_newer_keys_loads_and_round_trips(tmp_path):
    record = IndexInfo.from_json(OLD_INFO)
    assert record.model.relative is None and record.model.output is None and record.catalogue.gallery_relative is None
    assert record.model.path == "/models/model.onnx" and record.vectors.count == 12
    assert not record.holds("model_path_relative") and not record.holds("model_output")
    with pytest.raises(KeyError):
        record.value_of("model_output")  # absent stays absent, as in the dict
    layout = IndexLayout(tmp_path)
    layout.write_info(OLD_INFO)
    before = layout.info.read_bytes()
    layout.write_info(layout.read_record())
    assert layout.info.read_bytes() == before


def test_a_key_held_as_null_stays_null_and_an_absent_one_stays_absent():
    record = IndexInfo.from_json({"format": "retrieval-index/1", "model_path": None, "model_hash": "h"})
    assert record.to_json() == {"format": "retrieval-index/1", "model_path": None, "model_hash": "h"}
    assert record.holds("model_path") and record.value_of("model_path") is None and record.model.path is None
    assert not record.holds("similarity") and record.keys_held == ("format", "model_path", "model_hash")


def test_unknown_keys_are_kept_in_extra_in_their_place():
    data = {"format": "retrieval-index/1", "from_a_newer_version": {"a": [1, 2]}, "model_hash": "h", "note": "mine"}
    record = IndexInfo.from_json(data)
    assert record.extra == {"from_a_newer_version": {"a": [1, 2]}, "note": "mine"}
    assert list(record.to_json()) == list(data) and record.to_json() == data
    assert not KNOWN_KEYS & set(record.extra)


def test_with_fields_updates_in_place_and_appends_new_keys_as_a_dict_union_does():
    data = {"format": "retrieval-index/1", "model_hash": "h", "odd": 1, "count": 3}
    fields = {"count": 4, "display_columns": ["title"], "odd": 2}
    record = IndexInfo.from_json(data).with_fields(fields)
    assert list(record.to_json().items()) == list((data | fields).items())
    assert record.vectors.count == 4 and record.catalogue.display_columns == ["title"] and record.extra == {"odd": 2}
    assert list(record.without("odd", "absent").to_json()) == ["format", "model_hash", "count", "display_columns"]


def test_the_record_shares_nothing_with_what_it_was_read_from():
    data = {"format": "retrieval-index/1", "params": {"nprobe": 8}}
    record = IndexInfo.from_json(data)
    data["params"]["nprobe"] = 1
    out = record.to_json()
    out["params"]["nprobe"] = 2
    assert record.vectors.params == {"nprobe": 8}


def test_something_other_than_an_object_is_refused():
    with pytest.raises(ValueError, match="not a JSON object"):
        IndexInfo.from_json([1, 2])  # type: ignore[arg-type]


def test_a_writer_keeps_keys_it_does_not_know_through_an_add(built, tmp_path):
    shutil.copytree(built / "idx", tmp_path / "idx")
    layout = IndexLayout(tmp_path / "idx")
    info = json.loads(layout.info.read_text())
    hand_edited = {"from_a_newer_version": {"kept": True}, "note": "hand-edited"}
    layout.write_info(info | hand_edited)
    summary = add_images(tmp_path / "idx", built / "more", embedder=FakeEmbedder(), options=QUICK)
    assert summary["this_run"]["added"] == 4
    after = json.loads(layout.info.read_text())
    assert {key: after[key] for key in hand_edited} == hand_edited and after["count"] == 16
    assert list(after)[: len(info) + 2] == [*info, *hand_edited]  # in their places: updates do not reorder
    with Index.open(tmp_path / "idx", embedder=FakeEmbedder()) as index:
        assert index.info.extra == hand_edited and index.info.vectors.count == 16


def test_the_record_answers_each_key_as_the_json_object_held_it(built):
    data = json.loads((built / "idx" / "index.json").read_text()) | {"unknown": 1, "text_model_hash": None}
    record = IndexInfo.from_json(data)
    assert {key: record.value_of(key) for key in record.keys_held} == data and record.keys_held == tuple(data)
    assert all(record.holds(key) for key in data) and record.holds("text_model_hash")  # held as null: held
    assert record.value_of("text_model_hash") is None and not record.holds("text_model_path")
    with pytest.raises(KeyError):
        record.value_of("text_model_path")  # absent: not a null


def test_the_key_names_the_modules_declare_are_the_records_keys():
    from retrieval.index.display_columns import DISPLAY_COLUMNS
    from retrieval.index.layout import VECTORS_IN
    from retrieval.index.portable import GALLERY_RELATIVE, MODEL_RELATIVE
    from retrieval.index.query_embedder import EMBEDDINGS_SOURCE, LEGACY_MODEL_KEY, OUTPUT_FIELDS, PARENT_MODEL_KEY
    from retrieval.index.writing.records import LABEL_COLUMN
    from retrieval.text.keywords import KEYWORD_INDEX, TEXT_COLUMNS
    from retrieval.text.no_match import TEXT_NO_MATCH
    from retrieval.text.text_index import TEXT_MODEL_HASH, TEXT_MODEL_OFF, TEXT_MODEL_PATH, TEXT_MODEL_RELATIVE

    record = IndexInfo.from_json({key: key for key in (
        DISPLAY_COLUMNS, VECTORS_IN, GALLERY_RELATIVE, MODEL_RELATIVE, LEGACY_MODEL_KEY, PARENT_MODEL_KEY,
        *OUTPUT_FIELDS, LABEL_COLUMN, KEYWORD_INDEX, TEXT_COLUMNS, TEXT_NO_MATCH, TEXT_MODEL_HASH, TEXT_MODEL_OFF,
        TEXT_MODEL_PATH, TEXT_MODEL_RELATIVE)})
    assert record.extra == {}
    assert (record.catalogue.display_columns, record.vectors.vectors_in, record.catalogue.gallery_relative,
            record.model.relative, record.model.legacy_hash, record.model.parent_hash, record.model.output,
            record.model.output_space, record.catalogue.label_column, record.catalogue.keyword_index,
            record.catalogue.text_columns, record.calibrations.text_no_match, record.text.hash, record.text.off,
            record.text.path, record.text.relative) == (
        DISPLAY_COLUMNS, VECTORS_IN, GALLERY_RELATIVE, MODEL_RELATIVE, LEGACY_MODEL_KEY, PARENT_MODEL_KEY,
        *OUTPUT_FIELDS, LABEL_COLUMN, KEYWORD_INDEX, TEXT_COLUMNS, TEXT_NO_MATCH, TEXT_MODEL_HASH, TEXT_MODEL_OFF,
        TEXT_MODEL_PATH, TEXT_MODEL_RELATIVE)
    assert not IndexInfo.from_json({"source": EMBEDDINGS_SOURCE}).has_model and IndexInfo().has_model


def test_index_json_the_writers_produce_holds_no_key_the_record_does_not_know(built):
    data = json.loads((built / "idx" / "index.json").read_text())
    assert set(data) <= KNOWN_KEYS


def test_recording_display_columns_through_the_record_keeps_every_other_key_and_byte(built, tmp_path):
    from retrieval.index.display_columns import record_display_columns

    shutil.copytree(built / "idx", tmp_path / "idx")
    layout = IndexLayout(tmp_path / "idx")
    info = json.loads(layout.info.read_text())
    layout.write_info(info | {"from_a_newer_version": [1, {"a": None}]})
    before = json.loads(layout.info.read_text())
    record_display_columns(tmp_path / "idx", [])
    after = json.loads(layout.info.read_text())
    assert after == before | {"display_columns": []} and list(after) == [*before, "display_columns"]
    layout.write_info(before)  # what the dict-based writer wrote: the same bytes as the record's write
    expected = layout.info.read_bytes()
    layout.write_info(IndexInfo.from_json(before))
    assert layout.info.read_bytes() == expected
