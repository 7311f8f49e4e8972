"""The calibration of the copy verification (``copy_verification``), on copies it plants of the gallery itself.

For a seeded sample of gallery images, copies are planted as people make them (``copy_planting``: resized,
re-encoded, cropped, brightened, slightly turned, shrunk to a third and brightened), one colour variant (its hues
turned, a distinct product) and one shade variant (its colours darker, its ground kept). The candidate cosine
is the one ``CANDIDATE_RECALL`` of the planted copies reach under the index's model, less ``CANDIDATE_SLACK`` (loose on
purpose: it only chooses which pairs are checked). Each sample image is compared with its
copies (the positives), its colour and shade variants and its nearest distinct images in the index
(``distinct_neighbours``: of another label, or past its own copies); the aligned-correlation, colour and shade cuts
are put between them
(``choose_rules``), and ``VerificationCalibration`` says how they did and how far a verified pair can be trusted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from retrieval.errors import ParameterError
from retrieval.index.curation.copy_check import SOURCE_SIDE, PairComparison, compare_pair, image_features
from retrieval.index.curation.copy_planting import (
    VERIFICATION_KINDS,
    plant_colour_variant,
    plant_copies,
    plant_shade_variant,
)
from retrieval.index.curation.copy_verification import CopyGroup, CopyRules
from retrieval.index.curation.duplicates_threshold import ISOLATION_GAP, MAX_OWN_COPIES, check_sample, embed_images
from retrieval.index.curation.neighbour_graph import NeighbourGraph, stored_vectors
from retrieval.index.query_embedder import ImageEmbedder, NoModel
from retrieval.index.search import Index

COPY_KINDS = VERIFICATION_KINDS  # the copies planted of each sample image (``copy_planting``)
# gallery images whose planted copies calibrate the verification (each: 6 copies embedded and compared, a colour
# variant, a shade variant and 2 nearest distinct images compared)
VERIFY_SAMPLE = 50
CANDIDATE_RECALL = 0.99  # share of the planted copies the candidate cosine keeps
CANDIDATE_SLACK = 0.05  # taken off the candidate cosine: copies harsher than the planted ones score lower
MIN_CANDIDATE_COSINE = 0.5  # never lower: below, a k-neighbour graph holds mostly unrelated pairs
# each image's nearest other image is a candidate whatever its cosine (down to MIN_CANDIDATE_COSINE): a harsh crop
# falls below the candidate cosine yet its original is still the image nearest to it
NEAREST_CANDIDATES = 1
COPY_RECALL = 0.95  # the correlation cut keeps this share of the planted copies that pass the other tests
# the cuts are never looser than these (a sample of a few images must not open them wide; below 0.9, distinct
# 28 px product photos of one kind aligned by 4-8 features passed) nor stricter than the tight ones (a sample whose
# distinct images correlate highly must not close them)
LOOSE_CORRELATION, TIGHT_CORRELATION = 0.90, 0.97
CORRELATION_MARGIN = 0.03  # the correlation cut sits this far below the planted copies' floor
LOOSE_COLOUR, TIGHT_COLOUR = 20.0, 6.0  # degrees of hue (copy_check.colour_difference)
# |log| of the colours' strength ratio (copy_check.shade_difference): never stricter than 0.4, as brightness x0.75
# to x1.35 moves it by up to about |log 0.75| = 0.29 (0.34 measured); never looser than 0.6, the planted shade's own
LOOSE_SHADE, TIGHT_SHADE = 0.6, 0.4
DISTINCT_PER_IMAGE = 2  # nearest distinct images compared per sample image
CALIBRATION_CHUNK = 16  # sample images planted, embedded and compared at a time


def choose_rules(copies: Sequence[PairComparison], distinct: Sequence[PairComparison],
                 variants: Sequence[PairComparison], shades: Sequence[PairComparison] = ()) -> CopyRules:
    """The correlation cut ``CORRELATION_MARGIN`` below the floor of the planted copies that pass the geometric tests
    (the correlation ``COPY_RECALL`` of them reach), or just above the distinct pairs that pass them where one reaches
    higher; the colour
    cut halfway between the copies' mismatch (its ``COPY_RECALL`` quantile) and the colour variants' (their lowest);
    the shade cut likewise between the copies' and the shade variants'; each kept within [tight, loose]."""
    # the geometric tests alone
    geometric = CopyRules(correlation=-math.inf, colour_mismatch=math.inf, shade=math.inf)
    passing = [c.correlation for c in copies if geometric.reason(c) is None]
    floor = float(np.quantile(passing, 1 - COPY_RECALL)) if passing else TIGHT_CORRELATION
    against = [c.correlation for c in distinct if geometric.reason(c) is None]
    ceiling = max(against) if against else -1.0
    # the copies are known, the distinct pairs that align are few in a sample (flags that share a canton, two alike
    # silhouettes): the cut stays near the copies' floor unless the distinct ones reach above it
    correlation = max(floor - CORRELATION_MARGIN, ceiling + 0.01)
    correlation = float(min(TIGHT_CORRELATION, max(LOOSE_CORRELATION, correlation)))
    colour = _cut_between([c.colour_mismatch for c in copies if geometric.reason(c) is None],
                          [c.colour_mismatch for c in variants if geometric.reason(c) is None and c.coloured_pixels],
                          TIGHT_COLOUR, LOOSE_COLOUR)
    shade = _cut_between([c.shade for c in copies if geometric.reason(c) is None],
                         [c.shade for c in shades if geometric.reason(c) is None and c.shade > 0],
                         TIGHT_SHADE, LOOSE_SHADE)
    return CopyRules(round(correlation, 4), round(colour, 4), shade=round(shade, 4))


def _cut_between(copy_values: list[float], variant_values: list[float], tight: float, loose: float) -> float:
    """A cut on a mismatch measure: halfway between the copies' (their ``COPY_RECALL`` quantile) and the variants'
    (their lowest) where those lie above, else at the copies'; kept within [tight, loose]."""
    high = float(np.quantile(copy_values, COPY_RECALL)) if copy_values else tight
    low = min(variant_values) if variant_values else loose
    return float(min(loose, max(tight, (high + low) / 2 if low > high else high)))


@dataclass
class VerificationCalibration:
    """What the calibration measured: the candidate cosine, the rules, and how they did on the sample: planted copies
    verified (per kind), colour variants and nearest distinct images wrongly verified."""

    candidate_cosine: float
    rules: CopyRules
    images: int
    copy_cosines: dict[str, list[float]]
    copy_checks: dict[str, list[PairComparison]] = field(repr=False)
    variant_checks: list[PairComparison] = field(repr=False)
    distinct_checks: list[PairComparison] = field(repr=False)
    labels_used: bool = False
    # shade variants: they set the shade cut; not counted as distinct pairs (a darker grey photo, which has no colour
    # to tell by, may as well be a darkened copy)
    shade_checks: list[PairComparison] = field(default_factory=list, repr=False)

    def _verified(self, checks: Iterable[PairComparison]) -> list[bool]:
        return [self.rules.reason(c) is None for c in checks]

    def _found(self, kind: str) -> list[bool]:
        """Each planted copy of ``kind``: a candidate (its cosine at least the candidate cosine) and verified."""
        return [cos >= self.candidate_cosine and ok for cos, ok in
                zip(self.copy_cosines[kind], self._verified(self.copy_checks[kind]), strict=True)]

    @property
    def copy_recall(self) -> float:
        """Share of the planted copies that are candidates and verified."""
        found = [ok for kind in COPY_KINDS for ok in self._found(kind)]
        return float(np.mean(found)) if found else 0.0

    def recall_by_kind(self) -> dict[str, float]:
        """Per kind of planted copy, the share found (a candidate) and verified."""
        return {kind: float(np.mean(found)) if (found := self._found(kind)) else 0.0 for kind in COPY_KINDS}

    @property
    def false_verified(self) -> int:
        """Nearest distinct images and colour variants verified as copies."""
        return sum(self._verified(self.distinct_checks)) + sum(self._verified(self.variant_checks))

    @property
    def distinct_checked(self) -> int:
        """Distinct pairs and colour variants the sample compared."""
        return len(self.distinct_checks) + len(self.variant_checks)

    @property
    def false_rate(self) -> float:
        """The share of distinct pairs the rules verify, as (k + 0.5) / (n + 1) over the sample's distinct pairs and
        colour variants (Jeffreys' estimate: never 0 from a finite sample, so it bounds what the sample can tell)."""
        return (self.false_verified + 0.5) / (self.distinct_checked + 1)

    def precision(self, verified_share: float) -> float:
        """The estimated chance that a verified pair is a copy, where ``verified_share`` of the candidate pairs were
        verified: Bayes' rule over the planted copies' recall R and ``false_rate`` f, with the share of candidates
        that are copies read back from what was verified, (verified share - f) / (R - f)."""
        recall, false = max(self.copy_recall, 1e-6), self.false_rate
        prior = (verified_share - false) / (recall - false) if recall > false else 0.0
        prior = min(max(prior, 1e-6), 1.0)
        true = recall * prior
        return float(true / (true + false * (1.0 - prior)))

    @property
    def warning(self) -> str | None:
        """What people should know before trusting the groups; None when the sample verified well."""
        problems = []
        if self.copy_recall < 0.9:
            kinds = ", ".join(f"{kind} {value:.0%}" for kind, value in self.recall_by_kind().items())
            problems.append(f"only {self.copy_recall:.0%} of the copies planted of {self.images} gallery images were "
                            f"found and verified ({kinds}): images too small or too plain for local features are "
                            "missed")
        if self.false_verified:
            problems.append(f"{self.false_verified} of {self.distinct_checked} distinct pairs of the sample (nearest "
                            "distinct images, colour variants) were verified as copies: look at each group before "
                            "removing any")
        return "; ".join(problems) or None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (without the comparisons)."""
        all_cosines = [c for kind in COPY_KINDS for c in self.copy_cosines[kind]]
        return {"method": "candidates above a loose cosine, each pair verified by local features under one "
                          "transform, aligned content and colour",
                "candidate_cosine": round(self.candidate_cosine, 4), "rules": self.rules.to_dict(),
                "images": self.images, "copies": len(all_cosines), "copy_recall": round(self.copy_recall, 4),
                "recall_by_kind": {k: round(v, 4) for k, v in self.recall_by_kind().items()},
                "distinct_pairs": len(self.distinct_checks), "colour_variants": len(self.variant_checks),
                "false_verified": self.false_verified, "labels_used": self.labels_used, "warning": self.warning,
                "shade_variants": len(self.shade_checks),
                "shade_variants_verified": sum(self._verified(self.shade_checks))}


def _candidate_cosine(cosines: Sequence[float]) -> float:
    if not len(cosines):
        return MIN_CANDIDATE_COSINE
    floor = float(np.quantile(np.asarray(cosines, dtype=np.float64), 1 - CANDIDATE_RECALL)) - CANDIDATE_SLACK
    return float(round(min(1.0, max(MIN_CANDIDATE_COSINE, floor)), 4))


def distinct_neighbours(graph: NeighbourGraph, row: int, label_of: Mapping[int, str] | None = None,
                        count: int = DISTINCT_PER_IMAGE) -> list[int]:
    """Up to ``count`` nearest images of row ``row`` that are distinct from it: of another label where labels are
    known, else its neighbours past its leading copies (up to ``MAX_OWN_COPIES`` standing ``ISOLATION_GAP`` above
    the rest)."""
    present = graph.neighbours[row] >= 0
    ids, scores = graph.neighbours[row][present], graph.scores[row][present].astype(np.float64)
    if label_of:
        own = label_of.get(int(graph.ids[row]))
        if own is not None:
            return [int(i) for i in ids if label_of.get(int(i)) not in (None, own)][:count]
    start = 0
    for position in range(min(MAX_OWN_COPIES, len(scores) - 1)):
        if scores[position] - scores[position + 1] >= ISOLATION_GAP:
            start = position + 1
            break
    return [int(i) for i in ids[start:start + count]]


def calibrate_verification(index: Index, graph: NeighbourGraph, load: Callable[[int], Image.Image | None],
                           embedder: ImageEmbedder, sample: int = VERIFY_SAMPLE, seed: int = 0,
                           workers: int = 2) -> VerificationCalibration:
    """The candidate cosine and the rules from copies planted of a seeded ``sample`` of the graph's images against
    their colour variants and nearest distinct images (``load(id)``: an image's picture, None if unreadable now)."""
    sample = check_sample(sample)
    if isinstance(embedder, NoModel):
        raise ParameterError("threshold", "auto embeds copies it plants of gallery images with the index's model to "
                                          "calibrate the verification, and this index was built from embeddings: it "
                                          "has none; give `threshold` a cosine instead, e.g. 0.95")
    background = tuple(embedder.preprocessing.background)
    label_of = dict(index.catalogue.labelled())
    checks: dict[str, list[PairComparison]] = {kind: [] for kind in (*COPY_KINDS, "variant", "shade", "distinct")}
    copy_cosines: dict[str, list[float]] = {kind: [] for kind in COPY_KINDS}

    def compare_with(job: tuple[int, int, Image.Image, dict[str, Image.Image]]) -> list[tuple[str, PairComparison]]:
        """A sample image against its copies, its colour variant and its nearest distinct images."""
        n, row, image, planted = job
        try:
            own = image_features(image, background)
            others: list[tuple[str, Image.Image | None]] = [
                *planted.items(), ("variant", plant_colour_variant(image, seed + n, background)),
                ("shade", plant_shade_variant(image, background))]
            others += [("distinct", load(other)) for other in distinct_neighbours(graph, row, label_of)]
            return [(kind, compare_pair(own, image_features(other, background))) for kind, other in others
                    if other is not None]
        except Exception:  # noqa: BLE001  (an odd image counts as copies missed, not the end of the calibration)
            return [(kind, PairComparison(0, 0)) for kind in planted]

    def calibrate_chunk(chunk: list[tuple[int, Image.Image]], first_number: int, pool: ThreadPoolExecutor) -> int:
        """Embed and compare one chunk of sample images; how many were used (a writer may have removed some)."""
        ids, vectors = stored_vectors(index, graph.ids[[row for row, _ in chunk]])
        vector_of = {int(i): v for i, v in zip(ids.tolist(), vectors, strict=True)}
        chunk = [(row, image) for row, image in chunk if int(graph.ids[row]) in vector_of]
        if not chunk:
            return 0
        planted = [plant_copies(image, COPY_KINDS, seed + first_number + n, background)
                   for n, (_, image) in enumerate(chunk)]
        embedded = embed_images(embedder, [copy for kinds in planted for copy in kinds.values()])
        originals = np.stack([vector_of[int(graph.ids[row])] for row, _ in chunk])
        cosines = np.einsum("ij,ij->i", embedded, np.repeat(originals, len(COPY_KINDS), axis=0))
        for position, kind in enumerate(COPY_KINDS):
            copy_cosines[kind] += cosines[position::len(COPY_KINDS)].tolist()
        jobs = [(first_number + n, row, image, planted[n]) for n, (row, image) in enumerate(chunk)]
        for compared in pool.map(compare_with, jobs):
            for kind, comparison in compared:
                checks[kind].append(comparison)
        return len(chunk)

    # a chunk of images at a time, each at most SOURCE_SIDE a side: memory stays that of a chunk, whatever the sample
    order = np.random.default_rng(seed).permutation(len(graph.ids))[:2 * sample]
    used, chunk = 0, []
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for row in order:  # an unreadable file is passed over: at most 2 x sample files are tried
            image = load(int(graph.ids[row]))
            if image is not None:
                image.thumbnail((SOURCE_SIDE, SOURCE_SIDE))
                chunk.append((int(row), image))
            if len(chunk) == CALIBRATION_CHUNK or (chunk and used + len(chunk) >= sample):
                used += calibrate_chunk(chunk, used, pool)
                chunk = []
            if used >= sample:
                break
        if chunk:
            used += calibrate_chunk(chunk, used, pool)
    if used < 2:
        raise ParameterError("threshold", "copy verification needs at least 2 readable gallery images, still indexed, "
                                          "to plant copies of; run it again, or give `threshold` a cosine instead, "
                                          "e.g. 0.95")
    copy_checks = {kind: checks[kind] for kind in COPY_KINDS}
    rules = choose_rules([c for kind in COPY_KINDS for c in checks[kind]], checks["distinct"], checks["variant"],
                         checks["shade"])
    all_cosines = [c for kind in COPY_KINDS for c in copy_cosines[kind]]
    return VerificationCalibration(_candidate_cosine(all_cosines), rules, used, copy_cosines, copy_checks,
                                   checks["variant"], checks["distinct"], bool(label_of), checks["shade"])


def group_precision(group: CopyGroup, calibration: VerificationCalibration, verified_share: float) -> float:
    """The estimated chance that every member of ``group`` is a copy of its first image: the verified pairs'
    ``precision``, once for each of its pairs."""
    return calibration.precision(verified_share) ** len(group.pairs)
