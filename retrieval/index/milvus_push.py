"""``retrieval index push``: copy a finished index folder into a Milvus collection (``milvus_collection`` says
what the collection holds).

The contract: the collection records the model's hash, the embedding size and the preprocessing in its properties
and is marked ``pushing`` until every row is in, then ``complete``. A push killed at any moment is run again with
the same command: it reads the ids the collection already holds and sends only the others, so no row is sent twice
(Milvus does not refuse a repeated primary key: a row inserted twice would be found twice). A complete collection
of the same rows is left as it is; one of another model is refused, naming both hashes. One push at a time per
collection: two at once could both send a row the other has not yet written.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.index.embedder import l2_normalize_rows
from retrieval.index.filters import infer_column
from retrieval.index.milvus_collection import (
    COMPLETE,
    ID,
    LABEL,
    MAX_LABEL_CHARS,
    MAX_PATH_CHARS,
    MAX_TEXT_CHARS,
    PATH,
    PUSHING,
    RECORD,
    SHA256,
    VECTOR,
    CollectionRecord,
    MilvusError,
    MilvusPlace,
    collection_schema,
    column_fields,
    connect,
    read_record,
    refuse_other_model,
    vector_index_params,
)

BATCH_ROWS = 2000  # rows per insert: well under Milvus' 64 MiB gRPC message at 2048 float32 dimensions
ID_PAGE = 16384  # ids read back per page when a push resumes


def manifest_columns(ids: Sequence[int], extra: dict[int, str]) -> dict[str, tuple[bool, list[Any]]]:
    """Per manifest column (``filter_rows``' id -> JSON), whether it is text and its value per id (None:
    missing), read exactly as the local index's filters read it (``filters.infer_column``)."""
    from retrieval.index.filters import BUILT_IN_COLUMNS

    position = {int(i): n for n, i in enumerate(ids)}
    raw: dict[str, list[Any]] = {}
    for image_id, data in extra.items():
        try:
            values = json.loads(data)
        except ValueError:
            continue
        for key, value in values.items() if isinstance(values, dict) else ():
            if key in BUILT_IN_COLUMNS or key == "id":
                continue
            raw.setdefault(key, [None] * len(ids))[position[int(image_id)]] = value
    columns = {}
    for name, values in raw.items():
        column = infer_column(values)
        if column.is_text:
            categories = column.categories
            columns[name] = (True, [None if code < 0 else str(categories[code]) for code in column.values.tolist()])
        else:
            columns[name] = (False, [None if v != v else float(v) for v in column.values.tolist()])  # NaN: missing
    return columns


def push_index(index_dir: str | Path, place: MilvusPlace, index_type: str = "AUTOINDEX",
               batch_rows: int = BATCH_ROWS, progress: bool = True) -> dict[str, Any]:
    """Push the index in ``index_dir`` into ``place``'s collection (created with ``index_type`` when missing;
    resumed when a push was stopped); returns a summary (rows sent, rows already there, seconds)."""
    from retrieval.index.live import Snapshot
    from retrieval.index.shards import ShardStore
    from retrieval.index.vectors import done_chunks
    from retrieval.progress import progress_bar

    started = time.perf_counter()
    client = connect(place)
    with Snapshot.open(index_dir) as index:
        ids, paths, labels, extra = index.filter_rows()
        columns = manifest_columns(ids, extra)
        record = CollectionRecord(dict(index.info), column_fields([(n, t) for n, (t, _) in columns.items()]),
                                  index_type, PUSHING, rows=len(ids))
        existing = read_record(client, place.collection)
        if existing is not None:
            _check_resumable(existing, record, place)
            record = existing
        elif len(ids):
            _create(client, place.collection, record, _preprocessing(index))
        present = _present_ids(client, place.collection) if existing is not None else set()
        if existing is not None and existing.state == COMPLETE and present == set(ids):
            return {"collection": place.collection, "rows": len(ids), "sent": 0, "already_there": len(present),
                    "seconds": round(time.perf_counter() - started, 3), "state": COMPLETE}
        extra_present = present - set(ids)
        if extra_present:
            raise MilvusError("collection", f"{place.collection!r} holds {len(extra_present)} rows this index does "
                                            f"not have (e.g. id {min(extra_present)}): it was written by another "
                                            "index or command; push into a new collection")
        public = {int(i): (index.public_path(p), label) for i, p, label in zip(ids, paths, labels, strict=True)}
        values = {name: dict(zip(ids, column_values, strict=True)) for name, (_, column_values) in columns.items()}
        sha = {int(i): row.get("sha256") for i, row in index.catalogue.rows(ids).items()}
        done = {int(i): shard for i, shard in index.catalogue.shards_of(ids).items()}
        sent = 0
        bar = progress_bar(total=len(ids) - len(present), desc=f"push to {place.collection}", unit="row",
                           disable=not progress)
        with bar:
            for chunk_ids, vectors in done_chunks(ShardStore(index.layout.shards, read_only=True), done):
                keep = np.fromiter((int(i) not in present for i in chunk_ids), bool, len(chunk_ids))
                chunk_ids, vectors = chunk_ids[keep], l2_normalize_rows(vectors[keep], zero_rows="keep")
                for start in range(0, len(chunk_ids), batch_rows):
                    batch = chunk_ids[start: start + batch_rows].tolist()
                    rows = list(_rows(batch, vectors[start: start + batch_rows], public, sha, values, record))
                    client.insert(place.collection, rows)
                    sent += len(rows)
                    bar.update(len(rows))
        if len(ids):
            client.flush(place.collection)
            record.state = COMPLETE
            client.alter_collection_properties(place.collection, {RECORD: record.properties()[RECORD]})
    return {"collection": place.collection, "rows": len(ids), "sent": sent, "already_there": len(present),
            "seconds": round(time.perf_counter() - started, 3), "state": record.state if len(ids) else "empty"}


def _check_resumable(existing: CollectionRecord, wanted: CollectionRecord, place: MilvusPlace) -> None:
    """Refuse a collection that holds another model's vectors, other columns or another vector index type."""
    refuse_other_model(existing, wanted.model_hash, place.collection,
                       "push into a new collection (an upgrade switches an alias: `retrieval index upgrade`)")
    if existing.dim != wanted.dim or existing.columns != wanted.columns:
        raise MilvusError("collection", f"{place.collection!r} was pushed from an index with other vectors or "
                                        "manifest columns; push into a new collection")
    if existing.index_type != wanted.index_type:
        raise MilvusError("index_type", f"is {wanted.index_type}, but {place.collection!r} was created with "
                                        f"{existing.index_type}; give --index-type {existing.index_type} to resume, "
                                        "or push into a new collection")


def _create(client: Any, collection: str, record: CollectionRecord, preprocessing: dict[str, Any]) -> None:
    client.create_collection(collection, schema=collection_schema(record.dim, record.columns),
                             index_params=vector_index_params(client, record.index_type, record.rows, record.dim),
                             properties=record.properties(preprocessing), consistency_level="Strong")


def _preprocessing(index: Any) -> dict[str, Any]:
    """The model's preprocessing settings (size, resize, normalisation), as its ONNX metadata records them;
    ``{"model": "none"}`` for an index built from embeddings, ``{"model": "not found"}`` when its file is gone."""
    if not index.has_model:
        return {"model": "none"}
    try:
        config = dict(index.embedder.model_config)
    except (OSError, ValueError, AttributeError):
        return {"model": "not found"}
    return {key: config[key] for key in ("image_size", "input_size", "resize", "mean", "std", "normalize",
                                         "embedding_dim") if key in config}


def _present_ids(client: Any, collection: str) -> set[int]:
    """Every id the collection holds, read in pages."""
    iterator = client.query_iterator(collection, batch_size=ID_PAGE, filter="", output_fields=[ID])
    present: set[int] = set()
    try:
        while page := iterator.next():
            present.update(int(row[ID]) for row in page)
    finally:
        iterator.close()
    return present


def _rows(ids: list[int], vectors: np.ndarray, public: dict[int, tuple[str, str | None]], sha: dict[int, Any],
          values: dict[str, dict[int, Any]], record: CollectionRecord) -> Iterator[dict[str, Any]]:
    """The collection's rows of ``ids``, each value checked against its field's bound."""
    for image_id, vector in zip(ids, vectors.tolist(), strict=True):
        path, label = public[image_id]
        if len(path) > MAX_PATH_CHARS or (label is not None and len(label) > MAX_LABEL_CHARS):
            raise MilvusError("index", f"image {image_id} has a path or label longer than Milvus' field allows "
                                       f"({MAX_PATH_CHARS} / {MAX_LABEL_CHARS} characters): {path[:80]!r}")
        row = {ID: image_id, VECTOR: vector, PATH: path, LABEL: label, SHA256: sha.get(image_id)}
        for column in record.columns:
            value = values[column.name][image_id]
            if isinstance(value, str) and len(value) > MAX_TEXT_CHARS:
                raise MilvusError("index", f"image {image_id}'s column {column.name!r} holds {len(value)} "
                                           f"characters; a Milvus field takes at most {MAX_TEXT_CHARS}")
            row[column.field] = value
        yield row
