"""``MilvusIndex``: search an index held in a Milvus collection as ``Index`` searches a folder, with the same
results (``SearchResult``), filters (``where``, translated by ``milvus_collection.milvus_filter``), exclusions and
re-ranking (the candidates' vectors fetched from the collection).

Every answer is the collection's at the time of the request (strong consistency): a row that ``retrieval index
add`` or ``remove`` wrote is seen by the next search of every server. What is read once and kept (the labels'
typical class size that sets re-ranking's unset sizes) is read again after ``REFRESH_S``. Read side only.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path, PurePath
from typing import Any

import numpy as np

from retrieval.errors import ParameterError
from retrieval.index.display_columns import columns_of, with_columns
from retrieval.index.filters import Filter, parse_filter
from retrieval.index.milvus.milvus_client import MilvusUnavailable
from retrieval.index.milvus.milvus_collection import (
    ID,
    LABEL,
    PATH,
    SHA256,
    SIZE,
    VECTOR,
    CollectionRecord,
    MilvusError,
    MilvusPlace,
    connect,
    milvus_filter,
    read_record,
    search_params,
)
from retrieval.index.milvus.milvus_keywords import MilvusKeywords
from retrieval.index.portable import GalleryPlace, file_inside
from retrieval.index.query_embedder import (
    ImageEmbedder,
    NoModel,
    index_embedder,
    load_model,
    prepare_vectors,
)
from retrieval.index.search import MAX_K, IndexFacts, SearchResult, check_k, reranked_results
from retrieval.records.index_info import IndexInfo
from retrieval.rerank import Neighbourhood, RerankConfig, gallery_filled, neighbourhood_from_counts

STATS_EXACT_MAX = 200_000  # rows up to which ``stats`` reads every vector to measure recall
REFRESH_S = 60.0  # how long a label count read from the collection is kept
QUERY_PAGE = 16384  # rows per page when the whole collection is read (labels, ids)
READY_TIMEOUT_S = 5.0  # how long /health waits for Milvus to say the collection is loaded
MAX_ID_LIST = 4096  # ids per ``id in [...]`` expression: well under a server's expression size limit


class MilvusIndex(IndexFacts):
    """An index in a Milvus collection (``place``), searched with embeddings or with ``model``'s image embeddings.

    Paths are stored as the API shows them (relative to the gallery root); ``gallery_root`` is where the images
    are on this machine, for the image route (None: the pushed index's recorded root)."""

    remote = True  # every answer is asked of Milvus over the network

    def __init__(self, place: MilvusPlace, model: str | None = None, gallery_root: str | None = None,
                 client: Any = None) -> None:
        self.place = place
        self.client = client if client is not None else connect(place)
        record = read_record(self.client, place.collection)
        if record is None:
            raise MilvusError("collection", f"{place.collection!r} does not exist at {place.uri}; push an index "
                                            "into it first (`retrieval index push`)")
        self.client.ensure_loaded(place.collection)  # a collection comes back released after a restart
        # the collection's copy of index.json, with what searches it
        info = IndexInfo.from_json(record.info).with_fields({"index_key": f"Milvus {record.index_type}"})
        self.record, self.info = record, info
        self.identity = collection_identity(self.client, place.collection)
        self._model_path, self._embedder = model, None
        self._gallery_root = gallery_root
        self._neighbourhood: tuple[float, Neighbourhood] | None = None
        self._lock = threading.Lock()

    # --- what it is
    def close(self) -> None:
        self.client.close()

    def check_ready(self) -> None:
        """Raise ``MilvusUnavailable`` unless the collection can be searched now (loaded first if it was
        released)."""
        self.client.ensure_loaded(self.place.collection, timeout_s=READY_TIMEOUT_S)

    def __len__(self) -> int:
        rows = self.client.query(self.place.collection, filter="", output_fields=["count(*)"])
        return int(rows[0]["count(*)"])

    @property
    def embedder(self) -> ImageEmbedder:
        """The query model: ``model`` given at open, else the pushed index's model file where it is on this
        machine; it must be the collection's model or one declared compatible with it (``index_embedder``). A
        collection of vectors built from embeddings has none: a ``NoModel``, which refuses to embed."""
        if self._embedder is None:
            where = Path(str(self.place))
            if not self.has_model:
                self._embedder = NoModel(self.dim, where)
            else:
                path = self._model_path or self.info.model.path
                if not path or not Path(path).is_file():
                    raise ParameterError("model", f"is needed to search {self.place} with images: its model "
                                                  f"{self.model_hash} is not on this machine; give its ONNX file")
                self._embedder = index_embedder(self.info, load_model(path), where)
        return self._embedder

    @embedder.setter
    def embedder(self, embedder: ImageEmbedder) -> None:
        self._embedder = index_embedder(self.info, embedder, Path(str(self.place)))

    @property
    def root(self) -> Path:
        """Where index.json's relative paths start (a text model's): the collection's name, what a server calls it."""
        return Path(self.place.collection)

    @property
    def gallery_root(self) -> PurePath:
        """Where the images are: ``gallery_root`` given at open, else the pushed index's recorded root."""
        return PurePath(self._gallery_root or self.info.catalogue.gallery_root or "/")

    def public_path(self, path: str) -> str:
        """Paths are stored as shown: the path itself."""
        return path

    def image_file(self, path: str) -> str | None:
        """The file of a stored (relative) path under the gallery root; None for a path that would leave it, also
        through a symlinked folder (a collection's rows are anyone's who can write to it)."""
        return file_inside(self.gallery_root, path)

    @property
    def gallery(self) -> GalleryPlace:
        """Where its images are, as ``Index.gallery`` says it: its paths are stored relative to ``gallery_root``, so
        the gallery never moved from where they are read (``image_file`` finds each file)."""
        return GalleryPlace(self.gallery_root, self.gallery_root)

    @property
    def catalogue(self) -> MilvusCatalogue:
        """The catalogue queries a server asks of an index, answered from the collection."""
        return MilvusCatalogue(self)

    @functools.cached_property
    def ids(self) -> np.ndarray:
        """Every id the collection held when first asked, sorted int64."""
        ids = [int(row[ID]) for page in self._pages([ID]) for row in page]
        return np.unique(np.asarray(ids, dtype=np.int64))

    @functools.cached_property
    def keywords(self) -> MilvusKeywords | None:
        """The collection's keyword search (BM25 on the pushed ``text_columns``, ``milvus_keywords``); None where it
        was pushed without keywords."""
        return MilvusKeywords(self.client, self.place.collection) if self.record.text_columns else None

    @property
    def filter_table(self) -> MilvusColumns:
        """The columns a ``where`` may name, and what to check when a filter matches nothing."""
        return MilvusColumns(self)

    def stored_rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ids among ``ids`` the collection holds, sorted, and their stored vectors [n, d]."""
        held = np.intersect1d(np.asarray(ids, dtype=np.int64), self.ids)
        return held, self.reconstructed_vectors(held)

    def stats(self, queries: int = 500, seed: int = 1) -> dict[str, Any]:
        """``index stats`` of the collection: its rows, index type, model, and (up to ``STATS_EXACT_MAX`` rows) the
        recall of its search against exact search of a sample of its own vectors, with their latency."""
        from retrieval.index.faiss_backend import faiss_measure

        n, model = len(self.ids), self.info.model
        stats: dict[str, Any] = {
            "index_dir": str(self.place), "vectors": n,
            "counts": {"done": n, "pending": 0, "error": 0, "duplicate": 0, "removed": 0, "total": n, "not_listed": 0},
            "errors": 0, "error_examples": [], "throughput": {}, "index_key": f"Milvus {self.record.index_type}",
            "index_key_requested": None, "params": search_params(self.record.index_type, 10), "tuning": None,
            "model": {"model_path": model.path, "model_hash": model.hash, "embedding_dim": model.embedding_dim,
                      "model_normalized": model.normalized, "model_output": model.output},
            "size_on_disk_bytes": None, "queries": 0,
        }
        if n < 2 or n > STATS_EXACT_MAX:
            return stats | {"note": "recall not measured: it reads every vector of the collection" if n > 2 else ""}
        ids, vectors = self.stored_rows(self.ids)
        chosen = np.sort(np.random.default_rng(seed).choice(len(ids), min(queries, len(ids)), replace=False))
        k = min(10, n - 1)
        _, exact = faiss_measure.exact_knn(vectors[chosen], [(ids, vectors)], k + 1)
        exact = faiss_measure.drop_self(exact, ids[chosen], k)
        found = faiss_measure.drop_self(self.search_arrays(vectors[chosen], k + 1)[1], ids[chosen], k)
        return stats | {"queries": int(len(chosen)), "recall_1_at_1": faiss_measure.recall_at(found, exact, 1, 1),
                        f"recall_{k}_at_{k}": faiss_measure.recall_at(found, exact, k, k),
                        "latency": faiss_measure.latency_ms(lambda q: self.search_arrays(q, k), vectors[chosen])}

    # --- rows
    def indexed_rows(self, ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        """id -> row (id, path, label, sha256) of the ``ids`` the collection holds; others are absent."""
        return {int(row[ID]): _row(row) for row in self._rows_of(ids, [PATH, LABEL, SHA256, SIZE])}

    def _rows_of(self, ids: Sequence[int], fields: list[str]) -> list[dict[str, Any]]:
        """The rows of ``ids`` the collection holds, with ``fields``, read ``MAX_ID_LIST`` ids an expression."""
        wanted = sorted({int(i) for i in ids})
        return [row for start in range(0, len(wanted), MAX_ID_LIST)
                for row in self.client.query(self.place.collection, output_fields=fields,
                                             filter=f"{ID} in {wanted[start: start + MAX_ID_LIST]}")]

    def indexed_row(self, image_id: int) -> dict[str, Any] | None:
        return self.indexed_rows([image_id]).get(int(image_id))

    def indexed_by_sha256(self, sha256: str) -> dict[str, Any] | None:
        """The row (lowest id) whose file has this sha256."""
        if not isinstance(sha256, str) or not sha256.isalnum() or len(sha256) != 64:
            return None
        found = self.client.query(self.place.collection, filter=f'{SHA256} == "{sha256}"',
                                  output_fields=[PATH, LABEL, SHA256, SIZE])
        return _row(min(found, key=lambda row: row[ID])) if found else None

    def label_counts(self) -> dict[str | None, int]:
        """Rows per label (None: unlabelled), read page by page."""
        counts: dict[str | None, int] = {}
        for page in self._pages([LABEL]):
            for row in page:
                counts[row.get(LABEL)] = counts.get(row.get(LABEL), 0) + 1
        return counts

    def _pages(self, fields: list[str], where: str = "") -> Any:
        iterator = self.client.query_iterator(self.place.collection, batch_size=QUERY_PAGE, filter=where,
                                              output_fields=fields)
        try:
            while page := iterator.next():
                yield page
        finally:
            iterator.close()

    # --- filters
    def where_expression(self, where: str | Filter) -> str:
        """``where`` as the collection's boolean expression (FilterError: the local refusals)."""
        return milvus_filter(parse_filter(where) if isinstance(where, str) else where, self.record)

    def matching_ids(self, where: str | Filter) -> np.ndarray:
        """The sorted ids of the rows that match ``where``."""
        expression = self.where_expression(where)
        ids = [int(row[ID]) for page in self._pages([ID], expression) for row in page]
        return np.unique(np.asarray(ids, dtype=np.int64))

    # --- search
    def search_arrays(self, embeddings: np.ndarray, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
        """Cosine scores float32 [n, k] and ids int64 [n, k] (-1 where fewer than k), among all rows."""
        return self._search_arrays(embeddings, k)

    def _search_arrays(self, embeddings: np.ndarray, k: int, expression: str = "") -> tuple[np.ndarray, np.ndarray]:
        """``search_arrays`` among the rows matching ``expression`` (a Milvus expression; empty: all)."""
        queries = prepare_vectors(embeddings, self.dim)
        k = int(k)
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        ids = np.full((len(queries), k), -1, dtype=np.int64)
        if not len(queries):
            return scores, ids
        found = self.client.search(self.place.collection, data=queries.tolist(), limit=k, filter=expression,
                                   output_fields=[], anns_field=VECTOR,
                                   search_params=search_params(self.record.index_type, k))
        for row, hits in enumerate(found):
            for column, hit in enumerate(list(hits)[:k]):
                ids[row, column], scores[row, column] = int(hit["id"]), float(hit["distance"])
        return np.clip(scores, -1.0, 1.0, out=scores), ids

    def search(
        self, embeddings: np.ndarray, k: int = 10, exclude_ids: Collection[int] = (),
        where: str | Filter | None = None, rerank: RerankConfig | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> list[list[SearchResult]]:
        """Per query, the top-k rows best first (``Index.search``'s contract): ``exclude_ids`` left out (the
        collection is asked to leave them out, so k results remain where enough rows are left), ``where`` keeps
        the rows that match it, ``rerank`` re-orders each query's top ``rerank.candidates`` from their stored
        vectors."""
        k = check_k(k)
        reranking = rerank is not None and rerank.active
        if reranking:
            rerank = gallery_filled(rerank, self.rerank_neighbourhood)[0]
        depth = max(k, rerank.candidates) if reranking else k
        exclude = sorted({int(i) for i in exclude_ids})
        if len(exclude) > MAX_K:
            raise ValueError(f"exclude_ids holds {len(exclude)} ids; at most {MAX_K} can be left out")
        parts = [f"({self.where_expression(where)})"] if where is not None else []
        if exclude:
            parts.append(f"{ID} not in {exclude}")
        scores, ids = self._search_arrays(embeddings, depth, " and ".join(parts))
        rows = self.indexed_rows(ids[ids >= 0].tolist())
        results = []
        for query_scores, query_ids in zip(scores.tolist(), ids.tolist(), strict=True):
            results.append([SearchResult(i, rows[i]["path"], rows[i]["label"], s)
                            for s, i in zip(query_scores, query_ids, strict=True) if i in rows])
        if reranking:
            results = reranked_results(prepare_vectors(embeddings, self.dim), results, k, rerank,
                                       self.reconstructed_vectors, cancelled)
        return self.with_columns(results)

    def with_columns(self, found: list[list[SearchResult]]) -> list[list[SearchResult]]:
        """``found`` with each result's display columns (``display_columns``), read in one query of the collection."""
        return with_columns(found, self.columns_of)

    def columns_of(self, ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        """id -> the display columns of each of ``ids``, from the fields the collection keeps the manifest's
        columns in ({} where the index shows none)."""
        fields = {c.name: c.field for c in self.record.columns if c.name in self.display_columns}

        def metadata_of(wanted: list[int]) -> dict[int, dict[str, Any]]:
            rows = self._rows_of(wanted, list(fields.values())) if fields else []
            return {int(row[ID]): {name: row.get(field) for name, field in fields.items()} for row in rows}

        return columns_of(ids, self.display_columns, metadata_of)

    def search_selected(self, embeddings: np.ndarray, k: int, selected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The top-k among the ``selected`` ids alone (``Index.search_selected``'s contract), exactly, from the
        vectors the collection keeps of them (what a text query asks of its keyword hits: at most ``MAX_K``)."""
        from retrieval.index.faiss_backend.faiss_search import exact_among

        queries = prepare_vectors(embeddings, self.dim)
        wanted = np.asarray(selected, dtype=np.int64)
        if len(wanted) > MAX_K:
            raise ValueError(f"search_selected takes at most {MAX_K} ids, got {len(wanted)}")
        stored = {int(row[ID]): row[VECTOR] for row in self._rows_of(wanted.tolist(), [VECTOR])}
        if not stored:
            return np.zeros((len(queries), 0), np.float32), np.zeros((len(queries), 0), np.int64)
        ids = np.asarray(sorted(stored), dtype=np.int64)
        scores, found = exact_among(queries, np.asarray([stored[i] for i in ids.tolist()], np.float32), ids, k)
        return np.clip(scores, -1.0, 1.0, out=scores), found

    def rerank_neighbourhood(self) -> Neighbourhood:
        """The gallery's typical class size (``rerank.defaults``), from the labels, read again after ``REFRESH_S``."""
        with self._lock:
            now = time.monotonic()
            if self._neighbourhood is None or now - self._neighbourhood[0] > REFRESH_S:
                self._neighbourhood = (now, neighbourhood_from_counts(self.label_counts()))
            return self._neighbourhood[1]

    def reconstructed_vectors(self, ids: np.ndarray) -> np.ndarray:
        """The stored vectors [n, d] of ``ids`` (the collection keeps them exactly)."""
        ids = np.asarray(ids, dtype=np.int64)
        out = np.zeros((len(ids), self.dim), dtype=np.float32)
        vectors = {int(row[ID]): row[VECTOR] for row in self._rows_of(ids.tolist(), [VECTOR])}
        for n, image_id in enumerate(ids.tolist()):
            if image_id in vectors:
                out[n] = vectors[image_id]
        return out


def _row(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": int(row[ID]), "path": row.get(PATH), "label": row.get(LABEL), "sha256": row.get(SHA256),
            "size": row.get(SIZE)}


def open_collection_record(place: MilvusPlace) -> CollectionRecord | None:
    """The record of ``place``'s collection, None when it does not exist (one connection, closed)."""
    client = connect(place)
    try:
        return read_record(client, place.collection)
    finally:
        client.close()


def watch_identity(place: MilvusPlace) -> Callable[[], tuple[Any, ...] | None]:
    """``collection_identity`` of ``place`` through a connection of its own (the watcher's thread); None while
    Milvus cannot be reached (``LiveIndex`` then opens nothing: the served state answers 503 meanwhile and recovers
    by itself; a change is seen once it is back)."""
    client = None

    def identity() -> tuple[Any, ...] | None:
        nonlocal client
        try:
            if client is None:
                client = connect(place)
            return collection_identity(client, place.collection)
        except Exception as exc:  # noqa: BLE001  (unreachable: the state serves on, the next tick asks again)
            if client is not None and not isinstance(exc, MilvusUnavailable):
                client.close()
                client = None
            return None

    return identity


def collection_identity(client: Any, name: str) -> tuple[Any, ...]:
    """What a server watches to know a state must be opened again: the collection ``name`` serves (an upgrade moves
    the alias) and the model it records. Rows added or removed need no new state: every search reads them."""
    if not client.has_collection(name):
        return (None,)
    described = client.describe_collection(name)
    record = CollectionRecord.from_properties(described.get("properties") or {})
    return (described.get("collection_name"), None if record is None else record.model_hash)


class MilvusCatalogue:
    """The catalogue queries a server asks (labels, samples, duplicates), answered from a collection."""

    def __init__(self, index: MilvusIndex) -> None:
        self.index = index

    def labelled(self) -> list[tuple[int, str]]:
        """(id, label) of every labelled row, by id."""
        rows = [(int(row[ID]), str(row[LABEL])) for page in self.index._pages([LABEL], f"{LABEL} is not null")
                for row in page]
        return sorted(rows)

    def label_counts(self) -> dict[str | None, int]:
        return self.index.label_counts()

    def sample(self, count: int) -> list[dict[str, Any]]:
        """Up to ``count`` rows spread evenly over the ids."""
        ids = self.index.ids
        chosen = ids[np.linspace(0, len(ids) - 1, min(count, len(ids))).astype(int)] if len(ids) else ids
        rows = self.index.indexed_rows(chosen.tolist())
        return [rows[i] for i in sorted(rows)]

    def duplicates(self, limit: int) -> tuple[int, list[tuple[dict[str, Any], dict[str, Any] | None]]]:
        """A collection holds the indexed images only: the exact duplicates stayed in the pushed index's catalogue."""
        return 0, []

    def indexed_count(self) -> int:
        return len(self.index)


class MilvusColumns:
    """The filterable columns of a collection, and the hint when a filter matches no row."""

    def __init__(self, index: MilvusIndex) -> None:
        self.index = index

    def names(self) -> list[str]:
        return self.index.record.column_names()

    def no_match_hint(self) -> str:
        """How paths and labels compare, with one of the collection's own values, and the columns there are."""
        sample = self.index.catalogue.sample(1)
        example = f' (e.g. path = "{sample[0]["path"]}")' if sample else ""
        return (f"Paths are compared as the API shows them, relative to the gallery{example}, and labels exactly, "
                f"case included; the columns are: {', '.join(self.names())}")
