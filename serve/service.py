"""``SearchService``: an index folder (ONNX embedder + faiss + catalogue) answering searches from any thread,
and following its writers.

Image queries are preprocessed in the caller's thread and embedded by a ``MicroBatcher``, so requests
that arrive together share one model call; the search itself is ``Index.search`` (faiss is thread-safe, the
catalogue is read through per-thread read-only connections) and runs in the caller's thread.

The index is served as ``ServedIndex`` states (``retrieval.index.live``): a watcher swaps in a new state about a
second after a writer (``retrieval index add/remove/...``) finishes, and each request uses the one state it took
at its start, so it sees the index before or after a change, never a mix (see ``retrieval.index.live``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import numbers
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path, PurePath, PurePosixPath
from typing import IO, Any

import numpy as np
from PIL import Image

from retrieval.data.formats import (  # what an image file is served as: its content's format, named by extension
    ACCEPTED_FORMATS_TEXT,
    IMAGE_FORMATS,
    SIGNATURE_BYTES,
    sniff_image_format,
)
from retrieval.index import IMAGE_EXTENSIONS, SearchResult
from retrieval.index.catalogue import CatalogueReader
from retrieval.index.embedder import ImageEmbedder, prepare_vectors
from retrieval.index.faiss_search import NoStoredVectors
from retrieval.index.filters import Filter, FilterError, parse_filter
from retrieval.index.layout import InconsistentIndexError
from retrieval.index.live import RELOAD_INTERVAL_S, LiveIndex, Snapshot
from retrieval.index.search import MAX_K, check_k
from retrieval.index.sources import printable_path
from retrieval.onnx_runtime import preprocess_images
from retrieval.rerank import Cancelled, RerankConfig, RerankTooLarge
from retrieval.rerank_defaults import gallery_filled
from retrieval.serve.admission import ClientGone
from retrieval.serve.batcher import MicroBatcher
from retrieval.serve.defaults import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_MAX_UPLOAD_BYTES,
    MAX_BATCH_QUERIES,
    MAX_BATCH_UPLOAD_BYTES,
)
from retrieval.serve.diagnostics import LeaveOneOut, NeighbourScores, leave_one_out, neighbour_scores
from retrieval.serve.images import QueryError, decode_query

log = logging.getLogger(__name__)

Query = Image.Image | bytes | np.ndarray | list[float]  # an image, an image file's bytes, or an embedding [d]


def image_url(image_id: int) -> str:
    return f"/items/{image_id}/image"


def display_name(path: str) -> str:
    """A gallery image's file name, printable (the API's ``name``: no folders, no server paths); the app names an
    image by its ``path``, the spelling filters compare."""
    return printable_path(PurePosixPath(path).name)


@dataclass(frozen=True)
class QueryItem:
    """The gallery item a query image is: same file bytes (sha256) as that catalogued, indexed file."""

    id: int
    path: str  # relative to the gallery root
    label: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "path": self.path, "name": display_name(self.path), "label": self.label,
                "image_url": image_url(self.id)}


@dataclass
class SearchResponse:
    results: list[SearchResult]  # paths relative to the gallery root
    k: int
    timing: dict[str, float] = field(default_factory=dict)  # milliseconds, plus the batch size
    query_item: QueryItem | None = None  # the query is this gallery item (identical file bytes)
    excluded_self: bool = False  # ... and it was left out of the results
    notes: list[str] = field(default_factory=list)  # how the query was read (e.g. an animated image's frame)
    # the answering state's nearest-neighbour similarities, when asked for (``search(..., calibrate=True)``)
    neighbours: NeighbourScores | None = None
    rerank: RerankConfig | None = None  # the re-ranking that ordered the results (None: faiss' order)
    rerank_defaults: str | None = None  # where the sizes the request left unset came from (the gallery)

    def unlike_gallery(self) -> bool:
        """Whether the best result scores below what nearly every gallery image reaches to its own nearest
        neighbour (needs ``neighbours``; a query that is a gallery image never is)."""
        return (self.neighbours is not None and bool(self.results) and self.query_item is None
                and self.neighbours.unlike(self.results[0].score))

    def to_dict(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "count": len(self.results),
            "results": [r.to_dict() | {"name": display_name(r.path), "image_url": image_url(r.id)}
                        for r in self.results],
            "query_item": self.query_item.to_dict() if self.query_item else None,
            "excluded_self": self.excluded_self,
            "notes": list(self.notes),
            "timing": {stage: float(value) for stage, value in self.timing.items()},
        } | ({"rerank": self.rerank.describe(self.rerank_defaults)} if self.rerank is not None else {})


class _Model:
    """An embedder and its micro-batcher, shared by the states of the index that record the same model."""

    def __init__(self, embedder: ImageEmbedder, max_batch: int, max_wait_ms: float) -> None:
        self.embedder = embedder
        self.batcher = MicroBatcher(embedder.embed, max_batch=max_batch, max_wait_ms=max_wait_ms)
        self.users = 0  # open states that use it; the batcher stops with the last
        self._lock = threading.Lock()

    def use(self) -> _Model:
        with self._lock:
            self.users += 1
        return self

    def release(self) -> None:
        with self._lock:
            self.users -= 1
            last = self.users == 0
        if last:
            self.batcher.close()


class ServedIndex:
    """One opened state of the index: a consistent ``Snapshot``, the model that embeds its queries, its caches.

    A request takes one (``SearchService.live.acquire``) and answers from it alone: results, query item, items.
    """

    def __init__(self, snapshot: Snapshot, model: _Model) -> None:
        self.index, self.identity = snapshot, snapshot.identity
        self.gallery_root = snapshot.gallery_root
        self.model = model.use()
        self._lock = threading.Lock()
        self._stats: dict[str, Any] | None = None
        self._loo: LeaveOneOut | None = None
        self._neighbours: tuple[NeighbourScores | None] | None = None  # (None,): measured, fewer than 2 images
        self._neighbours_lock = threading.Lock()  # not the summaries' lock: a search never waits for leave-one-out
        self._warned_lock = threading.Lock()
        self._warned = False  # whether this state logged that it cannot answer (once per state)

    @property
    def embedder(self) -> ImageEmbedder:
        """The ONNX model that embeds this state's queries."""
        return self.model.embedder

    @property
    def batcher(self) -> MicroBatcher:
        """The micro-batcher of this state's model (shared with the states of the same model)."""
        return self.model.batcher

    @property
    def catalogue(self) -> CatalogueReader:
        """This state's read-only, per-thread catalogue reader."""
        return self.index.catalogue

    @property
    def dim(self) -> int:
        """The dimension of this state's vectors."""
        return self.index.dim

    def __len__(self) -> int:
        return len(self.index)

    def public_path(self, path: str) -> str:
        """A catalogued path as clients see it: relative to the gallery root, never the server's absolute path."""
        return self.index.public_path(path)

    def search(self, vectors: np.ndarray, k: int, exclude_ids: tuple[int, ...] = (),
               where: Filter | None = None, rerank: RerankConfig | None = None,
               cancelled: Callable[[], bool] | None = None) -> list[list[SearchResult]]:
        """``Index.search`` with the paths as clients see them; a filter this index cannot answer (a column it
        lacks) is a 422, as is a re-ranking it cannot do (an index that keeps no vectors, or one over its memory
        bound), and what this state cannot answer (the index changed under it) a 503. ``cancelled()`` true
        between two re-ranked queries: ClientGone."""
        try:
            found = self._answer(self.index.search, vectors, k, exclude_ids, where=where, rerank=rerank,
                                 cancelled=cancelled)
        except (FilterError, NoStoredVectors, RerankTooLarge) as exc:
            raise QueryError(str(exc), 422) from exc
        except Cancelled as exc:
            raise ClientGone() from exc
        return [[dataclasses.replace(r, path=self.public_path(r.path)) for r in results] for results in found]

    def gallery_rerank(self, rerank: RerankConfig | None) -> tuple[RerankConfig | None, str | None]:
        """``rerank`` with the sizes it left unset taken from this state's gallery (``retrieval.rerank_defaults``),
        and where they came from (None where it set them all)."""
        if rerank is None:
            return None, None
        return gallery_filled(rerank, lambda: self._answer(self.index.rerank_neighbourhood))

    def query_item(self, data: bytes) -> QueryItem | None:
        """The item of this state whose file has exactly these bytes (catalogue sha256), if any."""
        row = self._answer(self.index.indexed_by_sha256, hashlib.sha256(data).hexdigest())
        return None if row is None else QueryItem(row["id"], self.public_path(row["path"]), row["label"])

    def index_stats(self) -> dict[str, Any]:
        """``index stats`` of this state (its own faiss index and ids: the folder is not opened again), once."""
        with self._lock:
            if self._stats is None:
                self._stats = self._answer(self.index.stats, queries=200)
            return self._stats

    def leave_one_out(self) -> LeaveOneOut:
        """Leave-one-out recall of this state's labelled images, once."""
        with self._lock:
            if self._loo is None:
                self._loo = self._answer(leave_one_out, self.index)
            return self._loo

    def neighbour_scores(self) -> NeighbourScores | None:
        """How similar this state's images are to their nearest other image, once (None: fewer than 2 images)."""
        with self._neighbours_lock:
            if self._neighbours is None:
                self._neighbours = (self._answer(neighbour_scores, self.index),)
            return self._neighbours[0]

    def _answer(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        """``call(*args, **kwargs)``; what this state cannot answer from itself (``InconsistentIndexError``: the
        index changed under it) is a 503 that says why, logged once per state: never a 500."""
        try:
            return call(*args, **kwargs)
        except InconsistentIndexError as exc:
            raise self._unanswerable(exc) from exc

    def _unanswerable(self, exc: Exception) -> QueryError:
        """The 503 for ``exc``, without the server's folders; the first of this state is logged in full."""
        with self._warned_lock:
            first, self._warned = not self._warned, True
        if first:
            log.warning("the served index state (%d vectors) cannot answer a request: %s",
                                                len(self), exc)
        reason = str(exc)
        root = self.index.layout.root
        for folder in {str(root.resolve()), str(root.absolute())}:
            reason = reason.replace(folder, "<index>")
        return QueryError(f"the index changed under this server in a way it cannot answer from the state it "
                          f"serves: {reason} (the server swaps in the index by itself once it is whole)", 503)

    def close(self) -> None:
        self.index.close()
        self.model.release()



class SearchService:
    """Open ``index_dir``; ``search(image | embedding, k)`` from many threads, over the index's current state.

    ``live`` swaps in a new ``ServedIndex`` within about ``reload_interval_s`` once a writer (``retrieval index
    add/remove/repair/build``) has finished; None: never. The service has no per-fact accessors of the index (two
    of them could read two states): an answer takes one state, ``current()`` or held with ``acquire()``, and reads
    its index, catalogue, model and batcher from it.
    """

    def __init__(
        self,
        index_dir: str | Path,
        embedder: ImageEmbedder | None = None,
        max_batch: int = 32,
        max_wait_ms: float = 5.0,
        max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        reload_interval_s: float | None = RELOAD_INTERVAL_S,
        gallery_root: str | Path | None = None,
    ) -> None:
        self.index_dir = Path(index_dir)
        self.gallery_root = gallery_root  # where the gallery moved (--gallery-root); None: found from index.json
        self.max_upload_bytes, self.max_pixels = int(max_upload_bytes), int(max_pixels)
        self._embedder, self._batching = embedder, (max_batch, max_wait_ms)
        self.generation = 0  # states opened, each swapped in at once (1: the first); /metrics counts reloads by it
        self.live: LiveIndex[ServedIndex] = LiveIndex(self.index_dir, self._open_state, reload_interval_s)

    def _open_state(self, previous: ServedIndex | None) -> ServedIndex:
        """The folder's state now; its model is the previous state's unless the index records another one."""
        if previous is None:  # the first open: as Index.open, it takes a consistent index even during a writer
            snapshot = Snapshot.open(self.index_dir, embedder=self._embedder, writer_free=False,
                                     gallery_root=self.gallery_root)
        else:
            snapshot = Snapshot.open(self.index_dir, gallery_root=self.gallery_root)
        model = None
        try:
            # the same model and output (an upgrade from a compatible output to the model's own keeps its hash)
            if previous is not None and (previous.index.model_hash, previous.index.model_output) == (
                    snapshot.model_hash, snapshot.model_output):
                model = previous.model
                snapshot.embedder = model.embedder
            else:  # loads the ONNX model recorded in index.json now, not per request
                model = _Model(snapshot.embedder, *self._batching)
            state = ServedIndex(snapshot, model)
            self.generation += 1  # opens are serialised (LiveIndex's reload lock, or the constructor)
            return state
        except BaseException:
            snapshot.close()
            if model is not None and model.users == 0:
                model.batcher.close()
            raise

    def reload(self) -> bool:
        """Swap in the index folder's new state now if a writer changed it; whether it swapped."""
        return self.live.reload()

    # --- the served state: every fact of one answer is read from ONE state, taken once
    def current(self) -> ServedIndex:
        """The state served now, not held: a reload may replace it at any moment, so an answer takes it ONCE and
        reads every fact from the object returned (work that takes longer holds one: ``acquire``)."""
        return self.live.current

    def acquire(self) -> AbstractContextManager[ServedIndex]:
        """The state served now, held open for the ``with`` block even if a reload replaces it meanwhile."""
        return self.live.acquire()

    def __len__(self) -> int:
        """The vectors served now: one fact of one state (several facts of one state: ``current()``)."""
        return len(self.live.current)

    def health(self) -> dict[str, int]:
        """The vectors and dimension of one state (GET /health)."""
        state = self.current()
        return {"vectors": len(state), "embedding_dim": state.index.dim}

    def describe(self, state: ServedIndex | None = None) -> dict[str, Any]:
        """The index and model of ``state`` (default: the current one) for the operator: server paths included."""
        state = self.current() if state is None else state
        return {
            "index_dir": str(self.index_dir.resolve()),  # for the operator (logs, UI); the API shows names only
            "vectors": len(state),
            "embedding_dim": state.index.dim,
            "index_key": state.index.info.get("index_key"),
            "model_hash": state.index.model_hash,
            "model_path": state.index.info.get("model_path"),
            # built from embeddings: no model, so no input size (image queries are refused)
            "input_size": int(state.embedder.model_config["input_size"]) if state.index.has_model else None,
            **({} if state.index.has_model else {"source": state.index.info.get("source")}),
        }

    # --- search
    def embed_images(
        self, images: list[Image.Image] | np.ndarray, state: ServedIndex | None = None
    ) -> tuple[np.ndarray, dict[str, float]]:
        """Embed with the model of ``state`` (default: the current one) through its micro-batcher; ``images``: PIL
        images, or a batch already preprocessed for this model ([n, 3, S, S], ``preprocess_images``)."""
        state = self.current() if state is None else state
        if not state.index.has_model:
            raise no_model_refusal(state)
        model = state.model
        started = time.perf_counter()
        with model.batcher.reservation() as submit:
            batch = images if isinstance(images, np.ndarray) else preprocess_images(images, model.embedder.model_config)
            prepared = time.perf_counter()
            future = submit(batch)
        result = future.result(timeout=120)
        timing = {
            "preprocess_ms": (prepared - started) * 1000,
            "embed_ms": (time.perf_counter() - prepared) * 1000,
            "batch_wait_ms": result.wait_ms,
            "batch_size": result.batch_size,
        }
        return result.embeddings, timing

    def search(
        self,
        query: Image.Image | bytes | np.ndarray | list[float],
        k: int = 10,
        exclude_ids: tuple[int, ...] = (),
        exclude_self: bool = False,
        where: str | None = None,
        calibrate: bool = False,
        rerank: RerankConfig | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> SearchResponse:
        """Top-k of a PIL image, the bytes of an image file, or an embedding [d]; ``exclude_ids`` dropped.

        For image bytes, ``query_item`` is the gallery item with identical bytes (if any); ``exclude_self``
        leaves it out of the results (a query picked from the gallery is not its own answer). ``where``: only
        the catalogue rows matching it (``retrieval.index.filters``; a malformed one is a 422 naming the
        problem). The whole search uses one state of the index, even if a newer one is swapped in meanwhile;
        ``calibrate`` adds that state's ``neighbour_scores`` (measured once per state), for ``unlike_gallery``.
        ``rerank`` re-orders the shortlist (``retrieval.rerank``) after the query's own item and the filter have
        left it; its time is part of ``search_ms``. ``cancelled()`` is asked before the re-ranking (ClientGone).
        """
        k, where_filter = checked_k_and_where(k, where)
        rerank = rerank if rerank is not None and rerank.active else None
        with self.live.acquire() as state:
            rerank, defaults = state.gallery_rerank(rerank)
            response = self._search(state, query, k, exclude_ids, exclude_self, where_filter, rerank, cancelled)
            response.rerank_defaults = defaults
            if calibrate:
                response.neighbours = state.neighbour_scores()
            return response

    def _search(
        self,
        state: ServedIndex,
        query: Image.Image | bytes | np.ndarray | list[float],
        k: int,
        exclude_ids: tuple[int, ...],
        exclude_self: bool,
        where: Filter | None = None,
        rerank: RerankConfig | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> SearchResponse:
        started = time.perf_counter()
        timing: dict[str, float] = {}
        query_item, notes = None, []
        if isinstance(query, (bytes, bytearray, Image.Image)) and not state.index.has_model:
            raise no_model_refusal(state)  # before the upload is decoded: nothing could embed it
        if isinstance(query, (bytes, bytearray)):
            query, query_item, notes, timing["decode_ms"] = self._decode(state, bytes(query))
        excluded_self = exclude_self and query_item is not None
        if excluded_self:
            exclude_ids = (*exclude_ids, query_item.id)
        if isinstance(query, Image.Image):
            embedding, embed_timing = self.embed_images([query], state)
            timing.update(embed_timing)
        else:
            embedding = check_embedding(query, state.index.dim)
        search_started = time.perf_counter()
        results = state.search(embedding, k, exclude_ids, where, rerank, cancelled)[0]
        timing["search_ms"] = (time.perf_counter() - search_started) * 1000
        timing["total_ms"] = (time.perf_counter() - started) * 1000
        timing = {key: round(v, 3) for key, v in timing.items()}
        return SearchResponse(results, k, timing, query_item, excluded_self,
                              notes + no_match_notes(state, where, results), rerank=rerank)

    def search_batch(
        self,
        queries: Sequence[Query | QueryError],
        k: int = 10,
        exclude_self: bool = False,
        where: str | None = None,
        cancelled: Callable[[], bool] | None = None,
        rerank: RerankConfig | None = None,
    ) -> list[SearchResponse | QueryError]:
        """Top-k of each query (as ``search``), in order: the images embedded in ONE model call, one faiss search.

        Rules: 1..``MAX_BATCH_QUERIES`` queries; ``k``, ``where`` and ``exclude_self`` apply to every query; an
        invalid embedding, k or filter refuses the whole batch (422, the query named by its position). Only what
        decoding alone can tell is per query: an image that cannot be decoded (or is over the size or pixel
        limit) is answered by its ``QueryError`` in place, as is a ``QueryError`` the caller passes (e.g. bad
        base64), and the other queries are answered. Per-query timing: its own ``decode_ms``; the stages the
        batch shares (preprocess, embed, search, total) give the batch's time. ``cancelled()`` is asked before each
        image and each re-ranked query: once true (the client has gone), the batch stops with ``ClientGone``.
        ``rerank`` applies to every query, as in ``search``.
        """
        check_batch_size(len(queries))
        k, where_filter = checked_k_and_where(k, where)
        rerank = rerank if rerank is not None and rerank.active else None
        with self.live.acquire() as state:
            rerank, defaults = state.gallery_rerank(rerank)
            answers = self._search_batch(state, list(queries), k, exclude_self, where_filter, cancelled, rerank)
        for answer in answers:
            if isinstance(answer, SearchResponse):
                answer.rerank_defaults = defaults
        return answers

    def _search_batch(
        self,
        state: ServedIndex,
        queries: list[Query | QueryError],
        k: int,
        exclude_self: bool,
        where: Filter | None,
        cancelled: Callable[[], bool] | None = None,
        rerank: RerankConfig | None = None,
    ) -> list[SearchResponse | QueryError]:
        started = time.perf_counter()
        vectors: dict[int, np.ndarray] = {}  # position -> unit vector
        for position, query in enumerate(queries):  # embeddings first: a bad one refuses the batch before any decode
            if not isinstance(query, (QueryError, Image.Image, bytes, bytearray)):
                try:
                    vectors[position] = check_embedding(query, state.index.dim)
                except QueryError as exc:
                    raise QueryError(f"queries[{position}]: {exc}", exc.status) from exc
        if not state.index.has_model:  # an image query refuses the batch, as an invalid embedding does
            for position, query in enumerate(queries):
                if isinstance(query, (Image.Image, bytes, bytearray)):
                    refusal = no_model_refusal(state)
                    raise QueryError(f"queries[{position}]: {refusal}", refusal.status)
        answers: list[SearchResponse | QueryError] = [SearchResponse([], k, rerank=rerank) for _ in queries]
        # each image becomes the model's small input as soon as it is decoded: a batch never holds 64 decoded
        # images at once (a tiny PNG can declare tens of megapixels within the pixel limit)
        images: dict[int, np.ndarray] = {}
        config = state.model.embedder.model_config if state.index.has_model else {}
        own: dict[int, int] = {}  # position -> the gallery item it leaves out (exclude_self)
        for position, query in enumerate(queries):
            answer = answers[position]
            if isinstance(query, QueryError):
                answers[position] = query
            elif isinstance(query, Image.Image):
                images[position] = preprocess_images([query], config)[0]
            elif isinstance(query, (bytes, bytearray)):
                if cancelled is not None and cancelled():  # nobody waits for the answer: stop between images
                    raise ClientGone()
                try:
                    decoded, answer.query_item, answer.notes, decode_ms = self._decode(state, bytes(query))
                except QueryError as exc:  # this query only: the others are answered
                    answers[position] = exc
                    continue
                images[position] = preprocess_images([decoded], config)[0]
                del decoded
                answer.timing["decode_ms"] = decode_ms
                answer.excluded_self = exclude_self and answer.query_item is not None
                if answer.excluded_self:
                    own[position] = answer.query_item.id  # type: ignore[union-attr]
        shared: dict[str, float] = {}
        if images:  # the whole batch in one reservation: one model call, never query by query
            embedded, shared = self.embed_images(np.stack(list(images.values())), state)
            vectors |= dict(zip(images, embedded, strict=True))
        searched = sorted(vectors)
        if searched:
            search_started = time.perf_counter()
            found = self._search_vectors(state, np.stack([vectors[p] for p in searched]), k,
                                         [own.get(p) for p in searched], where, rerank, cancelled)
            search_ms = (time.perf_counter() - search_started) * 1000
            for position, results in zip(searched, found, strict=True):
                answer = answers[position]
                assert isinstance(answer, SearchResponse)
                answer.results = results
                answer.notes += no_match_notes(state, where, results)
                timing = answer.timing | (shared if position in images else {}) | {
                    "search_ms": search_ms, "total_ms": (time.perf_counter() - started) * 1000}
                answer.timing = {key: round(value, 3) for key, value in timing.items()}
        return answers

    def _decode(self, state: ServedIndex, data: bytes) -> tuple[Image.Image, QueryItem | None, list[str], float]:
        """An image file's bytes -> the image, the gallery item with these bytes, decoding notes, milliseconds."""
        started = time.perf_counter()
        decoded = decode_query(data, self.max_upload_bytes, self.max_pixels)
        return decoded.image, state.query_item(data), list(decoded.notes), (time.perf_counter() - started) * 1000

    def _search_vectors(
        self, state: ServedIndex, vectors: np.ndarray, k: int, own: list[int | None], where: Filter | None,
        rerank: RerankConfig | None = None, cancelled: Callable[[], bool] | None = None,
    ) -> list[list[SearchResult]]:
        """One faiss search of unit ``vectors`` [n, d]; query i leaves out its own gallery item ``own[i]``.

        ``Index.search`` leaves the same ids out of every query, so one more row is asked for and each query drops
        its own item itself (what ``search`` does with ``exclude_ids``: faiss is asked for k + 1 either way).
        Re-ranked, a query's own item must leave its shortlist before the re-ranking reads it (a neighbour of the
        others there): those queries are searched one by one, each leaving out its own.
        """
        if rerank is not None:
            if all(item is None for item in own):
                return state.search(vectors, k, where=where, rerank=rerank, cancelled=cancelled)
            return [state.search(vectors[i : i + 1], k, () if item is None else (item,), where, rerank, cancelled)[0]
                    for i, item in enumerate(own)]
        fetch = k + 1 if any(item is not None for item in own) else k
        if fetch <= MAX_K:
            found = state.search(vectors, fetch, where=where)
            return [[r for r in results if r.id != item][:k] for results, item in zip(found, own, strict=True)]
        # k = MAX_K with exclude_self: one more row is beyond check_k, so those queries are searched alone
        found = state.search(vectors, k, where=where)
        return [results if item is None else state.search(vectors[i : i + 1], k, (item,), where=where)[0]
                for i, (results, item) in enumerate(zip(found, own, strict=True))]

    def query_item(self, data: bytes) -> QueryItem | None:
        """The indexed gallery item whose file has exactly these bytes (catalogue sha256), if any."""
        with self.live.acquire() as state:
            return state.query_item(data)

    # --- catalogue
    def item(self, image_id: int) -> dict[str, Any] | None:
        """An indexed image's catalogue entry as clients see it (path relative to the gallery root)."""
        with self.live.acquire() as state:
            row = state.index.indexed_row(image_id)
            if row is None:
                return None
            return {
                "id": row["id"],
                "path": state.public_path(row["path"]),
                "name": display_name(row["path"]),
                "label": row["label"],
                "sha256": row["sha256"],
                "size": row["size"],
                "image_url": image_url(row["id"]),
            }

    def _catalogued_image(self, image_id: int, state: ServedIndex | None = None) -> Path | None:
        """Where the file of an indexed image is now (its gallery may have moved: ``Index.image_file``), or None."""
        if state is not None:
            row = state.index.indexed_row(image_id)
            file = state.index.image_file(row["path"]) if row is not None else None
        else:
            with self.live.acquire() as held:
                row = held.index.indexed_row(image_id)
                file = held.index.image_file(row["path"]) if row is not None else None
        # an image's path is absolute; a build from embeddings may catalogue URLs, never opened here; a moved
        # gallery has no place for a path outside its root (None), which is never opened either
        if file is None or not Path(file).is_absolute() or Path(file).suffix.lower() not in IMAGE_EXTENSIONS:
            return None
        return Path(file)

    def image_path(self, image_id: int, state: ServedIndex | None = None) -> Path | None:
        """The file of an indexed image of ``state`` (default: the current one), for callers that open it by path
        (the UI): only if catalogued as indexed and still a regular file that is not a symlink
        (``open_image_file`` is the race-free way)."""
        path = self._catalogued_image(image_id, state)
        try:
            return path if path is not None and stat.S_ISREG(os.lstat(path).st_mode) else None
        except OSError:
            return None

    def open_image_file(self, image_id: int) -> tuple[IO[bytes], int, str]:
        """The open file of an indexed image, its size and media type; 404 (QueryError) when it is not there.

        The file itself is opened without following a final symlink (a symlink that replaced a gallery file
        is not followed to its target; parent folders may be symlinks), and it must be a regular file, as
        seen on the opened descriptor: nothing can be swapped in between a check and the open.
        """
        path = self._catalogued_image(image_id)
        if path is None:
            raise QueryError(f"no indexed image with id {image_id}", 404)
        try:  # O_NONBLOCK: a FIFO put in its place must not block the open
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:  # ELOOP: the final component is a symlink
            reason = "was replaced by a symlink" if os.path.islink(path) else "is gone"
            raise QueryError(f"image {image_id} is catalogued but its file {reason}; it is not served", 404) from exc
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise QueryError(
                f"image {image_id} is catalogued but its file is not a regular file; it is not served", 404
            )
        handle = os.fdopen(fd, "rb")
        # the content decides, not the name: a catalogue (a build from another tool's metadata) may name any file
        kind = sniff_image_format(handle.read(SIGNATURE_BYTES))
        if kind is None:
            handle.close()
            raise QueryError(f"image {image_id} is catalogued but its file is not an image ({ACCEPTED_FORMATS_TEXT}); "
                             "it is not served", 404)
        handle.seek(0)
        media = IMAGE_FORMATS[kind].get(path.suffix.lower(), next(iter(IMAGE_FORMATS[kind].values())))
        return handle, info.st_size, media

    # --- slower summaries, computed once per state
    def index_stats(self) -> dict[str, Any]:
        with self.live.acquire() as state:
            return state.index_stats()

    def public_stats(self, state: ServedIndex | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """``describe()`` and ``index_stats()`` of one state (``state``, held by the caller; default: the current
        one, held here) as clients may see them (API ``/stats``, the app's Index tab): the index and model as file
        names, gallery files relative to the gallery root, no server folder anywhere."""
        if state is not None:
            return self._public_stats(state)
        with self.live.acquire() as held:
            return self._public_stats(held)

    def _public_stats(self, state: ServedIndex) -> tuple[dict[str, Any], dict[str, Any]]:
        def name(path: Any) -> Any:
            return PurePath(path).name if path else path

        def scrub(text: Any) -> Any:  # error messages may quote a server path
            if not isinstance(text, str):
                return text
            for folder, shown in ((str(state.gallery_root), "<gallery>"), (str(state.index.gallery.root), "<gallery>"),
                                  (str(self.index_dir.resolve()), "<index>")):  # the gallery where recorded, and now
                text = text.replace(folder, shown) if folder not in ("", "/", ".") else text
            return text

        described = self.describe(state)
        described |= {"index_dir": name(described["index_dir"]), "model_path": name(described["model_path"])}
        index = state.index_stats()
        index = index | {"index_dir": name(index.get("index_dir"))}
        if isinstance(index.get("model"), dict):
            index["model"] = index["model"] | {"model_path": name(index["model"].get("model_path"))}
            if "embeddings_dir" in index["model"]:  # built from embeddings: the folder's name, as the model's
                index["model"]["embeddings_dir"] = name(index["model"]["embeddings_dir"])
        neighbours = state.neighbour_scores()  # what a query's best score is read against (docs/SERVING.md)
        index["neighbour_similarity"] = neighbours.to_dict() if neighbours is not None else None
        index["error_examples"] = [
            row | {"path": state.public_path(row["path"]) if row.get("path") else row.get("path"),
                   "error": scrub(row.get("error"))}
            for row in index.get("error_examples", [])
        ]
        return described, index

    def leave_one_out(self) -> LeaveOneOut:
        with self.live.acquire() as state:
            return state.leave_one_out()

    def close(self) -> None:
        """Stop watching the folder; each state's catalogue and batcher close once no request holds it."""
        self.live.close()


def no_model_refusal(state: ServedIndex) -> QueryError:
    """The 422 for an image query to an index built from embeddings: it has no model to embed the image with."""
    return QueryError("this index was built from embeddings and has no model to embed an image with; send an "
                      f"\"embedding\" (a list of {state.dim} numbers) instead", 422)


NO_MATCH_NOTE = "the filter matches no image of the index"  # the note's start: the app tells it from the others


def no_match_notes(state: ServedIndex, where: Filter | None, results: Sequence[SearchResult]) -> list[str]:
    """A note for an empty answer whose filter matches no image of the index, saying how values are compared."""
    if where is None or results or len(state.index.matching_ids(where)):
        return []
    return [f"{NO_MATCH_NOTE}. {state.index.filter_table.no_match_hint()}"]


def checked_k_and_where(k: object, where: str | None) -> tuple[int, Filter | None]:
    """``k`` and the parsed ``where`` of a search, or a 422 naming what is wrong with them."""
    try:
        return check_k(k), (parse_filter(where) if where is not None else None)
    except ValueError as exc:
        raise QueryError(str(exc), 422) from exc


def batch_upload_bytes(max_upload_bytes: int) -> int:
    """The image bytes one batch may carry in all: the per-image limit for every query, capped (but never below
    one image's limit)."""
    return min(max_upload_bytes * MAX_BATCH_QUERIES, max(MAX_BATCH_UPLOAD_BYTES, max_upload_bytes))


def check_batch_size(count: int) -> None:
    """The one rule on a batch's size: 1 to ``MAX_BATCH_QUERIES`` queries, else a 422 that names the limit."""
    if not 1 <= count <= MAX_BATCH_QUERIES:
        raise QueryError(f"a batch holds 1 to {MAX_BATCH_QUERIES} queries (the server's limit), got {count}; "
                         "split it into several requests", 422)


def check_embedding(embedding: Any, dim: int) -> np.ndarray:
    """A query embedding -> unit float32 vector [d]; 422 for anything but ``d`` finite numbers, not all zero.

    Only real numbers count (JSON numbers; not bools, strings, nulls or nested lists, which NumPy would
    coerce). The direction is what matters, so any finite magnitude is accepted: the vector is scaled by
    its largest component in float64 before it is normalised (1e30 everywhere would overflow a float32 norm).
    """
    if isinstance(embedding, np.ndarray):
        if embedding.dtype.kind not in "iuf":
            raise QueryError(f"'embedding' must hold numbers, got an array of {embedding.dtype}", 422)
        shape = list(embedding.shape)
    elif isinstance(embedding, (list, tuple)):
        shape = [len(embedding)]
    else:
        raise QueryError(f"'embedding' must be a list of {dim} numbers, not {_json_type(embedding)}", 422)
    if shape != [dim]:
        raise QueryError(
            f"'embedding' must be a flat list of {dim} numbers (this index's dimension), got shape {shape}",
            422,
        )
    if not isinstance(embedding, np.ndarray):
        for position, value in enumerate(embedding):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
                raise QueryError(
                    f"'embedding' must be a flat list of {dim} numbers, but item {position} is "
                    f"{_json_type(value)}",
                    422,
                )
    try:
        vector = np.asarray(embedding, dtype=np.float64)
    except OverflowError as exc:  # a JSON integer beyond the float64 range
        raise QueryError(f"'embedding' has a number beyond the float64 range (about 1.8e308): {exc}", 422) from exc
    if not np.all(np.isfinite(vector)):
        position = int(np.flatnonzero(~np.isfinite(vector))[0])
        raise QueryError(
            f"'embedding' item {position} is {vector[position]}: every component must be a finite number "
            "(within the float64 range)",
            422,
        )
    largest = float(np.max(np.abs(vector)))
    if largest == 0:
        raise QueryError(
            "'embedding' is all zeros: it has no direction to compare by cosine; send a non-zero vector", 422
        )
    vector = vector / largest  # now within [-1, 1]: the norm below cannot overflow nor underflow
    return prepare_vectors((vector / math.sqrt(float(vector @ vector))).astype(np.float32), dim)[0]


def _json_type(value: Any) -> str:
    """How a JSON value that is not a number is named in an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list (nested lists are not accepted)"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"
