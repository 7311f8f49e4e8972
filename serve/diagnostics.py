"""Where the index fails: leave-one-out top-1 of every labelled gallery item, per-class Recall@1; and how similar
gallery images are to their nearest other image, the yardstick a query's best score is read against.

Each labelled, indexed image is searched against the rest of the index (its own id is dropped from the
results); it counts as correct when its nearest other image has the same label. The rank of the first
result with the query's label (1 = correct top-1) tells a near miss from a lost cause. Classes with a single
labelled image cannot be right and are left out. Works for any index whose catalogue has labels.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from retrieval.index.catalogue_reader import CatalogueQueries
from retrieval.index.faiss_backend.faiss_measure import drop_self
from retrieval.index.search import Index


@dataclass(frozen=True)
class Failure:
    query_id: int
    query_label: str
    top1_id: int
    top1_label: str | None
    score: float


RANK_DEPTH = 100  # results searched per query for the first correct one; deeper counts as RANK_DEPTH + 1


@dataclass
class ClassRecall:
    label: str
    queries: int
    correct: int
    failures: list[Failure] = field(default_factory=list)
    first_ranks: list[int] = field(default_factory=list)  # per query: rank of the first same-label result
    depth: int = RANK_DEPTH  # ranks beyond it were not searched (recorded as depth + 1)

    @property
    def recall_at_1(self) -> float:
        return self.correct / self.queries

    @property
    def mean_first_rank(self) -> float:
        """Mean rank of the first correct result (1 = always top-1); a query without one in the top
        ``depth`` counts as ``depth + 1``, so this is a lower bound when some query has none within ``depth``."""
        return sum(self.first_ranks) / len(self.first_ranks) if self.first_ranks else float("nan")


@dataclass
class LeaveOneOut:
    queries: int  # labelled images searched
    recall_at_1: float  # over all of them
    classes: list[ClassRecall]  # worst first: lowest Recall@1, then highest mean rank of the first correct
    sampled: bool  # True when a random subset of the labelled images was searched
    note: str = ""


def leave_one_out(
    index: Index,
    max_queries: int = 5000,
    seed: int = 0,
    failures_per_class: int = 3,
    batch: int = 1024,
) -> LeaveOneOut:
    labelled = index.catalogue.labelled()
    if not labelled:
        return LeaveOneOut(
            0,
            float("nan"),
            [],
            False,
            "the catalogue has no labels (images were not in "
            "class sub-folders or a manifest with a label column)",
        )
    label_of = dict(labelled)
    sizes = Counter(label_of.values())
    candidates = np.array(sorted(i for i, label in labelled if sizes[label] >= 2), dtype=np.int64)
    if not len(candidates):
        return LeaveOneOut(0, float("nan"), [], False, "every class has a single image: nothing to retrieve")
    sampled = len(candidates) > max_queries
    if sampled:
        rng = np.random.default_rng(seed)
        candidates = np.sort(rng.choice(candidates, max_queries, replace=False))
    ids, vectors = index.stored_rows(candidates)
    depth = max(1, min(RANK_DEPTH, len(index) - 1))
    per_class: dict[str, ClassRecall] = {}
    failures: defaultdict[str, list[Failure]] = defaultdict(list)
    for start in range(0, len(ids), batch):
        chunk_ids = ids[start : start + batch]
        scores, found = index.search_arrays(vectors[start : start + batch], depth + 1)
        others = drop_self(found, chunk_ids, depth)
        for own, row_others, row_scores, row_found in zip(chunk_ids, others, scores, found, strict=True):
            label = label_of[int(own)]
            stats = per_class.setdefault(label, ClassRecall(label, 0, 0, depth=depth))
            stats.queries += 1
            first = next((rank for rank, other in enumerate(row_others, 1)
                          if other >= 0 and label_of.get(int(other)) == label), depth + 1)
            stats.first_ranks.append(first)
            neighbour = int(row_others[0])
            if first == 1:
                stats.correct += 1
            elif len(failures[label]) < failures_per_class:
                score = float(row_scores[list(row_found).index(neighbour)]) if neighbour >= 0 else float("nan")
                failures[label].append(Failure(int(own), label, neighbour, label_of.get(neighbour), score))
    for label, stats in per_class.items():
        stats.failures = failures.get(label, [])
    classes = sorted(per_class.values(), key=lambda c: (c.recall_at_1, -c.mean_first_rank, -c.queries, c.label))
    total = sum(c.queries for c in classes)
    recall = sum(c.correct for c in classes) / total
    note = f"a random sample of {max_queries} labelled images" if sampled else "every labelled image"
    return LeaveOneOut(total, recall, classes, sampled, note)


# A query whose best score is below what this share of gallery images reach to their nearest other image is
# unlike the gallery: 1 % keeps the hint for queries lower than almost every gallery image's own neighbour
UNLIKE_QUANTILE = 0.01
NEIGHBOUR_SAMPLE = 2000  # gallery images whose nearest neighbour is measured (seeded sample beyond it)


@dataclass(frozen=True)
class NeighbourScores:
    """How similar gallery images are to their nearest other image (cosine), over ``images`` of them."""

    images: int
    sampled: bool  # a seeded sample of the indexed images, not every one
    floor: float  # the UNLIKE_QUANTILE quantile: all but that share of gallery images score at least this
    median: float
    quantile: float = UNLIKE_QUANTILE

    def unlike(self, best_score: float) -> bool:
        """Whether a query's best score is below what nearly every gallery image reaches to its own neighbour."""
        return best_score < self.floor

    def to_dict(self) -> dict[str, float | int | bool]:
        """The JSON form (/stats' ``neighbour_similarity``)."""
        return {"images": self.images, "sampled": self.sampled, "quantile": self.quantile,
                "floor": round(self.floor, 4), "median": round(self.median, 4)}


def neighbour_scores(index: Index, max_images: int = NEIGHBOUR_SAMPLE, seed: int = 0,
                     batch: int = 1024) -> NeighbourScores | None:
    """The best score of each indexed image (a seeded sample of ``max_images``) against the others, searched as a
    query is (the index's own search settings); None when the index holds fewer than 2 images."""
    ids = np.asarray(index.ids, dtype=np.int64)
    if len(ids) < 2:
        return None
    sampled = len(ids) > max_images
    if sampled:
        ids = np.sort(np.random.default_rng(seed).choice(ids, max_images, replace=False))
    ids, vectors = index.stored_rows(ids)
    best: list[float] = []
    for start in range(0, len(ids), batch):
        own = ids[start : start + batch]
        scores, found = index.search_arrays(vectors[start : start + batch], 2)
        for row_own, row_scores, row_found in zip(own, scores, found, strict=True):
            others = [float(s) for s, i in zip(row_scores, row_found, strict=True) if i >= 0 and i != row_own]
            if others:  # the first result that is not the image itself
                best.append(others[0])
    if not best:
        return None
    values = np.asarray(best)
    return NeighbourScores(len(values), sampled, float(np.quantile(values, UNLIKE_QUANTILE)),
                           float(np.median(values)))


@dataclass(frozen=True)
class Duplicate:
    """A gallery file the index skipped because its bytes equal an indexed one (its twin)."""

    id: int
    path: str
    label: str | None
    twin_id: int
    twin_path: str | None
    twin_label: str | None


def duplicates(catalogue: CatalogueQueries, limit: int = 200) -> tuple[int, list[Duplicate]]:
    """How many catalogue rows are exact duplicates, and up to ``limit`` of them with their twins (read through
    an open catalogue, e.g. the service's reader, so that a click opens no connection of its own)."""
    total, pairs = catalogue.duplicates(limit)
    return total, [
        Duplicate(
            copy["id"], copy["path"], copy["label"],
            copy["duplicate_of"] if copy["duplicate_of"] is not None else -1,
            twin["path"] if twin else None, twin["label"] if twin else None,
        )
        for copy, twin in pairs
    ]  # fmt: skip
