"""Each image's k nearest other images: the graph that the near-duplicate groups (``duplicates``) and the label
audit (``audit``) read.

Never an all-pairs matrix: each image is one query of k + 1 results (itself dropped), so the graph costs n
searches and holds n x k scores and ids. Over an index the searches go through the index's own faiss index (its
search settings; exact for Flat, approximate for HNSW and IVF) with the vectors read shard by shard from the
index's shards; over an array (a folder of images) through an exact flat index. Read side: no writer, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import faiss
import numpy as np

from retrieval.errors import ParameterError
from retrieval.index.search import Index
from retrieval.index.shards import ShardStore
from retrieval.index.vectors import done_chunks

MAX_NEIGHBOURS = 100  # k per image: the graph holds n x k scores and ids
SearchFn = Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class NeighbourGraph:
    """The images searched and, per image, its k nearest other images, best first."""

    ids: np.ndarray  # int64 [n]: the images searched, ascending
    scores: np.ndarray  # float32 [n, k]: cosine to each neighbour; -inf where there is none
    neighbours: np.ndarray  # int64 [n, k]: the neighbours' ids; -1 where there is none
    search: str = "exact"  # how the neighbours were found (for the summaries)
    sampled: bool = False  # the images searched are a sample; their neighbours may be any indexed image

    @property
    def k(self) -> int:
        """Neighbours per image."""
        return int(self.neighbours.shape[1])

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """The row of each of ``ids`` (which must be among ``self.ids``)."""
        return np.searchsorted(self.ids, np.asarray(ids, dtype=np.int64))


def check_k(k: int) -> int:
    """``k`` as an int within [1, MAX_NEIGHBOURS], else a ParameterError naming the range."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_NEIGHBOURS:
        raise ParameterError("k", f"must be a whole number of neighbours between 1 and {MAX_NEIGHBOURS}, got {k!r}")
    return int(k)


def without_self(scores: np.ndarray, found: np.ndarray, own: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``k`` results of each row that are not the row's own id (an approximate search may miss it, ties
    may put it anywhere), with -inf scores where there is no result."""
    keep = found != own[:, None]
    order = np.argsort(~keep, axis=1, kind="stable")[:, :k]  # the kept ones first, in score order
    kept_ids = np.take_along_axis(np.where(keep, found, -1), order, 1)
    kept_scores = np.take_along_axis(scores.astype(np.float32), order, 1)
    kept_scores[kept_ids < 0] = -np.inf
    if kept_ids.shape[1] < k:  # fewer results than asked for: pad
        pad = k - kept_ids.shape[1]
        kept_ids = np.pad(kept_ids, ((0, 0), (0, pad)), constant_values=-1)
        kept_scores = np.pad(kept_scores, ((0, 0), (0, pad)), constant_values=-np.inf)
    return kept_scores, kept_ids


def graph_from_chunks(chunks: Iterable[tuple[np.ndarray, np.ndarray]], search: SearchFn, k: int,
                      description: str = "exact", sampled: bool = False) -> NeighbourGraph:
    """The graph of the images in ``chunks`` ((ids, vectors) pairs, e.g. one per shard): each chunk is searched with
    ``search(vectors, k + 1)`` (scores, ids) and each image's own id dropped."""
    k = check_k(k)
    all_ids, all_scores, all_found = [np.zeros(0, np.int64)], [np.zeros((0, k), np.float32)], \
        [np.zeros((0, k), np.int64)]
    for ids, vectors in chunks:
        if not len(ids):
            continue
        scores, found = search(np.ascontiguousarray(vectors, dtype=np.float32), k + 1)
        scores, found = without_self(scores, found, np.asarray(ids, dtype=np.int64), k)
        all_ids.append(np.asarray(ids, dtype=np.int64))
        all_scores.append(scores)
        all_found.append(found)
    ids, scores, found = np.concatenate(all_ids), np.concatenate(all_scores), np.concatenate(all_found)
    order = np.argsort(ids, kind="stable")
    return NeighbourGraph(ids[order], scores[order], found[order], description, sampled)


def exact_graph(vectors: np.ndarray, ids: np.ndarray | None = None, k: int = 10,
                batch: int = 4096) -> NeighbourGraph:
    """The exact graph of ``vectors`` (unit rows; ids default to the row numbers): a flat inner-product index,
    searched ``batch`` rows at a time (n^2 d work in all, n x batch scores at a time)."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    ids = np.arange(len(vectors), dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
    if len(ids) != len(vectors):
        raise ParameterError("ids", f"must name the {len(vectors)} vectors, got {len(ids)} ids")
    flat = faiss.IndexIDMap2(faiss.IndexFlatIP(vectors.shape[1]))
    flat.add_with_ids(vectors, ids)
    chunks = ((ids[s:s + batch], vectors[s:s + batch]) for s in range(0, len(ids), batch))
    return graph_from_chunks(chunks, flat.search, k, "exact (all vectors compared)")


def index_search_description(index: Index) -> str:
    """How an index's own search finds neighbours, for the summaries: its type and search settings."""
    info = index.info
    key = str(info.vectors.index_key if info.holds("index_key") else "?")
    params = ", ".join(f"{name}={value}" for name, value in (info.vectors.params or {}).items())
    how = "exact" if key == "Flat" else "approximate"
    return f"the index's own search ({key}{', ' + params if params else ''}: {how})"


def stored_vectors(index: Index, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The stored (L2-normalised) vectors of the ``ids`` that the index holds, read from their shards, with their
    ids in ascending order."""
    wanted_ids = np.asarray(ids, dtype=np.int64)
    wanted_ids = np.unique(wanted_ids[index.holds(wanted_ids)]) if len(wanted_ids) else wanted_ids
    shard_of = index.catalogue.shards_of(wanted_ids.tolist())
    chunks = list(done_chunks(ShardStore(index.layout.shards, read_only=True), shard_of))
    if not chunks:
        return np.zeros(0, np.int64), np.zeros((0, index.dim), np.float32)
    found_ids = np.concatenate([c[0] for c in chunks])
    vectors = np.concatenate([c[1] for c in chunks])
    order = np.argsort(found_ids, kind="stable")
    return found_ids[order], vectors[order]


def index_graph(index: Index, k: int = 10, max_images: int | None = None, seed: int = 0) -> NeighbourGraph:
    """The graph of an index's images (a seeded sample of ``max_images`` of them, whose neighbours are any indexed
    image), through the index's own search; the vectors are read shard by shard, never all at once."""
    k = check_k(k)
    ids = np.asarray(index.ids, dtype=np.int64)
    sampled = max_images is not None and len(ids) > int(max_images)
    if sampled:
        ids = np.sort(np.random.default_rng(seed).choice(ids, int(max_images), replace=False))
    shard_of = index.catalogue.shards_of(ids.tolist())
    chunks = done_chunks(ShardStore(index.layout.shards, read_only=True), shard_of)
    depth = min(k + 1, max(1, len(index)))
    return graph_from_chunks(chunks, lambda vectors, _: index.search_arrays(vectors, depth), k,
                             index_search_description(index), sampled)
