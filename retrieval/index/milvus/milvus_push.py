"""``retrieval index push``: copy a finished index folder into a Milvus collection (``milvus_collection`` says
what the collection holds).

The contract: the collection records the model's hash, the embedding size and the preprocessing in its properties
and is marked ``pushing`` until every row is in, then ``complete``. A push killed at any moment is run again with
the same command: it reads the ids the collection already holds and sends only the others, so no row is sent twice
(Milvus does not refuse a repeated primary key: a row inserted twice would be found twice). A complete collection
of the same rows is left as it is; one of another model is refused, naming both hashes. One push at a time per
collection: two at once could both send a row the other has not yet written. An index with keywords sends each row's
keyword text too (``milvus_keywords``); keywords added or changed go into a new collection the name then moves to.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from retrieval.index.display_columns import DISPLAY_COLUMNS
from retrieval.index.filters import BUILT_IN_COLUMNS, FilterTable
from retrieval.index.milvus.milvus_collection import (
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
    SHARD,
    SIZE,
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
from retrieval.index.milvus.milvus_keywords import KEYWORDS, add_keyword_fields, add_keyword_index, keyword_texts
from retrieval.index.query_embedder import l2_normalize_rows

if TYPE_CHECKING:
    from retrieval.data.preprocessing import ModelPreprocessing

BATCH_ROWS = 2000  # rows per insert: well under Milvus' 64 MiB gRPC message at 2048 float32 dimensions
ID_PAGE = 16384  # rows read back per page when a push resumes
DELETE_IDS = 4096  # ids per delete expression: well under a server's expression size limit
PUSH_CLAIM = "retrieval.push"  # the collection property of the push at work: {"token", "at"}
CLAIM_STALE_S = 120.0  # a claim not renewed for this long is a push that died
CLAIM_SETTLE_S = 0.5  # between writing a claim and reading it back: longer than two pushes' check-to-write gap


def manifest_columns(table: FilterTable) -> dict[str, tuple[bool, list[Any]]]:
    """Per manifest column of ``table`` (the local index's filter columns), whether it is text and its value per
    row (None: missing), exactly as the local filters compare them."""
    columns = {}
    for name in table.names():
        if name in BUILT_IN_COLUMNS:
            continue
        column = table.column(name)
        if column.is_text:
            categories = column.categories
            columns[name] = (True, [None if code < 0 else str(categories[code]) for code in column.values.tolist()])
        else:
            columns[name] = (False, [None if v != v else float(v) for v in column.values.tolist()])  # NaN: missing
    return columns


def push_index(index_dir: str | Path, place: MilvusPlace, index_type: str | None = None,
               batch_rows: int = BATCH_ROWS, progress: bool = True, switch: bool = False) -> dict[str, Any]:
    """Make ``place``'s collection hold exactly the rows of the index in ``index_dir``; returns a summary.

    ``place.collection`` is the name servers use: an alias of a collection named after it and the model
    (``physical_name``), created with ``index_type`` (default AUTOINDEX; None: the existing collection's) and
    given the alias once its every row is in, so that no
    server sees a half-pushed collection. Pushed again (after ``index add``, ``remove`` or a relabel), it sends
    the rows the collection lacks, writes again those whose path, label or columns changed and deletes those the
    index no longer holds. An index of another model is refused, naming both hashes, unless ``switch``: then it
    goes into its own collection and the alias moves to it in one step (``index upgrade``), the old collection
    dropped after."""
    from retrieval.index.live import Snapshot

    started = time.perf_counter()
    client = connect(place)
    try:
        with Snapshot.open(index_dir) as index:
            ids, paths, labels, extra = index.filter_rows()
            columns = manifest_columns(FilterTable(ids, paths, labels, extra))
            keywords = keyword_texts(index_dir, index.info)  # the text_columns' FTS5 terms (None: no keywords)
            keyword_columns = index.info.catalogue.text_columns if keywords is not None else None
            wanted = CollectionRecord(index.info.to_json(), column_fields([(n, t) for n, (t, _) in columns.items()]),
                                      index_type or "AUTOINDEX", PUSHING, rows=len(ids),
                                      text_columns=list(keyword_columns or ()))
            served = served_collection(client, place.collection)
            own = physical_name(place.collection, wanted.model_hash, wanted.text_columns)
            target = own if served is None else served
            if served is not None:
                current = read_record(client, served)
                if current.text_columns != wanted.text_columns and current.model_hash == wanted.model_hash:
                    target = own  # keywords added or changed: a collection of their schema, the name moved to it
                elif switch and current.model_hash != wanted.model_hash \
                        and not compatible_upgrade(current, wanted, index):
                    target = own
            record = read_record(client, target)
            created = record is None
            if created:
                record = wanted
                try:
                    create_collection(client, target, record, _preprocessing(index))
                except Exception:  # another push created it meanwhile: the claim below says which one goes on
                    if not client.has_collection(target):
                        raise
            with PushClaim(client, target, place.collection) as claim:
                if not created and compatible_upgrade(record, wanted, index):  # the new model's queries, rows re-sent
                    record.info, record.state = wanted.info, PUSHING
                    client.alter_collection_properties(target, record.properties(_preprocessing(index)))
                elif not created:
                    check_resumable(record, wanted if index_type else replace(wanted, index_type=record.index_type),
                                     target)
                    # what answers show is the index's to change (`index columns`): a push brings it along (the
                    # collection's copy of index.json, as it is sent)
                    record.info = {key: value for key, value in record.info.items() if key != DISPLAY_COLUMNS} | (
                        {DISPLAY_COLUMNS: wanted.info[DISPLAY_COLUMNS]} if DISPLAY_COLUMNS in wanted.info else {})
                rows = _collection_rows(client, target, record)
                sent, deleted = _write(client, target, record, index, ids, paths, labels, columns, rows, batch_rows,
                                       progress, claim.renew, keywords or {})
                record.state, record.rows = COMPLETE, len(ids)
                client.flush(target)
                client.alter_collection_properties(target, {RECORD: record.properties()[RECORD]})
                old = point_alias(client, place.collection, target, served)
    finally:
        client.close()
    return {"collection": place.collection, "physical": target, "rows": len(ids), "sent": sent,
            "already_there": len(rows) - deleted, "deleted": deleted, "dropped": old,
            "seconds": round(time.perf_counter() - started, 3), "state": COMPLETE}


class PushClaim:
    """One push at a time into a collection (two at once could both insert a row neither had seen: it would be
    found twice). A push checks that no other one has shown a sign of life in the collection's ``PUSH_CLAIM``
    property within ``CLAIM_STALE_S``, writes its own token there, waits ``CLAIM_SETTLE_S`` and reads it back: of
    two pushes that checked at once, the one whose token was overwritten stops, before it wrote a row. The holder
    renews it as it goes (``renew``) and clears it at the end; a push killed midway leaves one that goes stale."""

    def __init__(self, client: Any, collection: str, name: str) -> None:
        self.client, self.collection, self.name = client, collection, name
        self.token = secrets.token_hex(8)
        self._renewed = 0.0

    def _holder(self) -> dict[str, Any] | None:
        """The claim in the collection's properties, None when there is none (or it is stale or unreadable)."""
        raw = (self.client.describe_collection(self.collection).get("properties") or {}).get(PUSH_CLAIM)
        try:
            claim = json.loads(raw) if raw else None
            if not isinstance(claim, dict) or time.time() - float(claim["at"]) > CLAIM_STALE_S:
                return None
            return claim
        except (TypeError, ValueError, KeyError):
            return None

    def _refuse(self, claim: dict[str, Any]) -> None:
        seen = max(0, round(time.time() - float(claim["at"])))
        left = max(1, round(CLAIM_STALE_S - seen))
        raise MilvusError("collection", f"another `retrieval index push` into {self.name!r} is running (its last "
                                        f"sign of life {seen} s ago); wait for it to finish, then run this command "
                                        "again: it sends whatever the collection still lacks (a push that was "
                                        f"killed holds the collection {left} s more)")

    def _write(self) -> None:
        self._renewed = time.monotonic()
        self.client.alter_collection_properties(
            self.collection, {PUSH_CLAIM: json.dumps({"token": self.token, "at": time.time()})})

    def __enter__(self) -> PushClaim:
        holder = self._holder()
        if holder is not None and holder.get("token") != self.token:
            self._refuse(holder)
        self._write()
        time.sleep(CLAIM_SETTLE_S)
        holder = self._holder()
        if holder is None or holder.get("token") != self.token:
            self._refuse(holder or {"at": time.time()})
        return self

    def renew(self) -> None:
        """Show a sign of life (at most every ``CLAIM_STALE_S / 4`` seconds)."""
        if time.monotonic() - self._renewed > CLAIM_STALE_S / 4:
            self._write()

    def __exit__(self, *exc: object) -> None:
        holder = self._holder()
        if holder is not None and holder.get("token") == self.token:
            self.client.alter_collection_properties(self.collection, {PUSH_CLAIM: ""})


def new_images_check(index_dir: str | Path, place: MilvusPlace) -> Callable[[Sequence[Any]], None]:
    """For ``add_images`` (``check_new``): refuse, before anything is written, new images whose manifest columns
    the collection ``place`` serves could not take (a collection's columns are fixed when it is made; a push after
    the add would be refused, and every push after it)."""

    def check(items: Sequence[Any]) -> None:
        client = connect(place)
        try:
            served = served_collection(client, place.collection)
            record = None if served is None else read_record(client, served)
        finally:
            client.close()
        if record is None:  # a new collection takes whatever columns the index has
            return
        from retrieval.index.live import Snapshot

        with Snapshot.open(index_dir) as index:
            ids, paths, labels, extra = index.filter_rows()
        first = max(ids, default=-1) + 1  # the new images' rows, after the index's own (their ids do not matter)
        new_ids = list(range(first, first + len(items)))
        table = FilterTable([*ids, *new_ids], [*paths, *(item.path for item in items)],
                            [*labels, *(item.label for item in items)],
                            dict(extra) | {i: json.dumps(item.extra) for i, item in zip(new_ids, items, strict=True)
                                           if item.extra})
        after = {c.name: c.kind for c in column_fields([(n, t) for n, (t, _) in manifest_columns(table).items()])}
        held = {c.name: c.kind for c in record.columns}
        if after == held:
            return
        problems = [f"{name!r} ({kind}), which it does not have" for name, kind in after.items() if name not in held]
        problems += [f"{name!r} as {after[name]}, which it holds as {kind}" for name, kind in held.items()
                     if name in after and after[name] != kind]
        problems += [f"no {name!r} any more" for name in held if name not in after]
        raise MilvusError("images", f"would give the index manifest columns the Milvus collection "
                                    f"{place.collection!r} cannot take: {'; '.join(problems)} (a collection's columns "
                                    "are fixed when it is made). Nothing was written. Add the images without those "
                                    "columns, or add them to the folder alone, push the index into a new collection "
                                    "with `retrieval index push` and serve that one")

    return check


def compatible_upgrade(existing: CollectionRecord, wanted: CollectionRecord, index: Any) -> bool:
    """Whether the index's model is declared compatible with the collection's and embeds in its size (what ``index
    upgrade`` re-embeds in place, its mixed mode): its rows then replace the old ones in the same collection, which
    keeps serving, old and new vectors together, as the local index does."""
    from retrieval.index.query_embedder import is_compatible, with_output

    if existing.model_hash == wanted.model_hash or not index.has_model or existing.dim != wanted.dim \
            or existing.columns != wanted.columns or existing.text_columns != wanted.text_columns:
        return False
    try:
        model = with_output(index.embedder, None)
    except (OSError, ValueError):  # the model file is gone: nothing says it is compatible
        return False
    return is_compatible(model, existing.index_info)


def physical_name(name: str, model_hash: str | None, text_columns: Sequence[str] = ()) -> str:
    """The collection that holds the rows served under ``name`` for one model: ``NAME__<hash>``, and
    ``__k<digest>`` of its ``text_columns`` where it has keywords (a schema of their own)."""
    keywords = f"__k{hashlib.sha256(json.dumps(list(text_columns)).encode()).hexdigest()[:8]}" if text_columns else ""
    return f"{name}__{(model_hash or 'vectors')[:16]}{keywords}"


def served_collection(client: Any, name: str) -> str | None:
    """The collection ``name`` serves now (itself, or the one its alias points to); None when neither exists."""
    if not client.has_collection(name):
        return None
    return str(client.describe_collection(name).get("collection_name") or name)


def point_alias(client: Any, name: str, target: str, served: str | None) -> str | None:
    """Point the alias ``name`` at ``target`` in one step; the collection it left is dropped (its name returned)."""
    if served == target:
        return None
    if served is None:
        try:
            client.create_alias(target, name)
        except Exception:  # made meanwhile, by a push into another collection: refused, naming it
            if served_collection(client, name) != target:
                raise MilvusError("collection", f"{name!r} was given to {served_collection(client, name)} while "
                                                f"this push filled {target}; run the command again") from None
        return None
    client.alter_alias(target, name)
    client.drop_collection(served)
    return served


def _collection_rows(client: Any, collection: str, record: CollectionRecord) -> dict[int, tuple]:
    """id -> (path, label, shard, column values...) of every row ``collection`` holds, read in pages."""
    fields = [PATH, LABEL, SHARD, *(c.field for c in record.columns), *([KEYWORDS] if record.text_columns else [])]
    iterator = client.query_iterator(collection, batch_size=ID_PAGE, filter="", output_fields=fields)
    rows: dict[int, tuple] = {}
    try:
        while page := iterator.next():
            rows.update((int(row[ID]), tuple(row.get(f) for f in fields)) for row in page)
    finally:
        iterator.close()
    return rows


def _write(client: Any, collection: str, record: CollectionRecord, index: Any, ids: list[int], paths: list[str],
           labels: list[str | None], columns: dict[str, tuple[bool, list[Any]]], present: dict[int, tuple],
           batch_rows: int, progress: bool, alive: Callable[[], None],
           keywords: dict[int, str]) -> tuple[int, int]:
    """Send the rows ``present`` lacks or holds otherwise, delete those the index no longer holds; (sent,
    deleted). ``alive`` is called after each batch (``PushClaim.renew``); ``keywords``: id -> keyword text."""
    from retrieval.index.shards import ShardStore
    from retrieval.index.vectors import done_chunks
    from retrieval.utils.progress import progress_bar

    public = {int(i): (index.public_path(p), label) for i, p, label in zip(ids, paths, labels, strict=True)}
    values = {name: dict(zip(ids, column_values, strict=True)) for name, (_, column_values) in columns.items()}
    shard_of = {int(i): shard for i, shard in index.catalogue.shards_of(public).items()}
    keyword_of = {i: keywords.get(i, "") for i in public} if record.text_columns else {}
    wanted = {i: (public[i][0], public[i][1], shard_of.get(i), *(values[c.name][i] for c in record.columns),
                  *([keyword_of[i]] if record.text_columns else [])) for i in public}
    stale = [i for i in present if i not in wanted]
    for start in range(0, len(stale), DELETE_IDS):
        client.delete(collection, filter=f"{ID} in {stale[start: start + DELETE_IDS]}")
    changed = {i for i, row in wanted.items() if present.get(i) != row}  # new, relabelled or re-embedded
    sha = {int(i): (row.get("sha256"), row.get("size")) for i, row in index.catalogue.rows(sorted(changed)).items()}
    done = {i: shard_of[i] for i in changed if i in shard_of}
    sent = 0
    with progress_bar(total=len(changed), desc=f"push to {collection}", unit="row", disable=not progress) as bar:
        for chunk_ids, vectors in done_chunks(ShardStore(index.layout.shards, read_only=True), done):
            vectors = l2_normalize_rows(vectors, zero_rows="keep")
            for start in range(0, len(chunk_ids), batch_rows):
                batch = chunk_ids[start: start + batch_rows].tolist()
                rows = list(_rows(batch, vectors[start: start + batch_rows], public, sha, values, record, done))
                if record.text_columns:
                    rows = [row | {KEYWORDS: keyword_of[row[ID]]} for row in rows]
                fresh = [row for row in rows if row[ID] not in present]
                if fresh:  # insert: no row of theirs is there (an insert of a present id would be a second row)
                    client.insert(collection, fresh)
                if len(fresh) < len(rows):
                    client.upsert(collection, [row for row in rows if row[ID] in present])
                sent += len(rows)
                bar.update(len(rows))
                alive()
    return sent, len(stale)


def check_resumable(existing: CollectionRecord, wanted: CollectionRecord, collection: str) -> None:
    """Refuse a collection that holds another model's vectors, other columns or another vector index type."""
    refuse_other_model(existing, wanted.model_hash, collection,
                       "push into a new collection, or move this name to the new model's vectors with "
                       "`retrieval index upgrade`")
    if existing.dim != wanted.dim or existing.columns != wanted.columns \
            or existing.text_columns != wanted.text_columns:
        raise MilvusError("collection", f"{collection!r} was pushed from an index with other vectors or "
                                        "manifest columns; push into a new collection")
    if existing.index_type != wanted.index_type:
        raise MilvusError("index_type", f"is {wanted.index_type}, but {collection!r} was created with "
                                        f"{existing.index_type}; give {existing.index_type} (or none) to resume, "
                                        "or push into a new collection")


def create_collection(client: Any, collection: str, record: CollectionRecord, preprocessing: dict[str, Any]) -> None:
    schema = collection_schema(record.dim, record.columns)
    index_params = vector_index_params(client, record.index_type, record.rows, record.dim)
    if record.text_columns:  # the keywords' text and the BM25 vector Milvus makes of it
        add_keyword_fields(schema)
        add_keyword_index(index_params)
    client.create_collection(collection, schema=schema, index_params=index_params,
                             properties=record.properties(preprocessing), consistency_level="Strong")


def _preprocessing(index: Any) -> dict[str, Any]:
    """The model's preprocessing settings (size, resize, normalisation), as its ONNX metadata records them;
    ``{"model": "none"}`` for an index built from embeddings, ``{"model": "not found"}`` when its file is gone."""
    if not index.has_model:
        return {"model": "none"}
    try:
        preprocessing = index.embedder.preprocessing
    except (OSError, ValueError, AttributeError):
        return {"model": "not found"}
    return preprocessing_of(preprocessing)


def preprocessing_of(preprocessing: ModelPreprocessing) -> dict[str, Any]:
    """The preprocessing settings of a model that a collection's properties record, as its model config holds them
    (``resize`` only where the model records a mode)."""
    config = preprocessing.to_config()
    return {key: config[key] for key in ("input_size", "resize", "mean", "std", "normalize", "embedding_dim")
            if key in config}


def _rows(ids: list[int], vectors: np.ndarray, public: dict[int, tuple[str, str | None]], sha: dict[int, Any],
          values: dict[str, dict[int, Any]], record: CollectionRecord,
          shard_of: dict[int, str]) -> Iterator[dict[str, Any]]:
    """The collection's rows of ``ids``, each value checked against its field's bound."""
    for image_id, vector in zip(ids, vectors.tolist(), strict=True):
        path, label = public[image_id]
        digest, size = sha.get(image_id, (None, None))
        row = {ID: image_id, VECTOR: vector, SHA256: digest, SIZE: size, SHARD: shard_of.get(image_id)}
        yield row | scalar_fields(image_id, path, label, {c.name: values[c.name][image_id] for c in record.columns},
                                  record)


def scalar_fields(image_id: int, path: str, label: str | None, values: Mapping[str, Any],
                  record: CollectionRecord) -> dict[str, Any]:
    """A row's path, label and manifest columns (by column name in ``values``) as the collection's fields, each
    checked against its field's bound: what a push and a Ray build into a collection write alike."""
    if len(path) > MAX_PATH_CHARS or (label is not None and len(label) > MAX_LABEL_CHARS):
        raise MilvusError("index", f"image {image_id} has a path or label longer than Milvus' field allows "
                                   f"({MAX_PATH_CHARS} / {MAX_LABEL_CHARS} characters): {path[:80]!r}")
    fields: dict[str, Any] = {PATH: path, LABEL: label}
    for column in record.columns:
        value = values.get(column.name)
        if isinstance(value, str) and len(value) > MAX_TEXT_CHARS:
            raise MilvusError("index", f"image {image_id}'s column {column.name!r} holds {len(value)} "
                                       f"characters; a Milvus field takes at most {MAX_TEXT_CHARS}")
        fields[column.field] = value
    return fields
