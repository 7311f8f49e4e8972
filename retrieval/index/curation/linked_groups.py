"""Near-duplicate groups from the neighbour graph's links (``neighbour_graph``), never by comparing all pairs.

Two images are linked when one is among the other's k nearest and their cosine is at least the threshold; linked
images are joined into sets (union-find), so a group of more than k + 1 copies is still found whole through its
links. Links chain (A ~ B ~ C with A and C unlike), so each set is then cut around its first image (the lowest id,
the one indexed first, kept by the suggested removal): a group holds the images at least the threshold alike to its
first one, and the rest are grouped again the same way (``split_around_first``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from retrieval.errors import ParameterError
from retrieval.index.curation.neighbour_graph import NeighbourGraph


class UnionFind:
    """Disjoint sets over 0..n-1 (union by size, path halving)."""

    def __init__(self, n: int) -> None:
        self.parent = np.arange(n, dtype=np.int64)
        self.size = np.ones(n, dtype=np.int64)

    def find(self, x: int) -> int:
        """The representative of ``x``'s set."""
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = int(parent[x])
        return int(x)

    def union(self, a: int, b: int) -> None:
        """Merge the sets of ``a`` and ``b``."""
        a, b = self.find(a), self.find(b)
        if a == b:
            return
        if self.size[a] < self.size[b]:
            a, b = b, a
        self.parent[b] = a
        self.size[a] += self.size[b]

    def roots(self) -> np.ndarray:
        """Each element's representative."""
        return np.fromiter((self.find(i) for i in range(len(self.parent))), np.int64, len(self.parent))


@dataclass(frozen=True)
class DuplicateGroup:
    """Images found as copies: ``ids`` ascending (the first is the one kept); ``links`` (a, b, cosine): every link
    found among them, or, once cut around the first image (``split_around_first``), (first, image, cosine)."""

    ids: np.ndarray
    links: list[tuple[int, int, float]]

    @property
    def weakest_link(self) -> float:
        """The lowest cosine among the group's links (at least the threshold)."""
        return min(score for _, _, score in self.links)

    @property
    def best_link(self) -> float:
        return max(score for _, _, score in self.links)


def duplicate_links(graph: NeighbourGraph, threshold: float, nearest: int = 0,
                    nearest_floor: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every link of the graph at or above ``threshold``, and each image's ``nearest`` first links at or above
    ``nearest_floor``, each pair once (a < b): (a ids, b ids, cosines)."""
    if not math.isfinite(threshold) or not -1.0 <= threshold <= 1.0:
        raise ParameterError("threshold", f"must be a cosine within [-1, 1], got {threshold!r}")
    first = np.arange(graph.k)[None, :] < nearest
    linked = (graph.scores >= threshold) | (first & (graph.scores >= nearest_floor))
    rows, columns = np.nonzero(linked & (graph.neighbours >= 0))
    a, b = graph.ids[rows], graph.neighbours[rows, columns]
    scores = graph.scores[rows, columns]
    low, high = np.minimum(a, b), np.maximum(a, b)
    pairs, first = np.unique(np.stack([low, high], axis=1), axis=0, return_index=True)
    if not len(pairs):
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
    return pairs[:, 0], pairs[:, 1], scores[first].astype(np.float32)


def duplicate_groups(graph: NeighbourGraph, threshold: float) -> list[DuplicateGroup]:
    """The connected groups of links at or above ``threshold`` (union-find), largest first, then the strongest
    link; memory and time grow with the links, never with n^2."""
    a, b, scores = duplicate_links(graph, threshold)
    if not len(a):
        return []
    nodes = np.unique(np.concatenate([a, b]))
    sets = UnionFind(len(nodes))
    pa, pb = np.searchsorted(nodes, a), np.searchsorted(nodes, b)
    for x, y in zip(pa.tolist(), pb.tolist(), strict=True):
        sets.union(x, y)
    roots = sets.roots()
    members: dict[int, list[int]] = {}
    for node, root in zip(nodes.tolist(), roots.tolist(), strict=True):
        members.setdefault(root, []).append(node)
    links: dict[int, list[tuple[int, int, float]]] = {}
    for x, y, score, root in zip(a.tolist(), b.tolist(), scores.tolist(), roots[pa].tolist(), strict=True):
        links.setdefault(root, []).append((x, y, float(score)))
    groups = [DuplicateGroup(np.asarray(sorted(ids), dtype=np.int64), links[root]) for root, ids in members.items()]
    return _ordered(groups)


def _ordered(groups: list[DuplicateGroup]) -> list[DuplicateGroup]:
    return sorted(groups, key=lambda g: (-len(g.ids), -g.best_link, int(g.ids[0])))


def split_around_first(groups: Sequence[DuplicateGroup], vectors: Mapping[int, np.ndarray],
                       threshold: float) -> list[DuplicateGroup]:
    """Each linked group cut into groups whose images are all at least ``threshold`` alike to the group's first
    image (links chain: A ~ B ~ C with A and C unlike would put two unrelated images together): the first image keeps
    those, the rest are grouped again the same way; a group's links are then (first, image, cosine). ``vectors``:
    id -> stored vector of every image in ``groups``."""
    out = []
    for group in groups:
        rest = [int(i) for i in group.ids]
        while len(rest) > 1:
            first = rest[0]
            scores = np.stack([vectors[i] for i in rest[1:]]) @ vectors[first]
            kept = [(i, float(score)) for i, score in zip(rest[1:], scores.tolist(), strict=True) if score >= threshold]
            if kept:
                out.append(DuplicateGroup(np.asarray([first, *(i for i, _ in kept)], dtype=np.int64),
                                          [(first, i, min(score, 1.0)) for i, score in kept]))
            taken = {i for i, _ in kept}
            rest = [i for i in rest[1:] if i not in taken]
    return _ordered(out)
