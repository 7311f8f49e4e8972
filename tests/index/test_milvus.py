"""An index pushed into a Milvus collection (Milvus Lite: the real engine in a local process) answers as the local
index does: a FLAT collection gives the local Flat index's top 10 for every query, filters choose the same rows and
refuse the same expressions; a push killed midway resumes without sending a row twice; a collection of another
model is refused, naming both hashes."""

from __future__ import annotations

import numpy as np
import pytest
from index_builds import write_embeddings_folder

pytest.importorskip("pymilvus")
pytest.importorskip("milvus_lite")

from retrieval.index import Index, build_from_embeddings  # noqa: E402
from retrieval.index.embedding.engine import IngestOptions  # noqa: E402
from retrieval.index.filters import FilterError, parse_filter  # noqa: E402
from retrieval.index.milvus.milvus_collection import (  # noqa: E402
    COMPLETE,
    MODEL_HASH,
    RECORD,
    MilvusError,
    MilvusPlace,
    connect,
    milvus_filter,
    pq_subquantizers,
    read_record,
)
from retrieval.index.milvus.milvus_index import MilvusIndex  # noqa: E402
from retrieval.index.milvus.milvus_push import physical_name, push_index  # noqa: E402

DIM = 16
ROWS = 240
LABELS = ['cat', 'dog "big"', "back\\slash", "日本", None, ""]


def metadata(rows: int) -> dict[str, list]:
    """Paths, labels with quotes and missing ones, a number column with gaps and a text column."""
    return {"path": [f"photos/{i // 50}/{i}.jpg" for i in range(rows)],
            "label": [LABELS[i % len(LABELS)] for i in range(rows)],
            "price": [None if i % 7 == 0 else float(i % 40) for i in range(rows)],
            "split": ["test" if i % 3 else ("val" if i % 2 else None) for i in range(rows)]}


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """A local Flat index of clustered vectors and its push into a FLAT collection."""
    root = tmp_path_factory.mktemp("milvus")
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((12, DIM))
    vectors = (centres[rng.integers(0, 12, ROWS)] + 0.4 * rng.standard_normal((ROWS, DIM))).astype(np.float32)
    write_embeddings_folder(root / "in", [vectors], [metadata(ROWS)])
    build_from_embeddings(root / "in", root / "idx", index_key="Flat", options=IngestOptions(progress=False))
    place = MilvusPlace.checked(str(root / "milvus.db"), "gallery")
    summary = push_index(root / "idx", place, index_type="FLAT", batch_rows=64, progress=False)
    with Index.open(root / "idx") as local, MilvusIndex(place) as remote:
        yield root, vectors, place, summary, local, remote


def test_a_flat_collection_gives_the_local_flat_indexs_top_ten_for_every_query(pushed):
    _, vectors, _, summary, local, remote = pushed
    assert summary["sent"] == ROWS and summary["state"] == COMPLETE and len(remote) == ROWS
    queries = vectors[::3] + 0.05
    found, expected = remote.search(queries, 10), local.search(queries, 10)
    for got, wanted in zip(found, expected, strict=True):
        assert [r.id for r in got] == [r.id for r in wanted]
        assert [(r.path, r.label) for r in got] == [(local.public_path(r.path), r.label) for r in wanted]
        np.testing.assert_allclose([r.score for r in got], [r.score for r in wanted], atol=1e-5)


@pytest.mark.parametrize("where", [
    'label = "cat"', 'label != "cat"', 'not (label = "cat")', 'label = \'dog "big"\'', 'label = "back\\slash"',
    'label = "日本"', 'label = ""', 'label in ("cat", "日本") or price >= 30', 'price < 10 and not split = "val"',
    'split not in ("test")', 'not (price > 5 or split = "test")', 'path = "photos/1/60.jpg"', 'path >= "photos/3"',
    'id < 17.5', 'id in (1, 2, 300)', 'label < "d"', 'not (not (price <= 3))',
])
def test_filters_choose_the_rows_the_local_index_chooses(pushed, where):
    *_, local, remote = pushed
    np.testing.assert_array_equal(remote.matching_ids(where), local.matching_ids(where))


@pytest.mark.parametrize("where", ['colour = "red"', "label = 3", 'price = "cheap"', 'split in ("a", 2)'])
def test_filters_are_refused_in_the_local_index_words(pushed, where):
    *_, local, remote = pushed
    with pytest.raises(FilterError) as expected:
        local.matching_ids(where)
    with pytest.raises(FilterError) as refused:
        remote.matching_ids(where)
    assert str(refused.value) == str(expected.value)


def test_a_filtered_search_with_exclusions_keeps_k_results_from_the_matching_rows(pushed):
    _, vectors, _, _, local, remote = pushed
    where, exclude = 'split = "test" and price < 30', (3, 4, 5)
    got = remote.search(vectors[:4], 5, exclude_ids=exclude, where=where)
    wanted = local.search(vectors[:4], 5, exclude_ids=exclude, where=where)
    assert [[r.id for r in row] for row in got] == [[r.id for r in row] for row in wanted]
    assert all(len(row) == 5 and not {r.id for r in row} & set(exclude) for row in got)


def test_re_ranking_reads_the_candidates_vectors_from_the_collection(pushed):
    from retrieval.rerank import RerankConfig

    _, vectors, _, _, local, remote = pushed
    np.testing.assert_allclose(remote.reconstructed_vectors(np.array([7, 3, 7])),
                               local.reconstructed_vectors(np.array([7, 3, 7])), atol=1e-6)
    config = RerankConfig(method="qe", candidates=30)
    got, wanted = remote.search(vectors[:5], 10, rerank=config), local.search(vectors[:5], 10, rerank=config)
    assert [[r.id for r in row] for row in got] == [[r.id for r in row] for row in wanted]


def test_the_collection_records_the_model_and_a_second_push_sends_nothing(pushed):
    root, _, place, *_ = pushed
    again = push_index(root / "idx", place, index_type="FLAT", progress=False)
    assert again["sent"] == 0 and again["already_there"] == ROWS
    client = connect(place)
    properties = client.describe_collection(place.collection)["properties"]
    assert properties[MODEL_HASH].startswith("none") and properties["retrieval.embedding_dim"] == str(DIM)
    assert read_record(client, place.collection).state == COMPLETE
    client.close()


def test_a_push_killed_midway_resumes_without_sending_a_row_twice(pushed, tmp_path, monkeypatch):
    root, *_ = pushed
    place = MilvusPlace.checked(str(tmp_path / "killed.db"), "gallery")
    from pymilvus import MilvusClient

    real_insert, calls = MilvusClient.insert, []

    def dying_insert(self, collection, rows, *args, **kwargs):
        calls.append(len(rows))
        if len(calls) == 3:
            raise KeyboardInterrupt  # as a kill between two batches
        return real_insert(self, collection, rows, *args, **kwargs)

    monkeypatch.setattr(MilvusClient, "insert", dying_insert)
    with pytest.raises(KeyboardInterrupt):
        push_index(root / "idx", place, index_type="FLAT", batch_rows=50, progress=False)
    monkeypatch.setattr(MilvusClient, "insert", real_insert)
    client = connect(place)
    assert read_record(client, place.collection) is None  # the served name appears only once every row is in
    assert read_record(client, physical_name(place.collection, None)).state != COMPLETE
    client.close()
    resumed = push_index(root / "idx", place, index_type="FLAT", batch_rows=50, progress=False)
    assert resumed["already_there"] == 100 and resumed["sent"] == ROWS - 100 and resumed["state"] == COMPLETE
    with MilvusIndex(place) as remote:
        ids = remote.matching_ids("id >= 0")
        assert len(remote) == ROWS and len(ids) == ROWS


def test_a_collection_of_another_model_is_refused_naming_both_hashes(pushed, tmp_path):
    import json

    root, *_ = pushed
    place = MilvusPlace.checked(str(tmp_path / "other.db"), "gallery")
    push_index(root / "idx", place, index_type="FLAT", progress=False)
    client = connect(place)
    body = json.loads(client.describe_collection(place.collection)["properties"][RECORD])
    body["info"]["model_hash"] = "0123456789abcdef"
    client.alter_collection_properties(place.collection, {RECORD: json.dumps(body)})
    client.close()
    with pytest.raises(MilvusError, match="model 0123456789abcdef, not none"):
        push_index(root / "idx", place, index_type="FLAT", progress=False)


@pytest.mark.parametrize(("uri", "problem"), [
    ("ftp://host", "neither a server URL"), ("http://host:19530/db?x=1", "nothing after the port"),
    ("/no/such/folder/m.db", "does not exist"), ("gallery.sqlite", "neither a server URL")])
def test_a_bad_uri_is_refused_before_connecting(uri, problem):
    with pytest.raises(MilvusError, match=problem):
        MilvusPlace.checked(uri, "gallery")


@pytest.mark.parametrize("name", ["1st", "a-b", "a b", "", "x" * 256, "drop;"])
def test_a_collection_name_milvus_would_refuse_is_refused_first(tmp_path, name):
    with pytest.raises(MilvusError, match="not a Milvus collection name"):
        MilvusPlace.checked(str(tmp_path / "m.db"), name)


def test_a_control_character_in_a_filter_string_is_refused_in_words(pushed):
    *_, remote = pushed
    with pytest.raises(FilterError, match="control character"):
        remote.matching_ids('label = "a\x01b"')
    assert "\\n" in milvus_filter(parse_filter('label = "a\nb"'), remote.record)


def test_pq_sub_vectors_divide_the_dimension():
    assert [pq_subquantizers(d) for d in (16, 512, 30, 7)] == [4, 128, 6, 1]


def test_a_push_after_a_removal_and_a_relabel_makes_the_collection_hold_the_index_again(pushed, tmp_path):
    import shutil

    from retrieval.index import remove_images
    from retrieval.index.catalogue import Catalogue

    root, vectors, *_ = pushed
    shutil.copytree(root / "idx", tmp_path / "idx")
    place = MilvusPlace.checked(str(tmp_path / "sync.db"), "gallery")
    push_index(tmp_path / "idx", place, index_type="FLAT", progress=False)
    remove_images(tmp_path / "idx", ids=[1, 2, 3])
    with Catalogue(tmp_path / "idx" / "catalogue.sqlite") as catalogue:
        catalogue.db.execute("UPDATE images SET label = 'renamed' WHERE id IN (10, 11)")
        catalogue.db.commit()
    again = push_index(tmp_path / "idx", place, progress=False)  # the collection's own index type
    assert again["deleted"] == 3 and again["sent"] == 2
    with Index.open(tmp_path / "idx") as local, MilvusIndex(place) as remote:
        assert len(remote) == ROWS - 3
        np.testing.assert_array_equal(remote.matching_ids('label = "renamed"'), [10, 11])
        assert [[r.id for r in row] for row in remote.search(vectors[:3], 10)] == \
            [[r.id for r in row] for row in local.search(vectors[:3], 10)]


def test_an_upgrade_moves_the_served_name_to_the_new_models_collection_in_one_step(pushed, tmp_path):
    import json
    import shutil

    root, vectors, *_ = pushed
    shutil.copytree(root / "idx", tmp_path / "idx")
    place = MilvusPlace.checked(str(tmp_path / "switch.db"), "gallery")
    first = push_index(tmp_path / "idx", place, index_type="FLAT", progress=False)
    info = json.loads((tmp_path / "idx" / "index.json").read_text())
    (tmp_path / "idx" / "index.json").write_text(json.dumps({**info, "model_hash": "fedcba9876543210"}))
    with pytest.raises(MilvusError, match="index upgrade"):
        push_index(tmp_path / "idx", place, progress=False)
    switched = push_index(tmp_path / "idx", place, index_type="HNSW", progress=False, switch=True)
    assert switched["physical"] == "gallery__fedcba9876543210" and switched["dropped"] == first["physical"]
    client = connect(place)
    assert client.describe_collection("gallery")["collection_name"] == "gallery__fedcba9876543210"
    assert not client.has_collection(first["physical"])
    client.close()
    with MilvusIndex(place) as remote:
        assert remote.model_hash == "fedcba9876543210" and remote.record.index_type == "HNSW" and len(remote) == ROWS


def test_rows_and_vectors_of_many_ids_are_read_in_bounded_expressions(pushed, monkeypatch):
    import retrieval.index.milvus.milvus_index as milvus_index

    *_, local, remote = pushed
    monkeypatch.setattr(milvus_index, "MAX_ID_LIST", 7)  # 240 ids: 35 expressions
    ids = np.arange(1, ROWS + 1)
    assert sorted(remote.indexed_rows(ids.tolist())) == ids.tolist()
    np.testing.assert_allclose(remote.reconstructed_vectors(ids), local.reconstructed_vectors(ids), atol=1e-6)


@pytest.mark.parametrize("stored", ["../outside.jpg", "photos/../../outside.jpg", "/etc/passwd", "a/../../b.jpg"])
def test_a_stored_path_that_would_leave_the_gallery_names_no_file(pushed, stored):
    """A collection is anyone's database: a row whose path leaves the gallery root is never opened."""
    *_, remote = pushed
    assert remote.image_file(stored) is None
    inside = remote.image_file("photos/0/1.jpg")
    assert inside is not None and inside.startswith(str(remote.gallery_root))
