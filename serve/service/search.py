"""Searching: ``SearchService.search`` and ``search_batch`` (decode, embed through the micro-batcher, one faiss
search; a text query embedded by the state's text model), each answered from one state of the index."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
from PIL import Image

from retrieval.index import SearchResult
from retrieval.index.filters import Filter
from retrieval.index.live import LiveIndex
from retrieval.index.search import MAX_K
from retrieval.onnx_runtime import preprocess_images
from retrieval.rerank import RerankConfig
from retrieval.serve.admission import ClientGone
from retrieval.serve.images import QueryError, decode_query
from retrieval.serve.service.answers import QueryItem, SearchResponse
from retrieval.serve.service.checks import check_batch_size, check_embedding, checked_k_and_where, no_model_refusal
from retrieval.serve.service.state import ServedIndex
from retrieval.serve.service.text import TextQuery, embed_text_queries

# an image, an image file's bytes, an embedding [d], or words
Query = Image.Image | bytes | np.ndarray | list[float] | TextQuery

NO_MATCH_NOTE = "the filter matches no image of the index"  # the note's start: the app tells it from the others


def no_match_notes(state: ServedIndex, where: Filter | None, results: Sequence[SearchResult]) -> list[str]:
    """A note for an empty answer whose filter matches no image of the index, saying how values are compared."""
    if where is None or results or len(state.index.matching_ids(where)):
        return []
    return [f"{NO_MATCH_NOTE}. {state.index.filter_table.no_match_hint()}"]


class Searching:
    """``SearchService``'s searches: one query (``search``) or a batch (``search_batch``), each from ONE state."""

    # set by SearchService: the states it serves and its limits on an uploaded image
    live: LiveIndex[ServedIndex]
    current: Callable[[], ServedIndex]
    max_upload_bytes: int
    max_pixels: int

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
            batch = images if isinstance(images, np.ndarray) else \
                preprocess_images(images, model.embedder.preprocessing)
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

    def embed_texts(self, texts: list[str], state: ServedIndex,
                    positions: list[int] | None = None) -> tuple[np.ndarray | None, dict[str, float]]:
        """Embed ``texts`` (checked: ``text_query``; ``positions``: their places in a batch) with the text model of
        ``state`` (``embed_text_queries``); None where it has none but a keyword index (keywords alone answer), else
        a 422 saying why and what to do."""
        text = state.text.embedder
        if text is None and state.keywords is not None:
            return None, {}
        if text is None:
            raise state.text.refusal()
        started = time.perf_counter()
        vectors = embed_text_queries(text, texts, positions)
        return vectors, {"embed_ms": (time.perf_counter() - started) * 1000, "batch_size": len(texts)}

    def search(
        self,
        query: Query,
        k: int = 10,
        exclude_ids: tuple[int, ...] = (),
        exclude_self: bool = False,
        where: str | None = None,
        calibrate: bool = False,
        rerank: RerankConfig | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> SearchResponse:
        """Top-k of a PIL image, the bytes of an image file, an embedding [d] or a ``TextQuery`` (embedded by the
        state's text model); ``exclude_ids`` dropped.

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
        query: Query,
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
        elif isinstance(query, TextQuery):
            embedded, embed_timing = self.embed_texts([query.text], state)
            timing.update(embed_timing)
        else:
            embedding = check_embedding(query, state.index.dim)
        search_started = time.perf_counter()
        if isinstance(query, TextQuery):  # vectors and keywords fused (retrieval.text.text_search)
            results = state.search_text([query.text], embedded, k, exclude_ids, where, rerank)[0]
        else:
            results = state.search(embedding, k, exclude_ids, where, rerank, cancelled)[0]
        timing["search_ms"] = (time.perf_counter() - search_started) * 1000
        timing["total_ms"] = (time.perf_counter() - started) * 1000
        timing = {key: round(v, 3) for key, v in timing.items()}
        return SearchResponse(results, k, timing, query_item, excluded_self,
                              notes + no_match_notes(state, where, results), rerank=rerank,
                              no_match=state.no_match.verdict(results) if isinstance(query, TextQuery) else None)

    def search_batch(
        self,
        queries: Sequence[Query | QueryError],
        k: int = 10,
        exclude_self: bool = False,
        where: str | None = None,
        cancelled: Callable[[], bool] | None = None,
        rerank: RerankConfig | None = None,
    ) -> list[SearchResponse | QueryError]:
        """Top-k of each query (as ``search``), in order: the images embedded in ONE model call, the texts in one
        call of the text model, one faiss search.

        Rules: 1..``MAX_BATCH_QUERIES`` queries; ``k``, ``where`` and ``exclude_self`` apply to every query; an
        invalid embedding, k or filter refuses the whole batch (422, the query named by its position), as does a
        text query to a state without a text model. Only what
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
            if not isinstance(query, (QueryError, Image.Image, bytes, bytearray, TextQuery)):
                try:
                    vectors[position] = check_embedding(query, state.index.dim)
                except QueryError as exc:
                    raise QueryError(f"queries[{position}]: {exc}", exc.status) from exc
        texts = {position: query.text for position, query in enumerate(queries) if isinstance(query, TextQuery)}
        if texts and state.text.embedder is None and state.keywords is None:  # refuses the batch, as an image
            # query to no model does
            refusal = state.text.refusal()
            raise QueryError(f"queries[{next(iter(texts))}]: {refusal}", refusal.status)
        if not state.index.has_model:  # an image query refuses the batch, as an invalid embedding does
            for position, query in enumerate(queries):
                if isinstance(query, (Image.Image, bytes, bytearray)):
                    refusal = no_model_refusal(state)
                    raise QueryError(f"queries[{position}]: {refusal}", refusal.status)
        answers: list[SearchResponse | QueryError] = [SearchResponse([], k, rerank=rerank) for _ in queries]
        # each image becomes the model's small input as soon as it is decoded: a batch never holds 64 decoded
        # images at once (a tiny PNG can declare tens of megapixels within the pixel limit)
        images: dict[int, np.ndarray] = {}
        preprocessing = state.model.embedder.preprocessing if state.index.has_model else None
        own: dict[int, int] = {}  # position -> the gallery item it leaves out (exclude_self)
        for position, query in enumerate(queries):
            answer = answers[position]
            if isinstance(query, QueryError):
                answers[position] = query
            elif isinstance(query, Image.Image):
                images[position] = preprocess_images([query], preprocessing)[0]
            elif isinstance(query, (bytes, bytearray)):
                if cancelled is not None and cancelled():  # nobody waits for the answer: stop between images
                    raise ClientGone()
                try:
                    decoded, answer.query_item, answer.notes, decode_ms = self._decode(state, bytes(query))
                except QueryError as exc:  # this query only: the others are answered
                    answers[position] = exc
                    continue
                images[position] = preprocess_images([decoded], preprocessing)[0]
                del decoded
                answer.timing["decode_ms"] = decode_ms
                answer.excluded_self = exclude_self and answer.query_item is not None
                if answer.excluded_self:
                    own[position] = answer.query_item.id  # type: ignore[union-attr]
        shared: dict[str, float] = {}
        if images:  # the whole batch in one reservation: one model call, never query by query
            embedded, shared = self.embed_images(np.stack(list(images.values())), state)
            vectors |= dict(zip(images, embedded, strict=True))
        shared_text: dict[str, float] = {}
        text_vectors = None
        if texts:  # every text of the batch in one call of the text model (None: keywords alone)
            text_vectors, shared_text = self.embed_texts(list(texts.values()), state, list(texts))
        searched = sorted(vectors)
        if searched or texts:
            search_started = time.perf_counter()
            found = dict(zip(searched, self._search_vectors(
                state, np.stack([vectors[p] for p in searched]), k, [own.get(p) for p in searched], where, rerank,
                cancelled), strict=True)) if searched else {}
            if texts:  # vectors and keywords fused (retrieval.text.text_search)
                found |= dict(zip(texts, state.search_text(list(texts.values()), text_vectors, k, where=where,
                                                           rerank=rerank), strict=True))
            search_ms = (time.perf_counter() - search_started) * 1000
            for position, results in sorted(found.items()):
                answer = answers[position]
                assert isinstance(answer, SearchResponse)
                answer.results = results
                answer.notes += no_match_notes(state, where, results)
                if position in texts:
                    answer.no_match = state.no_match.verdict(results)
                timing = answer.timing | (shared if position in images else shared_text if position in texts
                                          else {}) | {
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
