"""``Index``: open an index folder and search it with embeddings or images (the one read path: the CLI, the
service and the app all search through it; a server holds ``live.Snapshot``s of it, see ``retrieval.index.live``)."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import posixpath
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

import faiss
import numpy as np

from retrieval.errors import ParameterError
from retrieval.index.catalogue_reader import CatalogueQueries, CatalogueReader
from retrieval.index.catalogue_schema import Status
from retrieval.index.display_columns import checked_columns, columns_of, with_columns
from retrieval.index.faiss_backend import faiss_files, faiss_gpu, faiss_params, faiss_search
from retrieval.index.filters import Filter, FilterTable, parse_filter
from retrieval.index.layout import IndexLayout
from retrieval.index.portable import GalleryPlace, find_model, gallery_place
from retrieval.index.query_embedder import (
    ImageEmbedder,
    NoModel,
    hash_matches,
    index_embedder,
    load_model,
    prepare_vectors,
)
from retrieval.index.sources import is_url
from retrieval.records.index_info import IndexInfo
from retrieval.rerank import Neighbourhood, RerankConfig, gallery_filled, neighbourhood_from_counts, rerank_lists
from retrieval.text.keywords import FolderKeywords, KeywordSearch

MAX_K = 1000  # the most results one query may ask for (the API, the app and the CLI share it)
# SearchResult's fields left out of ``to_dict`` when None
OPTIONAL_RESULT_FIELDS = ("rerank_score", "columns", "source")


def check_k(k: object, name: str = "k") -> int:
    """``k`` as an int, or a ValueError saying it must be an integer in [1, MAX_K] (``name``: how it is called)."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= MAX_K:
        raise ValueError(f"{name} must be an integer between 1 and {MAX_K}, got {repr(k)[:40]}")
    return int(k)


def gallery_root(info: IndexInfo, catalogue: CatalogueQueries) -> PurePath:
    """The folder that paths shown to people and programs are relative to: index.json's ``gallery_root``, else
    the deepest folder holding every catalogued path."""
    recorded = info.catalogue.gallery_root
    if recorded:
        return PurePath(recorded)
    first, last = catalogue.path_range()
    if not first or not last:
        return PurePath("/")
    prefix = os.path.commonprefix([first, last])  # every path sorting in between starts with it too
    return PurePath(prefix[: prefix.rfind("/") + 1].rstrip("/") or "/")


def public_path(path: str, root: PurePath) -> str:
    """A catalogued path as the API, the app, filters, removal and exports show it: relative to the gallery root,
    never a server's absolute path. One catalogued outside the root (``index add`` from another folder) walks up
    with ``..`` (``../more/horse/h.jpg``): unique and stable like the absolute path it stands for, and accepted
    back by ``index remove`` (``catalogue_id``). A URL (a build from embeddings keeps its metadata's) stays itself."""
    if is_url(path):
        return path
    pure = PurePosixPath(path)
    if pure.is_relative_to(root):
        return pure.relative_to(root).as_posix()
    if not (pure.is_absolute() and PurePosixPath(root).is_absolute()):
        return pure.as_posix()
    return posixpath.relpath(pure.as_posix(), PurePosixPath(root).as_posix())  # both absolute: no working folder


@dataclass(frozen=True)
class SearchResult:
    id: int
    path: str
    label: str | None
    score: float  # cosine similarity, within [-1, 1]
    rerank_score: float | None = None  # the re-ranking's score that ordered it (None: not re-ranked)
    # the index's display columns of its row (``display_columns``: a title, a price; None where it records none)
    columns: dict[str, Any] | None = None
    # a text query's hit: where it came from, "vector", "keyword" or "both" (``retrieval.text.fusion``)
    source: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Its fields; the optional ones (``rerank_score``, ``columns``, ...) only where they are set."""
        fields = asdict(self)
        for name in OPTIONAL_RESULT_FIELDS:
            if fields[name] is None:
                del fields[name]
        return fields


class IndexFacts:
    """What an index's record (``info``: index.json, or a Milvus collection's copy of it) says about it, and the
    ``with`` block that closes it: shared by ``Index`` and ``milvus_index.MilvusIndex``."""

    info: IndexInfo  # its index.json, as the typed record
    remote = False  # whether it answers over the network (``SearchableIndex.remote``)

    def close(self) -> None:
        raise NotImplementedError

    def check_ready(self) -> None:
        """Raise unless the index can be searched now: a folder's state always can (a Milvus collection checks)."""

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def dim(self) -> int:
        return int(self.info.model.embedding_dim)  # type: ignore[arg-type]  # every finished index records it

    @property
    def model_hash(self) -> str | None:
        """The hash of the model that built it; None for an index built from embeddings (``has_model``)."""
        value = self.info.model.hash
        return None if value is None else str(value)

    @property
    def has_model(self) -> bool:
        """Whether a model built it (False: built from embeddings, searched with embeddings only)."""
        return self.info.has_model

    @functools.cached_property
    def display_columns(self) -> list[str]:
        """The manifest columns every answer carries (index.json's ``display_columns``; [] where none)."""
        return checked_columns(self.info.catalogue.display_columns)

    @property
    def model_output(self) -> str | None:
        """The model output that built its vectors (None: the model's own, in an index.json from before outputs
        were recorded)."""
        return self.info.model.output


class Index(IndexFacts):
    """A finished index folder: faiss index + catalogue + the model record from ``index.json``.

    Opening and searching only read the folder (the catalogue through a read-only ``CatalogueReader``, one
    connection per thread), so one ``Index`` serves searches from many threads, and a read-only folder works.
    """

    layout: IndexLayout
    catalogue: CatalogueReader  # read-only, one connection per thread

    def __init__(
        self,
        layout: IndexLayout,
        index: faiss.Index,
        catalogue: CatalogueReader,
        info: IndexInfo,
        embedder: ImageEmbedder | None = None,
        gpu: bool = False,
        gallery_root: str | Path | None = None,
    ) -> None:
        self.layout, self.faiss_index, self.catalogue, self.info = layout, index, catalogue, info
        self._gallery_root = gallery_root  # where the gallery moved (--gallery-root); None: found from index.json
        if gallery_root is not None:
            _ = self.gallery  # a --gallery-root that is not a folder is refused now, not at the first result
        self._embedder = None
        self._filter_table: FilterTable | None = None
        self._filter_lock = threading.Lock()
        self._gpu = faiss_gpu.GpuSearcher(index) if gpu else None
        self._neighbourhood: Neighbourhood | None = None
        self._neighbourhood_lock = threading.Lock()
        if embedder is not None:
            self.embedder = embedder

    @classmethod
    def open(cls, directory: str | Path, embedder: ImageEmbedder | None = None, gpu: bool = False,
             gallery_root: str | Path | None = None) -> Index:
        """Open a finished index folder (``gallery_root``: where its gallery is now, if it moved elsewhere)."""
        layout = IndexLayout(directory)
        layout.require_finished()
        info = layout.read_record()
        index = faiss_files.read_index(layout.faiss)
        faiss_params.set_search_params(index, info.vectors.params or {})
        catalogue = CatalogueReader(layout.catalogue)
        done = catalogue.indexed_count()
        if done != index.ntotal:  # a cheap check; ``index stats`` and the writers compare the ids
            catalogue.close()
            raise layout.inconsistent(
                f"its faiss part holds {index.ntotal} vectors but the catalogue has {done} indexed images"
            )
        try:
            return cls(layout, index, catalogue, info, embedder, gpu, gallery_root)
        except BaseException:  # e.g. the embedder is another model's
            catalogue.close()
            raise

    def close(self) -> None:
        self.catalogue.close()

    def __len__(self) -> int:
        return int(self.faiss_index.ntotal)

    @property
    def root(self) -> Path:
        """The index folder, where index.json's relative paths start."""
        return self.layout.root

    @property
    def keywords(self) -> KeywordSearch | None:
        """The FTS5 keyword index its index.json records (None: none; KeywordError: unreadable)."""
        return FolderKeywords.of_index(self.info, self.layout.root)

    def stats(self, queries: int = 500, seed: int = 1) -> dict[str, Any]:
        """``index stats`` of the opened folder (``stats.opened_index_stats``): its catalogue's indexed rows."""
        from retrieval.index.stats import opened_index_stats

        return opened_index_stats(self, queries=queries, seed=seed)

    @property
    def embedder(self) -> ImageEmbedder:
        """The query model: the one passed in, else index.json's model, found by its hash (``find_model``: the
        folder may have moved); it embeds with the output
        that reaches the index's space (a model of another size declared compatible: its compatible output). An
        index built from embeddings has none: a ``NoModel``, which refuses to embed, saying what works instead."""
        if self._embedder is None and not self.has_model:
            self._embedder = NoModel(self.dim, self.layout.root)  # its every use says what works instead
        if self._embedder is None:
            if not self.info.model.path or not self.model_hash:
                raise ValueError("this index records no model path; pass an embedder to search images")
            model = load_model(find_model(self.info, self.layout.root))
            if not hash_matches(self.model_hash, model):  # replaced since hashed: never search with another model
                raise ParameterError("model", f"is needed: the file {getattr(model, 'path', '?')} has model_hash "
                                              f"{model.model_hash}, not {self.model_hash}, the index's; give that one")
            self.embedder = model
        return self._embedder

    @embedder.setter
    def embedder(self, embedder: ImageEmbedder) -> None:
        self._embedder = index_embedder(self.info, embedder, self.layout.root)

    # --- the ids its faiss part holds
    @functools.cached_property
    def ids(self) -> np.ndarray:
        """The ids its faiss part holds, sorted int64 (a ``live.Snapshot`` sets them when it opens)."""
        return np.sort(faiss_params.index_ids(self.faiss_index))

    def holds(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Per id, whether its faiss part holds it (bool array)."""
        ids = np.asarray(ids, dtype=np.int64)
        if not len(self.ids):
            return np.zeros(ids.shape, dtype=bool)
        positions = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        return self.ids[positions] == ids

    # --- the indexed rows (a ``live.Snapshot`` answers for the ids it held when opened instead)
    def indexed_rows(self, ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        """id -> catalogue row of the ``ids`` the catalogue marks indexed now; others are absent."""
        return self.catalogue.rows(ids, status=Status.DONE)

    def indexed_row(self, image_id: int) -> dict[str, Any] | None:
        return self.indexed_rows([image_id]).get(int(image_id))

    def indexed_by_sha256(self, sha256: str) -> dict[str, Any] | None:
        """The indexed row whose file has this sha256 (exact duplicates are catalogued as ``duplicate``)."""
        return self.catalogue.row_by_sha256(sha256)

    @functools.cached_property
    def gallery_root(self) -> PurePath:
        """The gallery root its catalogue's paths were recorded under (``gallery.root``: where it is now)."""
        return gallery_root(self.info, self.catalogue)

    @functools.cached_property
    def gallery(self) -> GalleryPlace:
        """Where its gallery is now (``portable.gallery_place``): moved with the index folder, or --gallery-root."""
        return gallery_place(self.info, self.gallery_root, self.layout.root, self._gallery_root)

    def public_path(self, path: str) -> str:
        """``path`` relative to this index's gallery root (``public_path``)."""
        return public_path(path, self.gallery.shown_from(path))

    def image_file(self, path: str) -> str | None:
        """Where the file of a catalogued ``path`` is now (``GalleryPlace.file``; None: not in the moved gallery)."""
        return self.gallery.file(path)

    # --- filters
    @property
    def filter_table(self) -> FilterTable:
        """The filterable columns of the rows it answers for (``filter_rows``), read from the catalogue on first
        use: a writer's relabel since the index was opened shows in its filters."""
        with self._filter_lock:
            if self._filter_table is None:
                ids, paths, labels, extra = self.filter_rows()
                self._filter_table = FilterTable(ids, [self.public_path(p) for p in paths], labels, extra)
            return self._filter_table

    def filter_rows(self) -> tuple[list[int], list[str], list[str | None], dict[int, str]]:
        """The rows a filter chooses among: those the catalogue marks indexed now and faiss holds (rows a writer
        indexed after this index was opened are not in its faiss part, and cannot be searched)."""
        return self.catalogue.filter_rows(within=self.ids, status=Status.DONE)

    def matching_ids(self, where: str | Filter) -> np.ndarray:
        """The sorted ids of the indexed rows that match a ``where`` expression (FilterError if it is bad)."""
        return self.filter_table.matching(parse_filter(where) if isinstance(where, str) else where)

    # --- search
    def search_arrays(self, embeddings: np.ndarray, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised search: cosine scores float32 [n, k] and catalogue ids int64 [n, k] (-1 where fewer than k)."""
        return self._search(embeddings, check_k(k))

    def _search(self, embeddings: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """faiss' top-k, any k >= 1. Scores are clipped to [-1, 1]: float32 rounding (or an approximate index's
        reconstruction) can put an inner product of unit vectors just outside the range a cosine can take."""
        queries = prepare_vectors(embeddings, self.dim)
        searcher = self._gpu if self._gpu is not None else self.faiss_index
        scores, ids = searcher.search(queries, k)
        return np.clip(scores, -1.0, 1.0, out=scores), ids

    def search_selected(self, embeddings: np.ndarray, k: int, selected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """faiss' top-k among the ``selected`` ids (sorted int64) alone: exactly from the stored vectors for a small
        selection on an index that keeps them (``faiss_search.EXACT_SELECTION_MAX``), else through an ``IDSelector``
        (exact for Flat, IVF and HNSW probing widened by the selection's share,
        ``faiss_search.filtered_search_params``), else by over-fetching the unfiltered search and keeping the selected
        ids. Always on the CPU index (the GPU searcher takes no selector)."""
        queries = prepare_vectors(embeddings, self.dim)
        selected = np.asarray(selected, dtype=np.int64)
        selected = selected[self.holds(selected)]  # an id faiss lacks cannot be reconstructed nor found
        if not len(selected):
            return np.zeros((len(queries), 0), np.float32), np.zeros((len(queries), 0), np.int64)
        fraction = len(selected) / max(len(self), 1)
        selected = np.ascontiguousarray(selected, dtype=np.int64)
        vectors = faiss_search.stored_vectors(self.faiss_index, selected) \
            if len(selected) <= faiss_search.EXACT_SELECTION_MAX else None
        if vectors is not None:
            scores, ids = faiss_search.exact_among(queries, vectors, selected, k)
            return np.clip(scores, -1.0, 1.0, out=scores), ids
        selector = faiss.IDSelectorBatch(len(selected), faiss.swig_ptr(selected))
        params = faiss_search.filtered_search_params(self.faiss_index, selector, fraction)
        if params is not None:
            scores, ids = self.faiss_index.search(queries, min(k, len(selected)), params=params)
        else:
            scores, ids = faiss_search.post_filtered_search(self.faiss_index, queries, k, selected)
        del params, selector  # faiss read the selector through a pointer until here
        return np.clip(scores, -1.0, 1.0, out=scores), ids

    def search(
        self, embeddings: np.ndarray, k: int = 10, exclude_ids: Collection[int] = (),
        where: str | Filter | None = None, rerank: RerankConfig | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> list[list[SearchResult]]:
        """Per query, the top-k indexed images best first, with catalogue id, path, label and cosine score.

        ``exclude_ids`` are left out of every query's results, which still hold k where the index has enough:
        faiss is asked for k + len(exclude_ids). An image removed by a writer since this index was opened (the
        catalogue no longer marks it indexed, the faiss index in memory still holds it) is left out too (a
        ``live.Snapshot`` keeps it instead: it answers as the index was when opened). ``where`` keeps only the
        rows that match it (``retrieval.index.filters``): fewer than k results when fewer match. ``rerank``
        re-orders each query's top ``rerank.candidates`` of those results (``retrieval.rerank``, from their stored
        vectors: ``reconstructed_vectors``); results beyond them follow in their order. ``cancelled()`` is asked
        before each query is re-ranked (``rerank_lists``: ``Cancelled``).
        """
        k = check_k(k)
        reranking = rerank is not None and rerank.active
        if reranking:
            rerank = gallery_filled(rerank, self.rerank_neighbourhood)[0]
        depth = max(k, rerank.candidates) if reranking else k
        exclude = {int(i) for i in exclude_ids}
        if len(exclude) > MAX_K:
            raise ValueError(f"exclude_ids holds {len(exclude)} ids; at most {MAX_K} can be left out")
        if where is not None:
            selected = self.matching_ids(where)
            selected = np.setdiff1d(selected, np.fromiter(exclude, np.int64, len(exclude)), assume_unique=True)
            scores, ids = self.search_selected(embeddings, depth, selected)
        else:
            scores, ids = self._search(embeddings, depth + len(exclude))
        rows = self.indexed_rows(ids[ids >= 0].tolist())
        results = []
        for query_scores, query_ids in zip(scores.tolist(), ids.tolist(), strict=True):
            kept = [(s, i) for s, i in zip(query_scores, query_ids, strict=True) if i in rows and i not in exclude]
            results.append([SearchResult(i, rows[i]["path"], rows[i]["label"], s) for s, i in kept[:depth]])
        if reranking:
            results = reranked_results(prepare_vectors(embeddings, self.dim), results, k, rerank,
                                       self.reconstructed_vectors, cancelled)
        return self.with_columns(results)

    def with_columns(self, found: list[list[SearchResult]]) -> list[list[SearchResult]]:
        """``found`` with each result's display columns (``display_columns``), read in one catalogue query."""
        return with_columns(found, self.columns_of)

    def columns_of(self, ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        """id -> the display columns of each of ``ids`` ({} where the index shows none)."""
        return columns_of(ids, self.display_columns, self.catalogue.metadata_of)

    def rerank_neighbourhood(self) -> Neighbourhood:
        """The gallery's typical class size, which sets the re-ranking sizes a search leaves unset
        (``retrieval.rerank.defaults``): read from the catalogue's labels once per opened index."""
        with self._neighbourhood_lock:
            if self._neighbourhood is None:
                self._neighbourhood = neighbourhood_from_counts(self.catalogue.label_counts())
            return self._neighbourhood

    def stored_rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ids among sorted ``ids`` that have a stored vector, in shard order, and those (normalised) vectors
        [n, d], read from the shards the catalogue names (exact, whatever the faiss index keeps)."""
        from retrieval.index.shards import ShardStore
        from retrieval.index.vectors import done_chunks

        shard_of = self.catalogue.done_shards()
        wanted = {int(i): shard_of[int(i)] for i in ids if int(i) in shard_of}
        chunks = list(done_chunks(ShardStore(self.layout.shards, read_only=True), wanted))
        if not chunks:
            return np.zeros(0, np.int64), np.zeros((0, self.dim), np.float32)
        return np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks])

    def reconstructed_vectors(self, ids: np.ndarray) -> np.ndarray:
        """The vectors [n, d] faiss holds for ``ids`` (``faiss_search.reconstructed_vectors``)."""
        return faiss_search.reconstructed_vectors(self.faiss_index, ids)

    def search_images(
        self, images: Sequence[Any], k: int = 10, embedder: ImageEmbedder | None = None
    ) -> list[list[SearchResult]]:
        """Embed images (paths or PIL images) with the index's model and search."""
        if embedder is not None:
            self.embedder = embedder
        if not len(images):
            return []
        from retrieval.data.decode import open_image

        pil = [open_image(image) if isinstance(image, (str, Path)) else image for image in images]
        return self.search(self.embedder.embed(pil), k)


def reranked_results(queries: np.ndarray, found: list[list[SearchResult]], k: int, config: RerankConfig,
                     vectors_of: Callable[[np.ndarray], np.ndarray],
                     cancelled: Callable[[], bool] | None = None) -> list[list[SearchResult]]:
    """Each query's results (``queries``: L2-normalised [n, d]) with its shortlist re-ranked (``rerank_lists``,
    the candidates' stored vectors from ``vectors_of(ids)``), cut to k."""
    lists = np.full((len(found), max(map(len, found), default=0)), -1, dtype=np.int64)
    for row, results in enumerate(found):
        lists[row, : len(results)] = [result.id for result in results]
    ids, scores = rerank_lists(queries, lists, vectors_of, config, cancelled)
    reranked = []
    for row, results in enumerate(found):
        by_id = {result.id: result for result in results}
        reranked.append([dataclasses.replace(by_id[i], rerank_score=None if math.isnan(s) else s)
                         for i, s in zip(ids[row].tolist(), scores[row].tolist(), strict=True) if i >= 0][:k])
    return reranked
