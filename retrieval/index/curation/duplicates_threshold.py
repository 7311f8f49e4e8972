"""The ``auto`` threshold of the near-duplicate groups, calibrated on copies the code plants itself.

For a seeded sample of gallery images, ``copy_planting.plant_copies`` makes a resized, a re-encoded (JPEG), a
cropped and a recoloured copy, the index's model embeds them, and each copy's cosine to its original's stored vector
is a score a duplicate reaches. Against them stands each searched image's nearest *distinct* image
(``nearest_distinct_scores``): its nearest neighbour, unless up to ``MAX_OWN_COPIES`` leading neighbours stand
``ISOLATION_GAP`` above the rest (its own copies, perhaps: then the next one), and at least its most alike neighbour
of another label (a copy keeps its label). The cut is halfway between the copies' floor (the cosine ``RECALL_TARGET``
of them reach) and the distinct images' ceiling (the highest, all but one in a thousand images), with
``CUT_CLEARANCE`` clear on each side; where they overlap, it is put above the distinct images (a missed copy costs
less than a distinct image proposed for removal) and the calibration says they do not separate (docs/INDEX.md,
"Near-duplicates"). A fixed quantile or Youden's J would, on a gallery of a few hundred images, land among its
distinct images.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from retrieval.data.eval_preprocess import EvalPreprocess
from retrieval.errors import ParameterError
from retrieval.index.curation.copy_planting import THRESHOLD_KINDS, plant_copies
from retrieval.index.curation.neighbour_graph import NeighbourGraph, stored_vectors
from retrieval.index.query_embedder import ImageEmbedder, NoModel, prepare_vectors
from retrieval.index.search import Index

CALIBRATION_SAMPLE = 100  # images whose planted copies calibrate `auto` (4 copies each are embedded)
MAX_CALIBRATION_SAMPLE = 2000  # each sampled image costs 4 embeddings
COPY_KINDS = THRESHOLD_KINDS  # the copies planted of each sample image (``copy_planting``)
RECALL_TARGET = 0.9  # share of the planted copies the cut should keep: the copies' floor is their 10th percentile
CUT_CLEARANCE = 0.01  # cosine kept clear between the cut and each side (copies' floor, distinct images' ceiling)
# an image's leading neighbours count as its own copies (and the next one as its nearest distinct image) when they
# stand this far above the rest; more than MAX_OWN_COPIES alike neighbours are lookalikes, not copies
ISOLATION_GAP = 0.03
MAX_OWN_COPIES = 3
DISTINCT_TOLERANCE = 0.001  # share of images whose nearest distinct image may reach the cut (none below 1,000)


def copy_floor(copy_scores: Sequence[float]) -> float:
    """The cosine ``RECALL_TARGET`` of the planted copies reach (their 10th percentile)."""
    copies = np.asarray(copy_scores, dtype=np.float64)
    if not len(copies):
        raise ParameterError("copy_scores", "is empty: no planted copy could be embedded to calibrate with")
    return float(np.quantile(copies, 1.0 - RECALL_TARGET))


def distinct_ceiling(distinct_scores: Sequence[float]) -> float:
    """The highest nearest-distinct cosine, all but ``DISTINCT_TOLERANCE`` of the images (the very highest below
    1,000 images); -inf when there is none."""
    scores = np.asarray(distinct_scores, dtype=np.float64)
    scores = np.sort(scores[np.isfinite(scores)])[::-1]
    if not len(scores):
        return -math.inf
    return float(scores[min(len(scores) - 1, int(DISTINCT_TOLERANCE * len(scores)))])


def choose_threshold(copy_scores: Sequence[float], distinct_scores: Sequence[float]) -> float:
    """The cosine cut between planted copies and distinct images: halfway between the copies' floor and the distinct
    images' ceiling where ``2 * CUT_CLEARANCE`` or more apart; else ``CUT_CLEARANCE`` above the ceiling (at most 1)."""
    floor, ceiling = copy_floor(copy_scores), distinct_ceiling(distinct_scores)
    if not math.isfinite(ceiling):  # nothing distinct was seen (a gallery of a few images)
        return float(round(max(-1.0, floor - CUT_CLEARANCE), 4))
    if floor - ceiling >= 2 * CUT_CLEARANCE:
        return float(round((floor + ceiling) / 2, 4))
    return float(round(min(1.0, ceiling + CUT_CLEARANCE), 4))


def nearest_distinct_scores(graph: NeighbourGraph, label_of: Mapping[int, str] | None = None) -> np.ndarray:
    """Each searched image's cosine to its nearest distinct image: its nearest neighbour, unless its first 1 to
    ``MAX_OWN_COPIES`` neighbours stand ``ISOLATION_GAP`` above the next (its copies, perhaps: the next is then its
    nearest distinct one); with ``label_of`` (id -> label), at least its most alike neighbour of another label.
    -inf where an image has no neighbour that counts."""
    present = graph.neighbours >= 0
    scores = np.where(present, graph.scores, -np.inf).astype(np.float64)
    if not scores.shape[1]:
        return np.full(len(graph.ids), -np.inf)
    distinct = scores[:, 0].copy()
    if scores.shape[1] > 1:
        leading = min(MAX_OWN_COPIES, scores.shape[1] - 1)
        with np.errstate(invalid="ignore"):  # -inf - -inf where neither neighbour exists: no gap
            gaps = scores[:, :leading] - scores[:, 1:leading + 1]
        # a gap to a neighbour that is not there says nothing: the one neighbour seen counts
        isolated = (np.nan_to_num(gaps, nan=0.0) >= ISOLATION_GAP) & present[:, 1:leading + 1]
        found = isolated.any(axis=1)
        after = np.argmax(isolated, axis=1) + 1  # the first neighbour below the gap
        rows = np.flatnonzero(found)
        distinct[rows] = scores[rows, after[rows]]
    if label_of:
        labelled = np.fromiter(label_of.keys(), np.int64, len(label_of))
        names, codes = np.unique(np.asarray(list(label_of.values()), dtype=object).astype(str), return_inverse=True)
        order = np.argsort(labelled)
        labelled, codes = labelled[order], codes[order]

        def code(ids: np.ndarray) -> np.ndarray:
            at = np.clip(np.searchsorted(labelled, ids), 0, len(labelled) - 1)
            return np.where(labelled[at] == ids, codes[at], -1)

        own, theirs = code(graph.ids), code(graph.neighbours)
        other = present & (own[:, None] >= 0) & (theirs >= 0) & (theirs != own[:, None])
        distinct = np.maximum(distinct, np.where(other, scores, -np.inf).max(axis=1))
    return distinct


@dataclass
class Calibration:
    """What ``auto`` measured: the threshold; the planted copies' floor and the distinct images' ceiling it sits
    between (``separated``: at least ``RECALL_TARGET`` of the copies reach it); at it, the share of planted copies
    kept (per kind) and of the searched images whose nearest other image reaches it."""

    threshold: float
    images: int  # gallery images whose copies were planted
    copies: int  # copies embedded
    copy_recall: float  # share of the copies at or above the threshold
    recall_by_kind: dict[str, float]
    neighbour_share: float  # share of the searched images whose nearest other image is at or above it
    copy_scores: dict[str, list[float]] = field(repr=False, default_factory=dict)
    neighbour_scores: list[float] = field(repr=False, default_factory=list)
    floor: float = math.nan  # the cosine RECALL_TARGET of the planted copies reach
    ceiling: float = math.nan  # the highest nearest-distinct cosine (distinct_ceiling)
    labels_used: bool = False  # neighbours of another label counted as distinct images
    distinct_scores: list[float] = field(repr=False, default_factory=list)

    @property
    def separated(self) -> bool:
        """Whether the cut keeps ``RECALL_TARGET`` of the planted copies with the distinct images below it."""
        return self.copy_recall >= RECALL_TARGET and not self.ceiling >= self.threshold

    @property
    def warning(self) -> str | None:
        """Why the groups found at this cut miss copies, for people; None when copies and distinct images
        separate."""
        if self.separated:
            return None
        kinds = ", ".join(f"{kind} {value:.0%}" for kind, value in self.recall_by_kind.items())
        return (f"planted copies and distinct images do not separate: distinct images reach cosine "
                f"{self.ceiling:.3f} while {RECALL_TARGET:.0%} of the copies reach {self.floor:.3f}; the cut is above "
                f"the distinct images, so only {self.copy_recall:.0%} of the copies reach it ({kinds}). A lower "
                "--threshold finds more copies among distinct images: look at each group before removing any; a "
                "model trained on such images separates them better")

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (without the raw scores)."""
        return {"threshold": self.threshold,
                "method": "planted copies against each image's nearest distinct image (floor, ceiling, margin)",
                "images": self.images, "copies": self.copies, "copy_recall": round(self.copy_recall, 4),
                "recall_by_kind": {kind: round(value, 4) for kind, value in self.recall_by_kind.items()},
                "neighbour_share": round(self.neighbour_share, 4),
                "copy_floor": _rounded(self.floor), "distinct_ceiling": _rounded(self.ceiling),
                "margin": CUT_CLEARANCE, "recall_target": RECALL_TARGET, "labels_used": self.labels_used,
                "separated": self.separated, "warning": self.warning,
                "copy_score_quantiles": _quantiles([s for v in self.copy_scores.values() for s in v]),
                "neighbour_score_quantiles": _quantiles(self.neighbour_scores),
                "distinct_score_quantiles": _quantiles(self.distinct_scores)}


def _rounded(value: float) -> float | None:
    return round(value, 4) if math.isfinite(value) else None


def _quantiles(values: Sequence[float]) -> dict[str, float] | None:
    if not len(values):
        return None
    q = np.quantile(np.asarray(values, dtype=np.float64), [0.05, 0.5, 0.95])
    return {"p5": round(float(q[0]), 4), "median": round(float(q[1]), 4), "p95": round(float(q[2]), 4)}


def embed_images(embedder: ImageEmbedder, images: Sequence[Image.Image], batch_size: int = 32) -> np.ndarray:
    """L2-normalised embeddings of PIL images, preprocessed as the index's gallery files are."""
    preprocess = EvalPreprocess(embedder.preprocessing)
    dim = int(embedder.embedding_dim)
    parts = [np.zeros((0, dim), np.float32)]
    for start in range(0, len(images), batch_size):
        batch = np.stack([np.asarray(preprocess(image)) for image in images[start:start + batch_size]])
        parts.append(prepare_vectors(embedder.embed(batch.astype(np.float32, copy=False)), dim))
    return np.concatenate(parts)


def calibrate(originals: np.ndarray, images: Sequence[Image.Image], embedder: ImageEmbedder,
              neighbour_scores: Sequence[float], seed: int = 0, distinct_scores: Sequence[float] | None = None,
              labels_used: bool = False) -> Calibration:
    """``auto``'s threshold from the planted copies of ``images`` (whose stored vectors are ``originals``) against
    the gallery's nearest-distinct cosines ``distinct_scores`` (default: its nearest-neighbour cosines
    ``neighbour_scores``, which the share flagged is read from)."""
    if len(images) != len(originals):
        raise ParameterError("images", f"must be the {len(originals)} originals' images, got {len(images)}")
    background = embedder.preprocessing.background
    planted = [plant_copies(image, COPY_KINDS, seed + n, background) for n, image in enumerate(images)]
    copies = embed_images(embedder, [copy for kinds in planted for copy in kinds.values()])
    owner = np.repeat(np.arange(len(images)), len(COPY_KINDS))
    scores = np.einsum("ij,ij->i", copies, originals[owner])
    by_kind = {kind: scores[position::len(COPY_KINDS)].tolist() for position, kind in enumerate(COPY_KINDS)}
    others = np.asarray(neighbour_scores, dtype=np.float64)
    distinct = others if distinct_scores is None else np.asarray(distinct_scores, dtype=np.float64)
    threshold = choose_threshold(scores, distinct)
    return Calibration(
        threshold, len(images), len(scores), float((scores >= threshold).mean()),
        {kind: float((np.asarray(values) >= threshold).mean()) for kind, values in by_kind.items()},
        float((others >= threshold).mean()) if len(others) else 0.0, by_kind, others.tolist(),
        copy_floor(scores), distinct_ceiling(distinct), labels_used, distinct[np.isfinite(distinct)].tolist())


def check_sample(sample: int) -> int:
    """The calibration sample as an int within [2, MAX_CALIBRATION_SAMPLE], else a ParameterError."""
    if isinstance(sample, bool) or not isinstance(sample, (int, np.integer)) or \
            not 2 <= sample <= MAX_CALIBRATION_SAMPLE:
        raise ParameterError("sample", f"must be between 2 and {MAX_CALIBRATION_SAMPLE} images (each costs a few "
                                       f"embeddings of copies planted of it), got {sample!r}")
    return int(sample)


def calibrate_on_index(index: Index, graph: NeighbourGraph, load: Callable[[int], Image.Image | None],
                       embedder: ImageEmbedder, sample: int = CALIBRATION_SAMPLE, seed: int = 0) -> Calibration:
    """``calibrate`` on a seeded sample of the graph's images (``load(id)`` gives an image's picture; None: it
    cannot be read now, and another image is taken; the stored vectors are the originals) against every searched
    image's nearest distinct image (``nearest_distinct_scores``, the catalogue's labels counted)."""
    sample = check_sample(sample)
    if isinstance(embedder, NoModel):  # built from embeddings: nothing can embed the planted copies
        raise ParameterError("threshold", "auto embeds copies it plants of gallery images with the index's model, "
                                          "and this index was built from embeddings: it has none; give `threshold` "
                                          "a cosine instead, e.g. 0.95")
    # the model sees at most its input size: a photo is kept at 4 x that, so the sample's memory stays small
    side = 4 * embedder.preprocessing.input_size
    order = np.random.default_rng(seed).permutation(len(graph.ids))[:2 * sample]
    chosen, images = [], []
    for row in order:  # an unreadable file is passed over: at most 2 x sample files are tried
        image = load(int(graph.ids[row]))
        if image is not None:
            image.thumbnail((side, side))
            chosen.append(int(row))
            images.append(image)
        if len(chosen) == sample:
            break
    if len(chosen) < 2:
        raise ParameterError("threshold", "auto needs at least 2 readable gallery images to plant copies of; "
                                          "give `threshold` a number instead, e.g. 0.95")
    rows = np.asarray(chosen, dtype=np.int64)
    ids, vectors = stored_vectors(index, graph.ids[rows])
    position = {int(i): n for n, i in enumerate(ids)}
    kept = [n for n, row in enumerate(rows) if int(graph.ids[row]) in position]
    if len(kept) < 2:  # a writer removed them since the graph was searched
        raise ParameterError("threshold", "auto found fewer than 2 sampled images still indexed; run it again")
    originals = np.stack([vectors[position[int(graph.ids[rows[n]])]] for n in kept])
    # every searched image's nearest distinct image, not only the sample's: the far tail of distinct pairs is what
    # a cut just above the sample's highest would meet
    nearest = graph.scores[:, 0]
    label_of = dict(index.catalogue.labelled())
    return calibrate(originals, [images[n] for n in kept], embedder, nearest[np.isfinite(nearest)].tolist(), seed,
                     nearest_distinct_scores(graph, label_of), bool(label_of))
