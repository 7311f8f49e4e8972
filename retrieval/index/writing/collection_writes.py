"""The writers of an index folder whose vectors live in a Milvus collection (``index build --engine ray --milvus``):
its build, add and remove write the collection, never shards; repair is refused."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from retrieval.errors import ParameterError
from retrieval.index.catalogue import Catalogue, Outcome, Status
from retrieval.index.embedding.engine import IngestOptions
from retrieval.index.embedding.ingest import ingest
from retrieval.index.layout import VECTORS_IN, IndexLayout
from retrieval.index.query_embedder import (
    ImageEmbedder,
)
from retrieval.index.shards import ShardStore
from retrieval.near_duplicates import DuplicateCheck
from retrieval.records.index_info import IndexInfo

if TYPE_CHECKING:
    from retrieval.index.milvus.milvus_collection import MilvusPlace

from retrieval.index.writing.records import info_from_meta

log = logging.getLogger(__name__)




def check_resumed_place(catalogue: Catalogue, milvus: MilvusPlace | None, root: Path) -> None:
    """A resumed build writes its vectors where it started: into shards here, or into its Milvus collection."""
    if milvus is not None or catalogue.get_meta(VECTORS_IN) is not None:
        from retrieval.index.milvus.milvus_build import check_same_place

        check_same_place(catalogue, milvus, root)


def collection_meta(milvus: MilvusPlace | None, embedder: ImageEmbedder) -> dict[str, str]:
    """The catalogue's record of the collection a build writes into, made before the collection is: a collection
    this folder did not record is someone else's (``milvus_build.start``)."""
    if milvus is None:
        return {}
    from retrieval.index.milvus.milvus_build import recorded_place
    from retrieval.index.milvus.milvus_push import physical_name

    return {VECTORS_IN: json.dumps(recorded_place(milvus, physical_name(milvus.collection, embedder.model_hash)))}


MAX_RESENDS = 2  # passes over rows the collection lost between the writers and the final count (none expected)


def build_into_collection(layout: IndexLayout, catalogue: Catalogue, store: ShardStore, engine: Any,
                           embedder: ImageEmbedder, options: IngestOptions, milvus: MilvusPlace,
                           index_type: str | None) -> dict[str, Any]:
    """The Ray actors embed the pending rows into the collection, which is then named; index.json (no faiss part)
    and the catalogue's state record it."""
    info = info_from_meta(catalogue)
    build = _ingest_into_collection(catalogue, store, engine, embedder, options, milvus, index_type, info)
    built = {"index_key": f"Milvus {build.record.index_type}", "params": {}, VECTORS_IN: build.where}
    layout.write_info(info.with_fields(built))
    catalogue.set_meta(state="complete")
    return built


def _ingest_into_collection(catalogue: Catalogue, store: ShardStore, engine: Any, embedder: ImageEmbedder,
                            options: IngestOptions, milvus: MilvusPlace, index_type: str | None,
                            info: IndexInfo) -> Any:
    """Embed the pending rows into the collection (created, or the one this folder started); once it holds exactly
    the done rows it is marked complete and named (``milvus_build``). Returns the ``CollectionBuild``."""
    from retrieval.index.embedding.ray_collection import write_into
    from retrieval.index.milvus import milvus_build
    from retrieval.index.milvus.milvus_collection import connect
    from retrieval.index.milvus.milvus_push import preprocessing_of

    client = connect(milvus)
    try:
        build = milvus_build.start(client, milvus, catalogue, info.with_fields({"index_key": "Milvus"}), index_type,
                                   preprocessing_of(embedder.preprocessing))
        write_into(engine, build, client)
        for _ in range(MAX_RESENDS + 1):
            ingest(engine, catalogue, store, embedder, options)
            lost = milvus_build.reconcile(client, build.physical, catalogue)
            if not lost:
                break
            log.warning("%d indexed images are not in %s; sending them again", len(lost), build.physical)
            catalogue.record([Outcome(i, Status.PENDING) for i in lost])
        else:
            raise RuntimeError(f"{build.physical} at {milvus.uri} keeps losing rows after they were written; check "
                               "the Milvus server, then run the command again")
        milvus_build.finish(client, build, catalogue.counts()[Status.DONE.value])
    finally:
        client.close()
    return build


def _recorded_collection(info: IndexInfo) -> MilvusPlace:
    """The collection an index built into Milvus keeps its vectors in (index.json's ``VECTORS_IN``)."""
    from retrieval.index.milvus.milvus_collection import MilvusPlace

    where = info.vectors.vectors_in
    return MilvusPlace(str(where["milvus"]), str(where["collection"]))  # type: ignore[index]  # require_finished


def add_into_collection(layout: IndexLayout, catalogue: Catalogue, store: ShardStore, engine: Any,
                         embedder: ImageEmbedder, options: IngestOptions, info: IndexInfo,
                         duplicates: DuplicateCheck) -> dict[str, Any]:
    """``add_images`` of an index whose vectors are in Milvus: the Ray actors write the new rows into its
    collection, which serves them as they come; the near-duplicate check, which reads the folder's vectors, is
    not made."""
    if options.engine != "ray":
        raise ParameterError("engine", f"is {options.engine}, but {layout.root} keeps its vectors in Milvus, where "
                                       "only the ray engine's actors write them: add with the ray engine")
    if duplicates.duplicates == "skip":
        raise ParameterError("duplicates", "skip compares the new images with the vectors in the folder, and this "
                                           "index keeps its vectors in Milvus: add with report or off")
    build = _ingest_into_collection(catalogue, store, engine, embedder, options, _recorded_collection(info), None,
                                    info)
    layout.write_info(info)
    return {"index_key": info.vectors.index_key, VECTORS_IN: build.where}


def refuse_collection_repair(layout: IndexLayout, catalogue: Catalogue) -> None:
    """Repair mends shards and faiss, which an index built into Milvus has none of: its build command resumes it
    (an unfinished one), and its writers check its collection's rows against the catalogue (a finished one)."""
    recorded = catalogue.get_meta(VECTORS_IN)
    if recorded is None:
        return
    where = json.loads(recorded)
    if catalogue.get_meta("state") == "complete":
        from retrieval.index.layout import VectorsInMilvusError

        raise VectorsInMilvusError(layout.root, where)
    raise FileExistsError(f"{layout.root} holds an interrupted build into the Milvus collection "
                          f"{where['collection']} at {where['milvus']}, which has no shards to mend: finish it by "
                          "running its build command again (the ray engine, into the same collection)")


def remove_from_collection(catalogue: Catalogue, record: IndexInfo, ids: Sequence[int]) -> dict[str, Any]:
    """``remove_images`` of an index whose vectors are in Milvus: the rows leave its collection, and every server
    stops finding them at its next request."""
    from retrieval.index.milvus import milvus_build
    from retrieval.index.milvus.milvus_collection import connect

    place = _recorded_collection(record)
    client = connect(place)
    try:
        physical = str(record.vectors.vectors_in["physical"])  # type: ignore[index]  # _recorded_collection read it
        milvus_build.delete_ids(client, physical, sorted(set(ids)))
        milvus_build.reconcile(client, physical, catalogue)  # and what a removal killed midway left
    finally:
        client.close()
    return {"index_key": record.vectors.index_key, VECTORS_IN: record.vectors.vectors_in}
