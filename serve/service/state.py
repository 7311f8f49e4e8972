"""One opened state of the index (``ServedIndex``) and the model its queries are embedded with (``SharedModel``; its
text queries: ``StateText``)."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from retrieval.index import SearchResult
from retrieval.index.faiss_backend.faiss_search import NoStoredVectors
from retrieval.index.filters import Filter, FilterError
from retrieval.index.layout import InconsistentIndexError
from retrieval.index.milvus.milvus_client import MilvusUnavailable
from retrieval.index.query_embedder import ImageEmbedder
from retrieval.index.searchable.contract import GalleryCatalogue, SearchableIndex
from retrieval.rerank import Cancelled, RerankConfig, RerankTooLarge, gallery_filled
from retrieval.serve.admission import ClientGone
from retrieval.serve.batcher import MicroBatcher
from retrieval.serve.diagnostics import LeaveOneOut, NeighbourScores, leave_one_out, neighbour_scores
from retrieval.serve.images import QueryError
from retrieval.serve.service.answers import QueryItem
from retrieval.serve.service.text import StateText
from retrieval.text.keywords import KeywordError, KeywordSearch
from retrieval.text.no_match import read_floor
from retrieval.text.text_search import search_text

log = logging.getLogger(__name__)


class SharedModel:
    """An embedder and its micro-batcher, shared by the states of the index that record the same model."""

    def __init__(self, embedder: ImageEmbedder, max_batch: int, max_wait_ms: float) -> None:
        self.embedder = embedder
        self.batcher = MicroBatcher(embedder.embed, max_batch=max_batch, max_wait_ms=max_wait_ms)
        self.users = 0  # open states that use it; the batcher stops with the last
        self._lock = threading.Lock()

    def use(self) -> SharedModel:
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
    """One opened state of the index (``IndexPlace.open_state``: a folder's consistent ``Snapshot``, or a Milvus
    collection, with the ``identity`` its watcher compares), the model that embeds its queries, its caches.

    A request takes one (``SearchService.live.acquire``) and answers from it alone: results, query item, items.
    """

    def __init__(self, snapshot: SearchableIndex, model: SharedModel, text: StateText | None = None) -> None:
        self.index, self.identity = snapshot, snapshot.identity
        self.gallery_root = snapshot.gallery_root
        self.model = model.use()
        self.text = text if text is not None else StateText()  # the text model of its text queries, if any
        self.keywords = state_keywords(snapshot)  # the keyword index its text queries search too, if any
        # the floor under which a text query's answer says "no good match" (none: no claim is made)
        self.no_match = read_floor(snapshot.info, self.text.embedder.model_hashes if self.text.embedder else None,
                                   "<index>")
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
    def catalogue(self) -> GalleryCatalogue:
        """This state's catalogue queries (a folder's read-only, per-thread ``CatalogueReader``)."""
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

    def search_text(self, texts: list[str], vectors: np.ndarray | None, k: int, exclude_ids: tuple[int, ...] = (),
                    where: Filter | None = None, rerank: RerankConfig | None = None) -> list[list[SearchResult]]:
        """Text queries' answers (``retrieval.text.text_search``: ``vectors``, the texts embedded by this state's
        text model or None, fused with its keyword hits), ``exclude_ids`` left out, errors and paths as ``search``."""
        try:
            found = self._answer(search_text, self.index, texts, k, vectors, self.keywords, where=where,
                                 rerank=rerank)
        except (FilterError, NoStoredVectors, RerankTooLarge) as exc:
            raise QueryError(str(exc), 422) from exc
        except KeywordError as exc:  # the server's keyword file is at fault, not the query
            log.error("the keyword index failed on a query: %s", exc)
            raise QueryError("this server's keyword index cannot be read now (its operator's log says why)",
                             503) from None
        return [[dataclasses.replace(r, path=self.public_path(r.path)) for r in results if r.id not in exclude_ids]
                for results in found]

    def gallery_rerank(self, rerank: RerankConfig | None) -> tuple[RerankConfig | None, str | None]:
        """``rerank`` with the sizes it left unset taken from this state's gallery (``retrieval.rerank.defaults``),
        and where they came from (None where it set them all)."""
        if rerank is None:
            return None, None
        return gallery_filled(rerank, lambda: self._answer(self.index.rerank_neighbourhood))

    def query_item(self, data: bytes) -> QueryItem | None:
        """The item of this state whose file has exactly these bytes (catalogue sha256), if any."""
        row = self._answer(self.index.indexed_by_sha256, hashlib.sha256(data).hexdigest())
        if row is None:
            return None
        columns = self._answer(self.index.columns_of, [row["id"]]).get(int(row["id"]))
        return QueryItem(row["id"], self.public_path(row["path"]), row["label"], columns)

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
        index changed under it) is a 503 that says why, logged once per state, and so is an unreachable Milvus
        (with Retry-After, logged once per outage): never a 500."""
        try:
            return call(*args, **kwargs)
        except InconsistentIndexError as exc:
            raise self._unanswerable(exc) from exc
        except MilvusUnavailable as exc:  # logged once per outage where it is raised
            raise QueryError(str(exc), 503, exc.retry_after_s) from None

    def _unanswerable(self, exc: Exception) -> QueryError:
        """The 503 for ``exc``, without the server's folders; the first of this state is logged in full."""
        with self._warned_lock:
            first, self._warned = not self._warned, True
        if first:
            log.warning("the served index state (%d vectors) cannot answer a request: %s",
                                                len(self), exc)
        reason = str(exc)
        root = self.index.root
        for folder in {str(root.resolve()), str(root.absolute())}:
            reason = reason.replace(folder, "<index>")
        return QueryError(f"the index changed under this server in a way it cannot answer from the state it "
                          f"serves: {reason} (the server swaps in the index by itself once it is whole)", 503)

    def close(self) -> None:
        self.index.close()
        self.model.release()


def state_keywords(snapshot: SearchableIndex) -> KeywordSearch | None:
    """The keyword index a served state's text queries search (a folder's ``keywords.sqlite``, a Milvus collection's
    BM25 search); None where it has none, or where it cannot be read (logged: text queries are then answered by
    vectors)."""
    try:
        return snapshot.keywords  # a Milvus collection's BM25 search, or the folder's FTS5 file
    except KeywordError as exc:
        log.warning("keyword search is off for the index in %s: %s", snapshot.root, exc)
        return None
