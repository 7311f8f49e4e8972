"""Where the index fails: leave-one-out top-1 of every labelled gallery item, per-class Recall@1.

Each labelled, indexed image is searched against the rest of the index (its own id is dropped from the
results); it counts as correct when its nearest other image has the same label. Classes with a single
labelled image cannot be right and are left out. Works for any index whose catalogue has labels.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from retrieval.index.builder import done_chunks
from retrieval.index.catalogue import Catalogue
from retrieval.index.faiss_ops import drop_self
from retrieval.index.search import Index
from retrieval.index.shards import ShardStore
from serve.catalogue_reader import CatalogueReader


@dataclass(frozen=True)
class Failure:
    query_id: int
    query_label: str
    top1_id: int
    top1_label: str | None
    score: float


@dataclass
class ClassRecall:
    label: str
    queries: int
    correct: int
    failures: list[Failure] = field(default_factory=list)

    @property
    def recall_at_1(self) -> float:
        return self.correct / self.queries


@dataclass
class LeaveOneOut:
    queries: int  # labelled images searched
    recall_at_1: float  # over all of them
    classes: list[ClassRecall]  # worst Recall@1 first
    sampled: bool  # True when a random subset of the labelled images was searched
    note: str = ""


def _vectors_of(index: Index, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The stored (normalised) vectors of sorted ``ids``, in shard order, with their ids."""
    with Catalogue(index.layout.catalogue) as catalogue:  # this thread's own connection
        shard_of = catalogue.done_shards()
    wanted = {int(i): shard_of[int(i)] for i in ids if int(i) in shard_of}
    chunks = list(done_chunks(ShardStore(index.layout.shards), wanted))
    if not chunks:
        return np.zeros(0, np.int64), np.zeros((0, index.dim), np.float32)
    return np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks])


def leave_one_out(
    index: Index,
    catalogue: CatalogueReader,
    max_queries: int = 5000,
    seed: int = 0,
    failures_per_class: int = 3,
    batch: int = 1024,
) -> LeaveOneOut:
    labelled = catalogue.labelled()
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
    ids, vectors = _vectors_of(index, candidates)
    per_class: dict[str, ClassRecall] = {}
    failures: defaultdict[str, list[Failure]] = defaultdict(list)
    for start in range(0, len(ids), batch):
        chunk_ids = ids[start : start + batch]
        scores, found = index.search_arrays(vectors[start : start + batch], 2)
        top1 = drop_self(found, chunk_ids, 1)[:, 0]
        for own, neighbour, row_scores, row_found in zip(chunk_ids, top1, scores, found, strict=True):
            label = label_of[int(own)]
            stats = per_class.setdefault(label, ClassRecall(label, 0, 0))
            stats.queries += 1
            neighbour_label = label_of.get(int(neighbour))
            if neighbour >= 0 and neighbour_label == label:
                stats.correct += 1
            elif len(failures[label]) < failures_per_class:
                score = (
                    float(row_scores[list(row_found).index(neighbour)]) if neighbour >= 0 else float("nan")
                )
                failures[label].append(Failure(int(own), label, int(neighbour), neighbour_label, score))
    for label, stats in per_class.items():
        stats.failures = failures.get(label, [])
    classes = sorted(per_class.values(), key=lambda c: (c.recall_at_1, -c.queries, c.label))
    total = sum(c.queries for c in classes)
    recall = sum(c.correct for c in classes) / total
    note = f"a random sample of {max_queries} labelled images" if sampled else "every labelled image"
    return LeaveOneOut(total, recall, classes, sampled, note)
