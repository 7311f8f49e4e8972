"""Near-duplicates verified as copies: candidates from the embedding, each pair checked by ``copy_check``.

1. Calibration (``calibrate_verification``): for a seeded sample of gallery images, copies are planted as people
   make them (``plant_copies``: resized, re-encoded, cropped, brightened, slightly turned) and one colour variant
   (``plant_colour_variant``: its hues turned, a distinct product). The candidate cosine is the one
   ``CANDIDATE_RECALL`` of the planted copies reach under the index's model, less ``MARGIN`` (loose on purpose: it
   only chooses which pairs are checked). Each sample image is compared with its copies (the positives), its colour
   variant and its nearest distinct images in the index (``distinct_neighbours``: of another label, or past its own
   copies); the aligned-correlation and colour cuts are put between them (``choose_rules``).
2. Verification (``verify_pairs``): each candidate pair compared (``compare_pair``) on ``workers`` threads (OpenCV
   and NumPy release the GIL), each image's features computed once while cached; a progress bar; Ctrl-C stops it
   and what was checked is kept (``Verification.complete`` False).
3. Groups (``copy_groups``): an image joins a group only if it is verified against the group's first image (the
   lowest id, kept by the removal proposed): verified pairs never chain two distinct images together.
"""

from __future__ import annotations

import io
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image, ImageEnhance

from retrieval.data.colour import DEFAULT_BACKGROUND, flatten_alpha
from retrieval.errors import ParameterError
from retrieval.index.curation.copy_check import ImageFeatures, PairComparison, compare_pair, image_features
from retrieval.index.curation.duplicates_threshold import ISOLATION_GAP, MAX_OWN_COPIES, check_sample, embed_images
from retrieval.index.curation.neighbour_graph import NeighbourGraph, stored_vectors
from retrieval.index.query_embedder import ImageEmbedder, NoModel
from retrieval.index.search import Index
from retrieval.utils.progress import progress_bar

COPY_KINDS = ("resized", "jpeg", "cropped", "brightness", "rotated")
CANDIDATE_RECALL = 0.99  # share of the planted copies the candidate cosine keeps
MARGIN = 0.05  # taken off the candidate cosine: copies harsher than the planted ones score lower
MIN_CANDIDATE_COSINE = 0.5  # never lower: below, a k-neighbour graph holds mostly unrelated pairs
MIN_INLIERS = 4  # features agreeing under the transform, at least (a similarity is fitted from 2)
MIN_OVERLAP = 0.25  # share of the smaller image the aligned other covers, at least
COPY_RECALL = 0.95  # the correlation cut keeps this share of the planted copies that pass the other tests
# the cuts are never looser than these (a sample of a few images must not open them wide) nor stricter than the
# tight ones (a sample whose distinct images correlate highly must not close them)
LOOSE_CORRELATION, TIGHT_CORRELATION = 0.80, 0.97
CORRELATION_MARGIN = 0.03  # the correlation cut sits this far below the planted copies' floor
LOOSE_COLOUR, TIGHT_COLOUR = 20.0, 6.0  # degrees of hue (copy_check.colour_difference)
DISTINCT_PER_IMAGE = 2  # nearest distinct images compared per sample image
FEATURE_CACHE = 256  # images whose features are kept (about 2 MB each at most)
MAX_PAIRS = 5_000_000  # candidate pairs verified at most (bounds the job: docs/BENCHMARKS.md, copy verification)


# --- planted copies and colour variants
def plant_copies(image: Image.Image, seed: int = 0,
                 background: Sequence[int] = DEFAULT_BACKGROUND) -> dict[str, Image.Image]:
    """Five copies of ``image`` as people make them: resized (half the size), re-encoded (JPEG at quality 35),
    cropped (80 % of each side at a seeded offset), brightened (x1.25, contrast x0.85) and turned (3 to 8 degrees
    either way, corners filled with ``background``). Transparent pixels are first put on ``background``."""
    rng = np.random.default_rng(seed)
    rgb = flatten_alpha(image, background).convert("RGB")
    width, height = rgb.size
    resized = rgb.resize((max(8, width // 2), max(8, height // 2)), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    rgb.save(buffer, format="JPEG", quality=35)
    jpeg = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    crop_w, crop_h = max(1, round(width * 0.8)), max(1, round(height * 0.8))
    left, top = int(rng.integers(0, width - crop_w + 1)), int(rng.integers(0, height - crop_h + 1))
    cropped = rgb.crop((left, top, left + crop_w, top + crop_h))
    brightness = ImageEnhance.Contrast(ImageEnhance.Brightness(rgb).enhance(1.25)).enhance(0.85)
    angle = float(rng.uniform(3, 8) * rng.choice([-1, 1]))
    rotated = rgb.rotate(angle, resample=Image.Resampling.BICUBIC, expand=True, fillcolor=tuple(background))
    return {"resized": resized, "jpeg": jpeg, "cropped": cropped, "brightness": brightness, "rotated": rotated}


def plant_colour_variant(image: Image.Image, seed: int = 0,
                         background: Sequence[int] = DEFAULT_BACKGROUND) -> Image.Image:
    """``image`` with its hues turned by a seeded 25 to 60 degrees either way (red to orange, blue to violet) and
    its grey parts tinted: the same product in a near colour, which is not a copy."""
    rng = np.random.default_rng(seed)
    rgb = flatten_alpha(image, background).convert("RGB")
    hsv = np.asarray(rgb.convert("HSV")).copy()
    shift = int(rng.integers(18, 43)) * int(rng.choice([-1, 1]))  # of 256: 25 to 60 degrees
    hsv[..., 0] = (hsv[..., 0].astype(np.int64) + shift) % 256
    # grey pixels have no hue to turn: give the not-quite-white ones a colour of their own
    grey = (hsv[..., 1] < 40) & (hsv[..., 2] < 235)
    hsv[..., 1] = np.where(grey, 160, hsv[..., 1])
    hsv[..., 0] = np.where(grey, (shift * 3) % 256, hsv[..., 0])
    return Image.fromarray(hsv, "HSV").convert("RGB")


# --- the rules
@dataclass(frozen=True)
class CopyRules:
    """What makes a compared pair a copy: ``MIN_INLIERS`` features agreeing under one transform over at least
    ``MIN_OVERLAP`` of the smaller image, the aligned grey levels correlating at ``correlation`` or more, and their
    colours at most ``colour_mismatch`` degrees of hue apart (``copy_check.colour_difference``)."""

    correlation: float = 0.9
    colour_mismatch: float = 12.0
    min_inliers: int = MIN_INLIERS

    def reason(self, comparison: PairComparison) -> str | None:
        """Why the pair is not a copy, in a few words; None when it is one."""
        if comparison.inliers < self.min_inliers:
            return "no geometric agreement"
        if comparison.scale is None or comparison.overlap < MIN_OVERLAP:
            return "no plausible alignment"
        if comparison.correlation < self.correlation:
            return "content differs"
        if comparison.colour_mismatch > self.colour_mismatch:
            return "colours differ"
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"min_inliers": self.min_inliers, "min_overlap": MIN_OVERLAP,
                "correlation": round(self.correlation, 4), "colour_mismatch": round(self.colour_mismatch, 4)}


def choose_rules(copies: Sequence[PairComparison], distinct: Sequence[PairComparison],
                 variants: Sequence[PairComparison]) -> CopyRules:
    """The correlation cut ``CORRELATION_MARGIN`` below the floor of the planted copies that pass the geometric tests
    (the correlation ``COPY_RECALL`` of them reach), or just above the distinct pairs that pass them where one reaches
    higher; the colour
    cut halfway between the copies' mismatch (its ``COPY_RECALL`` quantile) and the colour variants' (their lowest);
    each kept within [tight, loose]."""
    geometric = CopyRules(correlation=-1.0, colour_mismatch=math.inf)  # the geometric tests alone
    passing = [c.correlation for c in copies if geometric.reason(c) is None]
    floor = float(np.quantile(passing, 1 - COPY_RECALL)) if passing else TIGHT_CORRELATION
    against = [c.correlation for c in distinct if geometric.reason(c) is None]
    ceiling = max(against) if against else -1.0
    # the copies are known, the distinct pairs that align are few in a sample (flags that share a canton, two alike
    # silhouettes): the cut stays near the copies' floor unless the distinct ones reach above it
    correlation = max(floor - CORRELATION_MARGIN, ceiling + 0.01)
    correlation = float(min(TIGHT_CORRELATION, max(LOOSE_CORRELATION, correlation)))
    copy_colour = [c.colour_mismatch for c in copies if geometric.reason(c) is None]
    variant_colour = [c.colour_mismatch for c in variants if geometric.reason(c) is None and c.coloured_pixels]
    high = float(np.quantile(copy_colour, COPY_RECALL)) if copy_colour else TIGHT_COLOUR
    low = min(variant_colour) if variant_colour else LOOSE_COLOUR
    colour = (high + low) / 2 if low > high else high
    colour = float(min(LOOSE_COLOUR, max(TIGHT_COLOUR, colour)))
    return CopyRules(round(correlation, 4), round(colour, 4))


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

    def _verified(self, checks: Iterable[PairComparison]) -> list[bool]:
        return [self.rules.reason(c) is None for c in checks]

    @property
    def copy_recall(self) -> float:
        """Share of the planted copies that are candidates and verified."""
        found = [cos >= self.candidate_cosine and ok for kind in COPY_KINDS for cos, ok in
                 zip(self.copy_cosines[kind], self._verified(self.copy_checks[kind]), strict=True)]
        return float(np.mean(found)) if found else 0.0

    def recall_by_kind(self) -> dict[str, float]:
        return {kind: float(np.mean([cos >= self.candidate_cosine and ok for cos, ok in
                                     zip(self.copy_cosines[kind], self._verified(self.copy_checks[kind]),
                                         strict=True)])) if self.copy_cosines[kind] else 0.0
                for kind in COPY_KINDS}

    @property
    def false_verified(self) -> int:
        """Nearest distinct images and colour variants verified as copies."""
        return sum(self._verified(self.distinct_checks)) + sum(self._verified(self.variant_checks))

    @property
    def distinct_checked(self) -> int:
        return len(self.distinct_checks) + len(self.variant_checks)

    @property
    def false_rate(self) -> float:
        """The share of distinct pairs the rules verify, as (k + 0.5) / (n + 1) over the sample's distinct pairs and
        colour variants (Jeffreys' estimate: never 0 from a finite sample, so it bounds what the sample can tell)."""
        return (self.false_verified + 0.5) / (self.distinct_checked + 1)

    def precision(self, copy_share: float) -> float:
        """The estimated chance that a verified pair is a copy, among candidate pairs of which ``copy_share`` are
        copies: Bayes' rule over the planted copies' recall and ``false_rate``."""
        prior = min(max(copy_share, 1e-6), 1.0)
        true = max(self.copy_recall, 1e-6) * prior
        false = self.false_rate * (1.0 - prior)
        return float(true / (true + false))

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
        all_cosines = [c for kind in COPY_KINDS for c in self.copy_cosines[kind]]
        return {"method": "candidates above a loose cosine, each pair verified by local features under one "
                          "transform, aligned content and colour",
                "candidate_cosine": round(self.candidate_cosine, 4), "rules": self.rules.to_dict(),
                "images": self.images, "copies": len(all_cosines), "copy_recall": round(self.copy_recall, 4),
                "recall_by_kind": {k: round(v, 4) for k, v in self.recall_by_kind().items()},
                "distinct_pairs": len(self.distinct_checks), "colour_variants": len(self.variant_checks),
                "false_verified": self.false_verified, "labels_used": self.labels_used, "warning": self.warning}


def _candidate_cosine(cosines: Sequence[float]) -> float:
    if not len(cosines):
        return MIN_CANDIDATE_COSINE
    floor = float(np.quantile(np.asarray(cosines, dtype=np.float64), 1 - CANDIDATE_RECALL)) - MARGIN
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
                           embedder: ImageEmbedder, sample: int = 50, seed: int = 0,
                           workers: int = 2) -> VerificationCalibration:
    """The candidate cosine and the rules from copies planted of a seeded ``sample`` of the graph's images against
    their colour variants and nearest distinct images (``load(id)``: an image's picture, None if unreadable now)."""
    sample = check_sample(sample)
    if isinstance(embedder, NoModel):
        raise ParameterError("threshold", "copies are verified by planting some with the index's model, and this "
                                          "index was built from embeddings: it has none; give `threshold` a cosine "
                                          "instead, e.g. 0.95")
    background = tuple(embedder.preprocessing.background)
    order = np.random.default_rng(seed).permutation(len(graph.ids))[:2 * sample]
    chosen: list[tuple[int, Image.Image]] = []
    for row in order:
        image = load(int(graph.ids[row]))
        if image is not None:
            image.thumbnail((1024, 1024))
            chosen.append((int(row), image))
        if len(chosen) == sample:
            break
    if len(chosen) < 2:
        raise ParameterError("threshold", "copy verification needs at least 2 readable gallery images to plant "
                                          "copies of; give `threshold` a cosine instead, e.g. 0.95")
    ids, vectors = stored_vectors(index, graph.ids[[row for row, _ in chosen]])
    vector_of = {int(i): v for i, v in zip(ids.tolist(), vectors, strict=True)}
    chosen = [(row, image) for row, image in chosen if int(graph.ids[row]) in vector_of]
    planted = [plant_copies(image, seed + n, background) for n, (_, image) in enumerate(chosen)]
    embedded = embed_images(embedder, [copy for kinds in planted for copy in kinds.values()])
    originals = np.stack([vector_of[int(graph.ids[row])] for row, _ in chosen])
    cosines = np.einsum("ij,ij->i", embedded, np.repeat(originals, len(COPY_KINDS), axis=0))
    copy_cosines = {kind: cosines[position::len(COPY_KINDS)].tolist() for position, kind in enumerate(COPY_KINDS)}
    label_of = dict(index.catalogue.labelled())
    distinct_ids = {row: distinct_neighbours(graph, row, label_of) for row, _ in chosen}

    checks: dict[str, list[PairComparison]] = {kind: [] for kind in (*COPY_KINDS, "variant", "distinct")}

    def compare_with(n: int) -> list[tuple[str, PairComparison]]:
        """Sample image ``n`` against its copies, its colour variant and its nearest distinct images."""
        row, image = chosen[n]
        own = image_features(image, background)
        others: list[tuple[str, Image.Image | None]] = [*planted[n].items(),
                                                        ("variant", plant_colour_variant(image, seed + n, background))]
        others += [("distinct", load(other)) for other in distinct_ids[row]]
        return [(kind, compare_pair(own, image_features(other, background))) for kind, other in others
                if other is not None]

    with ThreadPoolExecutor(max(1, workers)) as pool:
        for compared in pool.map(compare_with, range(len(chosen))):
            for kind, comparison in compared:
                checks[kind].append(comparison)
    copy_checks = {kind: checks[kind] for kind in COPY_KINDS}
    rules = choose_rules([c for kind in COPY_KINDS for c in checks[kind]], checks["distinct"], checks["variant"])
    return VerificationCalibration(_candidate_cosine(cosines.tolist()), rules, len(chosen), copy_cosines,
                                   copy_checks, checks["variant"], checks["distinct"], bool(label_of))


# --- verifying candidate pairs
@dataclass(frozen=True)
class CheckedPair:
    """A candidate pair (``first`` < ``second`` ids), its cosine, what the comparison measured (None: an image could
    not be read) and why it is not a copy (None: verified)."""

    first: int
    second: int
    cosine: float
    comparison: PairComparison | None
    reason: str | None

    @property
    def verified(self) -> bool:
        return self.reason is None


@dataclass
class Verification:
    """The pairs checked, and whether every candidate was (``complete`` False: stopped, by Ctrl-C or ``MAX_PAIRS``)."""

    pairs: list[CheckedPair]
    candidates: int
    seconds: float
    complete: bool = True
    stopped_because: str | None = None

    @property
    def pairs_per_second(self) -> float:
        return len(self.pairs) / self.seconds if self.seconds > 0 else 0.0


class FeatureCache:
    """Each image's features, computed once while among the last ``size`` used (thread-safe; None: unreadable)."""

    def __init__(self, load: Callable[[int], Image.Image | None], background: Sequence[int],
                 size: int = FEATURE_CACHE) -> None:
        self.load, self.background, self.size = load, tuple(background), size
        self._kept: OrderedDict[int, ImageFeatures | None] = OrderedDict()
        self._lock = threading.Lock()
        self.computed = 0

    def get(self, image_id: int) -> ImageFeatures | None:
        with self._lock:
            if image_id in self._kept:
                self._kept.move_to_end(image_id)
                return self._kept[image_id]
        picture = self.load(image_id)
        features = None if picture is None else image_features(picture, self.background)
        with self._lock:
            self.computed += 1
            self._kept[image_id] = features
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)
        return features


def verify_pairs(first: np.ndarray, second: np.ndarray, cosines: np.ndarray, features: FeatureCache,
                 rules: CopyRules, workers: int = 2, progress: bool = True,
                 max_pairs: int = MAX_PAIRS) -> Verification:
    """Each pair (``first[i]``, ``second[i]``) compared on ``workers`` threads, in order of ``first`` (so that an
    image's features are reused while cached); a progress bar; Ctrl-C or ``max_pairs`` stops it with the pairs
    checked so far kept."""
    order = np.lexsort((second, first))
    total = len(order)
    limit = min(total, max_pairs)
    started = time.perf_counter()
    results: dict[int, CheckedPair] = {}

    def check(position: int) -> CheckedPair:
        a, b = int(first[position]), int(second[position])
        fa, fb = features.get(a), features.get(b)
        if fa is None or fb is None:
            return CheckedPair(a, b, float(cosines[position]), None, "unreadable image")
        comparison = compare_pair(fa, fb)
        return CheckedPair(a, b, float(cosines[position]), comparison, rules.reason(comparison))

    stopped = None if limit == total else f"the first {limit:,} of {total:,} candidate pairs (at most {max_pairs:,})"
    bar = progress_bar(total=limit, desc="verifying pairs", unit="pair", disable=not progress)
    pool = ThreadPoolExecutor(max(1, workers))
    pending: set[Future] = set()
    done: set[Future] = set()
    queue = iter(order[:limit].tolist())
    try:
        for position in queue:  # at most 4 pairs a worker in flight: Ctrl-C is answered within a few pairs
            future = pool.submit(check, position)
            future.position = position  # type: ignore[attr-defined]
            pending.add(future)
            if len(pending) >= 4 * max(1, workers):
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for finished in done:
                    results[finished.position] = finished.result()  # type: ignore[attr-defined]
                    bar.update(1)
        done, pending = wait(pending)
        for finished in done:
            results[finished.position] = finished.result()  # type: ignore[attr-defined]
            bar.update(1)
    except KeyboardInterrupt:
        for future in pending:
            future.cancel()
        # the checks that finished before or while it came are kept
        for future in pending | done:
            if future.done() and not future.cancelled() and future.exception() is None:
                results[future.position] = future.result()  # type: ignore[attr-defined]
        stopped = f"stopped by Ctrl-C after {len(results):,} of {total:,} candidate pairs"
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    pairs = [results[p] for p in sorted(results)]
    return Verification(pairs, total, time.perf_counter() - started, stopped is None, stopped)


# --- groups
@dataclass(frozen=True)
class CopyGroup:
    """A verified group: ``ids`` ascending, the first kept; ``pairs`` each member checked against the first."""

    ids: np.ndarray
    pairs: list[CheckedPair]


def copy_groups(pairs: Sequence[CheckedPair], check: Callable[[int, int], CheckedPair] | None = None,
                max_group: int = 1000) -> list[CopyGroup]:
    """Groups in which every member is verified against the group's first image. Verified pairs are joined
    (union-find) into sets; in each set, ascending, the lowest id not yet placed is a group's first and takes every
    other image verified against it: a pair checked already, or ``check(first, image)`` (an extra comparison) where
    the two were linked only through others. Sets beyond ``max_group`` images are cut without extra checks."""
    from retrieval.index.curation.linked_groups import UnionFind

    verified = [p for p in pairs if p.verified]
    if not verified:
        return []
    nodes = np.unique([i for p in verified for i in (p.first, p.second)])
    sets = UnionFind(len(nodes))
    position = {int(n): k for k, n in enumerate(nodes.tolist())}
    for p in verified:
        sets.union(position[p.first], position[p.second])
    members: dict[int, list[int]] = {}
    for node, root in zip(nodes.tolist(), sets.roots().tolist(), strict=True):
        members.setdefault(root, []).append(int(node))
    known = {(p.first, p.second): p for p in pairs}
    groups = []
    for ids in members.values():
        rest = sorted(ids)
        while len(rest) > 1:
            head, joined, left = rest[0], [], []
            for other in rest[1:]:
                pair = known.get((head, other))
                if pair is None and check is not None and len(ids) <= max_group:
                    pair = known[(head, other)] = check(head, other)
                (joined if pair is not None and pair.verified else left).append((other, pair))
            if joined:
                groups.append(CopyGroup(np.asarray([head, *(i for i, _ in joined)], np.int64),
                                        [p for _, p in joined]))
            rest = [i for i, _ in left]
    return sorted(groups, key=lambda g: (-len(g.ids), int(g.ids[0])))


def group_precision(group: CopyGroup, calibration: VerificationCalibration, copy_share: float) -> float:
    """The estimated chance that every member of ``group`` is a copy of its first image: the verified pairs'
    ``precision``, once for each of its pairs."""
    return calibration.precision(copy_share) ** len(group.pairs)


def pair_checker(features: FeatureCache, rules: CopyRules,
                 cosine: Callable[[int, int], float]) -> Callable[[int, int], CheckedPair]:
    """``check(a, b)``: one pair compared now (the extra checks of ``copy_groups``)."""
    def check(a: int, b: int) -> CheckedPair:
        fa, fb = features.get(a), features.get(b)
        if fa is None or fb is None:
            return CheckedPair(a, b, cosine(a, b), None, "unreadable image")
        comparison = compare_pair(fa, fb)
        return CheckedPair(a, b, cosine(a, b), comparison, rules.reason(comparison))

    return check


def check_workers(workers: int) -> int:
    """``workers`` as an int within [1, 64], else a ParameterError."""
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or not 1 <= workers <= 64:
        raise ParameterError("workers", f"must be a whole number of threads between 1 and 64, got {workers!r}")
    return int(workers)
