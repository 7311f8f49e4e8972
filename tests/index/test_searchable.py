"""An index folder (``Index``) and a Milvus collection (``MilvusIndex``, on Milvus Lite) both meet the one
``SearchableIndex`` contract: every member there, every method with the protocol's very signature (a drifted one
fails), and the factory opens each kind from what names it, for a search and for a server's state."""

from __future__ import annotations

import functools
import inspect

import numpy as np
import pytest
from index_builds import write_embeddings_folder

pytest.importorskip("pymilvus")
pytest.importorskip("milvus_lite")

from retrieval.index import Index, build_from_embeddings, index_stats  # noqa: E402
from retrieval.index.embedding.engine import IngestOptions  # noqa: E402
from retrieval.index.live import Snapshot  # noqa: E402
from retrieval.index.milvus.milvus_collection import MilvusError, MilvusPlace  # noqa: E402
from retrieval.index.milvus.milvus_index import MilvusIndex  # noqa: E402
from retrieval.index.milvus.milvus_push import push_index  # noqa: E402
from retrieval.index.portable import GalleryPlace  # noqa: E402
from retrieval.index.searchable.contract import FilterColumns, GalleryCatalogue, SearchableIndex  # noqa: E402
from retrieval.index.searchable.opening import (  # noqa: E402
    CollectionPlace,
    FolderPlace,
    IndexPlace,
    index_place,
    open_searchable,
)

DIM = 8
ROWS = 60
# properties whose classes answer with their own type, which meets the smaller protocol named here (checked apart)
NARROWER = {"catalogue": GalleryCatalogue, "filter_table": FilterColumns, "keywords": None}


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """A Flat index folder of labelled vectors and its push into a FLAT Milvus Lite collection."""
    root = tmp_path_factory.mktemp("searchable")
    vectors = np.random.default_rng(0).standard_normal((ROWS, DIM)).astype(np.float32)
    metadata = {"path": [f"photos/{i}.jpg" for i in range(ROWS)], "label": [f"c{i % 5}" for i in range(ROWS)]}
    write_embeddings_folder(root / "in", [vectors], [metadata])
    build_from_embeddings(root / "in", root / "idx", index_key="Flat", options=IngestOptions(progress=False))
    place = MilvusPlace.checked(str(root / "milvus.db"), "gallery")
    push_index(root / "idx", place, index_type="FLAT", batch_rows=64, progress=False)
    return root, vectors, place


def members(protocol: type) -> tuple[dict[str, object], set[str]]:
    """The protocol's methods and properties by name, and its data members."""
    declared = {name: value for name, value in vars(protocol).items()
                if callable(value) or isinstance(value, property)}
    own = {name: value for name, value in declared.items()
           if not name.startswith("_") or name in ("__len__", "__enter__", "__exit__")}
    return own, set(vars(protocol).get("__annotations__", {}))


def described(member: object) -> inspect.Signature:
    """A method's signature, or a property's getter's (annotations as written: every module defers them)."""
    if isinstance(member, property):
        member = member.fget
    elif isinstance(member, functools.cached_property):
        member = member.func
    return inspect.signature(member)


def annotated(cls: type, name: str) -> bool:
    """Whether ``cls`` or a class it inherits from declares the attribute ``name`` (set on each instance)."""
    return any(name in vars(klass).get("__annotations__", {}) for klass in cls.__mro__)


def drift(cls: type, protocol: type = SearchableIndex) -> list[str]:
    """Each member of ``protocol`` that ``cls`` lacks or declares with another signature (parameters, defaults,
    annotations)."""
    problems = []
    methods, data = members(protocol)
    for name, wanted in methods.items():
        got = inspect.getattr_static(cls, name, None)
        if got is None and isinstance(wanted, property) and name in NARROWER and annotated(cls, name):
            continue  # an attribute of each instance, of its own type: checked against NARROWER's protocol
        if got is None:
            problems.append(f"{name}: missing")
        elif isinstance(wanted, property):
            if not isinstance(got, (property, functools.cached_property)):
                problems.append(f"{name}: not a property")
            elif name not in NARROWER and described(got).return_annotation != described(wanted).return_annotation:
                problems.append(f"{name}: {described(got).return_annotation} is not "
                                f"{described(wanted).return_annotation}")
        elif described(got) != described(wanted):
            problems.append(f"{name}{described(got)} is not {name}{described(wanted)}")
    problems += [f"{name}: missing" for name in data if not hasattr(cls, name) and not annotated(cls, name)]
    return problems


@pytest.mark.parametrize("cls", [Index, Snapshot, MilvusIndex])
def test_each_class_declares_every_member_with_the_protocols_signature(cls):
    assert drift(cls) == []


@pytest.mark.parametrize("cls", [FolderPlace, CollectionPlace])
def test_each_place_declares_every_member_with_the_factorys_signature(cls):
    assert drift(cls, IndexPlace) == []


def test_a_search_signature_that_drifts_from_the_protocol_is_caught():
    class Drifted(Index):
        def search(self, embeddings, k=5, exclude_ids=(), where=None, rerank=None, cancelled=None):
            return []

        def image_file(self, path: str, strict: bool = False) -> str | None:
            return None

    problems = drift(Drifted)
    assert [p.split("(")[0] for p in problems] == ["search", "image_file"]


def test_an_opened_folder_and_collection_are_searchable_indexes_with_typed_parts(pushed):
    root, _, place = pushed
    with Index.open(root / "idx") as local, MilvusIndex(place) as remote:
        for index in (local, remote):
            assert isinstance(index, SearchableIndex)
            assert isinstance(index.catalogue, GalleryCatalogue) and isinstance(index.filter_table, FilterColumns)
            assert isinstance(index.gallery, GalleryPlace) and not index.gallery.moved
            assert index.keywords is None  # built without text_columns: neither has a keyword index
        assert remote.gallery.root == remote.gallery_root
        assert (local.remote, remote.remote) == (False, True)
        assert (local.root, remote.root) == (root / "idx", type(local.root)("gallery"))
        assert not isinstance(object(), SearchableIndex)


def test_the_factory_opens_a_folder_and_a_collection_that_answer_alike(pushed):
    root, vectors, place = pushed
    queries = vectors[:4] + 0.01
    with open_searchable(root / "idx") as local, \
            open_searchable(milvus=place.uri, collection=place.collection) as remote:
        assert type(local) is Index and type(remote) is MilvusIndex and remote.place == place
        found, wanted = remote.search(queries, 5), local.search(queries, 5)
        assert [[r.id for r in hits] for hits in found] == [[r.id for r in hits] for hits in wanted]
        assert len(remote) == len(local) == ROWS


def test_each_place_names_itself_and_opens_a_servers_state(pushed, tmp_path):
    root, _, place = pushed
    folder, collection = index_place(root / "idx"), index_place(milvus=place)
    assert isinstance(folder, FolderPlace) and isinstance(collection, CollectionPlace)
    assert index_place(folder) is folder  # a place already made is taken as it is
    assert (str(folder), folder.name, folder.shown) == (str(root / "idx"), "idx", str((root / "idx").resolve()))
    assert (str(collection), collection.name, str(collection.root)) == (str(place), "gallery", "gallery")
    assert index_place(tmp_path).is_missing() and not folder.is_missing() and not collection.is_missing()
    assert folder.watch() is None and callable(collection.watch())
    first = folder.open_state(None, None, first=True)
    later = collection.open_state(None, None, first=False)
    try:
        assert type(first) is Snapshot and type(later) is MilvusIndex
        np.testing.assert_array_equal(first.ids, later.ids)
    finally:
        first.close()
        later.close()


def test_the_factory_refuses_what_it_cannot_open(pushed):
    _, _, place = pushed
    with pytest.raises(MilvusError, match="'absent' does not exist"):
        open_searchable(milvus=place.uri, collection="absent")
    with pytest.raises(MilvusError):
        index_place(milvus="ftp://x", collection="gallery")  # refused before anything connects
    with pytest.raises(ValueError, match="GPU"):
        open_searchable(milvus=place, gpu=True)
    with pytest.raises(ValueError, match="folder or a Milvus collection"):
        index_place()


def test_index_stats_measures_a_folder_and_a_collection_through_the_factory(pushed):
    root, _, place = pushed
    folder = index_stats(root / "idx", queries=20)
    collection = index_stats(index_place(milvus=place), queries=20)
    assert folder["vectors"] == collection["vectors"] == ROWS
    assert folder["index_dir"] == str(root / "idx") and collection["index_dir"] == str(place)
    assert folder["recall_1_at_1"] == collection["recall_1_at_1"] == 1.0  # Flat and FLAT: exact
