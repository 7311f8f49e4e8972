"""The collection side of ``retrieval index build --engine ray --milvus URI --collection NAME``: a Ray build whose
vectors go from the embedding actors straight into a Milvus collection (``ray_stages.CollectionWriter``), never
through this process.

The contract is ``retrieval index push``'s (``milvus_push``): the same schema, properties and record, the rows in
``NAME__<model hash>`` (``physical_name``), marked ``pushing`` until every row is in, then ``complete``, and only
then the alias ``NAME`` created, so no server sees a half-built collection; a collection of another model is
refused, naming both hashes.

The index folder keeps the catalogue, the source of truth: a row is marked done once the actor that wrote it has
said so, so a killed build resumes over the rows still pending. The writers upsert, so a row written before a
kill and sent again after it stays one row. Exact copies (same sha256) are found by the driver as the facts come
back, as locally (the first copy in catalogue order is kept); the later copies were written by then, and are
deleted from the collection by id before the catalogue records them (a short list per shard), so a kill between
the two deletes them again when they are re-sent. The folder holds no shards and no faiss index: index.json
names the collection (``VECTORS_IN``), and the commands that need local vectors refuse it, naming the collection
(``IndexLayout.require_finished``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any

from retrieval.index.catalogue import Catalogue, Status
from retrieval.index.filters import FilterTable
from retrieval.index.layout import VECTORS_IN
from retrieval.index.milvus.milvus_collection import (
    COMPLETE,
    ID,
    PUSHING,
    RECORD,
    CollectionRecord,
    MilvusError,
    MilvusPlace,
    column_fields,
    read_record,
    refuse_other_model,
)
from retrieval.index.milvus.milvus_push import (
    DELETE_IDS,
    ID_PAGE,
    check_resumable,
    create_collection,
    manifest_columns,
    physical_name,
    point_alias,
    scalar_fields,
    served_collection,
)
from retrieval.index.search import public_path
from retrieval.records.index_info import IndexInfo

IN_COLLECTION = "milvus"  # the catalogue's shard of a row whose vector is in the collection, not in a shard file
LITE_REFUSED = (
    "is a Milvus Lite file, which only one process can open, and a Ray build writes from its actors, which are "
    "other processes (on other machines, too): give a Milvus server's URL (http://HOST:19530; on one machine "
    "`milvus-lite server --data-dir DIR` serves a Lite engine on a port), or build with the local engine and "
    "push the folder into the file (`retrieval index push INDEX --milvus FILE.db --collection NAME`)"
)


@dataclasses.dataclass
class CollectionBuild:
    """Where a build writes: ``place`` (the name servers use), the ``physical`` collection, the collection ``served``
    under the name when the build started (None, or the physical one) and its ``record``."""

    place: MilvusPlace
    physical: str
    served: str | None
    record: CollectionRecord

    @property
    def where(self) -> dict[str, str]:
        """What index.json and the catalogue record of it (``VECTORS_IN``)."""
        return recorded_place(self.place, self.physical)


def recorded_place(place: MilvusPlace, physical: str) -> dict[str, str]:
    """``VECTORS_IN``'s value: the server, the name servers use and the collection that holds the rows."""
    return {"milvus": place.uri, "collection": place.collection, "physical": physical}


def check_build_place(place: MilvusPlace, engine: str) -> None:
    """A build into a collection needs the Ray engine and a Milvus server (the actors write to it)."""
    if engine != "ray":
        raise MilvusError("engine", f"is {engine}, and a build writes into a Milvus collection with the ray engine "
                                    "only (its actors write the vectors straight into Milvus); with the local engine, "
                                    "build the folder, then push it (`retrieval index push INDEX --milvus URI "
                                    "--collection NAME`)")
    if place.is_lite:
        raise MilvusError("milvus", f"{place.uri!r} {LITE_REFUSED}")


def check_same_place(catalogue: Catalogue, place: MilvusPlace | None, root: Any) -> None:
    """A resumed build writes where it started: into the same collection, or into shards when it started so."""
    recorded = catalogue.get_meta(VECTORS_IN)
    if recorded is None and place is None:
        return
    if recorded is None:
        raise FileExistsError(f"{root} holds an interrupted build whose vectors go into shards in the folder; finish "
                              "it as it started (into the folder, not into Milvus), or build into another folder")
    where = json.loads(recorded)
    if place is None or (place.uri, place.collection) != (where["milvus"], where["collection"]):
        raise FileExistsError(f"{root} holds an interrupted build into the Milvus collection {where['collection']} "
                              f"at {where['milvus']}; finish it with the ray engine into that collection (`retrieval "
                              f"index build ... --milvus {where['milvus']} --collection {where['collection']}`), or "
                              "build into another folder")


@dataclasses.dataclass
class PlannedRows:
    """Every planned row's id, path and label, and the manifest's columns typed as the local filters read them
    (over all planned rows: the collection's schema is fixed before the first row is embedded)."""

    ids: list[int]
    paths: list[str]
    labels: list[str | None]
    columns: dict[str, tuple[bool, list[Any]]]

    @classmethod
    def read(cls, catalogue: Catalogue) -> PlannedRows:
        ids, paths, labels, extra = catalogue.filter_rows(status=None)
        return cls(ids, paths, labels, manifest_columns(FilterTable(ids, paths, labels, extra)))


def start(client: Any, place: MilvusPlace, catalogue: Catalogue, info: IndexInfo, index_type: str | None,
          preprocessing: Mapping[str, Any]) -> CollectionBuild:
    """Create the build's collection, or check the one an interrupted build of this folder left (same model,
    columns and vector index); a collection this folder did not start is refused."""
    columns = PlannedRows.read(catalogue).columns
    wanted = CollectionRecord(info.to_json(), column_fields([(n, t) for n, (t, _) in columns.items()]),
                              index_type or "AUTOINDEX", PUSHING, rows=catalogue.counts()["total"])
    physical = physical_name(place.collection, wanted.model_hash)
    served = served_collection(client, place.collection)
    if served is not None and served != physical:
        refuse_other_model(read_record(client, served), wanted.model_hash, place.collection,
                           "build into another collection name, or move this one to the new model with "
                           "`retrieval index upgrade`")
        raise MilvusError("collection", f"{place.collection!r} serves the collection {served!r}, not {physical!r}; "
                                        "build into another collection name")
    record = read_record(client, physical)
    owned = catalogue.get_meta(VECTORS_IN) == json.dumps(recorded_place(place, physical))
    if record is None:
        create_collection(client, physical, wanted, dict(preprocessing))
        return CollectionBuild(place, physical, served, wanted)
    refuse_other_model(record, wanted.model_hash, physical, "build into another collection name")
    if not owned:
        raise MilvusError("collection", f"{physical!r} already exists at {place.uri} and this build did not start "
                                        "it (an index pushed or built from another folder); build into another "
                                        "collection name, or update that index with `retrieval index add`")
    check_resumable(record, wanted if index_type else dataclasses.replace(wanted, index_type=record.index_type),
                    physical)
    return CollectionBuild(place, physical, served, record)


def row_fields(planned: PlannedRows, record: CollectionRecord, gallery_root: str,
               wanted: Sequence[int]) -> dict[int, str]:
    """id -> the JSON of the collection fields a writer sends with the row's vector (its path as the API shows it,
    label and manifest columns), for the ``wanted`` ids, each value checked against its field's bound."""
    root, wanted_ids = PurePosixPath(gallery_root), {int(i) for i in wanted}
    out = {}
    for position, (image_id, path, label) in enumerate(zip(planned.ids, planned.paths, planned.labels,
                                                            strict=True)):
        if image_id in wanted_ids:
            values = {name: column_values[position] for name, (_, column_values) in planned.columns.items()}
            out[image_id] = json.dumps(scalar_fields(image_id, public_path(path, root), label, values, record),
                                       ensure_ascii=False)
    return out


def delete_ids(client: Any, collection: str, ids: Sequence[int]) -> None:
    """Delete the rows of ``ids`` (a short list: a shard's copies and unreadable files)."""
    ids = [int(i) for i in ids]
    for start_at in range(0, len(ids), DELETE_IDS):
        client.delete(collection, filter=f"{ID} in {ids[start_at: start_at + DELETE_IDS]}")


def reconcile(client: Any, collection: str, catalogue: Catalogue) -> list[int]:
    """Make the collection hold exactly the catalogue's done rows: counted first (one query); only when the count
    differs are the ids read, the stray ones deleted, and the done ids the collection lacks returned (the caller
    sends them again)."""
    client.flush(collection)
    done = set(catalogue.ids_with_status(Status.DONE))
    held = int(client.query(collection, filter="", output_fields=["count(*)"])[0]["count(*)"])
    if held == len(done):
        return []
    present = collection_ids(client, collection)
    delete_ids(client, collection, sorted(present - done))
    return sorted(done - present)


def collection_ids(client: Any, collection: str) -> set[int]:
    """Every id ``collection`` holds, read in pages."""
    iterator = client.query_iterator(collection, batch_size=ID_PAGE, filter="", output_fields=[ID])
    ids: set[int] = set()
    try:
        while page := iterator.next():
            ids.update(int(row[ID]) for row in page)
    finally:
        iterator.close()
    return ids


def finish(client: Any, build: CollectionBuild, rows: int) -> None:
    """Mark the collection complete, then point the name servers use at it (created, or already there)."""
    build.record.state, build.record.rows = COMPLETE, rows
    client.flush(build.physical)
    client.alter_collection_properties(build.physical, {RECORD: build.record.properties()[RECORD]})
    point_alias(client, build.place.collection, build.physical, build.served)
