"""Near-duplicates verified as copies: candidate pairs from the embedding, each checked by ``copy_check``, and groups
that do not chain. The rules are calibrated by ``copy_calibration``.

- ``CopyRules``: what makes a compared pair a copy (features agreeing, aligned content, colour).
- ``verify_pairs``: each candidate pair compared on ``workers`` threads (``bounded_map``: OpenCV and NumPy release
  the GIL), each image's features computed once while cached (``FeatureCache``); a progress bar; Ctrl-C or
  ``MAX_PAIRS`` stops it and what was checked is kept (``Verification.complete`` False).
- ``copy_groups``: an image joins a group only if it is verified against the group's first image (the one kept by
  the removal proposed: with ``keep``, its most detailed member), and two images whose colours differ never share a
  group: verified pairs never chain two distinct images together; the comparisons with the first are made in
  batches on the verification's workers, Ctrl-C stopping them within a comparison.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from retrieval.errors import ParameterError
from retrieval.index.curation.copy_check import ImageFeatures, PairComparison, compare_pair, image_features
from retrieval.index.curation.linked_groups import UnionFind
from retrieval.utils.bounded_map import bounded_map
from retrieval.utils.progress import progress_bar

MIN_INLIERS = 4  # features agreeing under the transform, at least (a similarity is fitted from 2)
# fewer features than this agreeing is weak evidence (two 8 px digits or 28 px shirts of one kind align by 4-6): the
# content must then correlate halfway from the cut to 1
FEW_INLIERS = 8
MIN_OVERLAP = 0.25  # share of the smaller image the aligned other covers, at least
FEATURE_CACHE = 256  # images whose features are kept (3.4 MB each at most: a 512 px source and three levels)
MAX_PAIRS = 5_000_000  # candidate pairs verified at most (bounds the job: docs/BENCHMARKS.md, copy verification)
MAX_EXTRA_CHECKS = 20_000  # pairs compared to form groups beyond the candidates (images linked only through others)
COLOURS_DIFFER = "colours differ"  # aligned, alike in content, another colour: two products, never one group
NOT_CANDIDATES = "less alike than the candidates: not compared"  # an extra check a group check passed over


# --- the rules
@dataclass(frozen=True)
class CopyRules:
    """What makes a compared pair a copy: ``MIN_INLIERS`` features agreeing under one transform over at least
    ``MIN_OVERLAP`` of the smaller image, the aligned grey levels correlating at ``correlation`` or more (halfway from
    it to 1 where fewer than ``FEW_INLIERS`` features agree), their
    colours at most ``colour_mismatch`` degrees of hue apart (``copy_check.colour_difference``) and their strength at
    most ``shade`` apart (``copy_check.shade_difference``: a darker shade of one hue is another product)."""

    correlation: float = 0.9
    colour_mismatch: float = 12.0
    min_inliers: int = MIN_INLIERS
    shade: float = 0.45

    def reason(self, comparison: PairComparison) -> str | None:
        """Why the pair is not a copy, in a few words; None when it is one."""
        if comparison.inliers < self.min_inliers:
            return "no geometric agreement"
        if comparison.scale is None or comparison.overlap < MIN_OVERLAP:
            return "no plausible alignment"
        needed = self.correlation if comparison.inliers >= FEW_INLIERS else (1 + self.correlation) / 2
        if comparison.correlation < needed:
            return "content differs"
        if comparison.colour_mismatch > self.colour_mismatch or comparison.shade > self.shade:
            return COLOURS_DIFFER
        return None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form."""
        return {"min_inliers": self.min_inliers, "min_overlap": MIN_OVERLAP,
                "correlation": round(self.correlation, 4), "colour_mismatch": round(self.colour_mismatch, 4),
                "shade": round(self.shade, 4)}


# --- verifying candidate pairs
@dataclass(frozen=True)
class CheckedPair:
    """A candidate pair (``first`` < ``second`` ids), its cosine, what the comparison measured (None: an image could
    not be read or compared) and why it is not a copy (None: verified)."""

    first: int
    second: int
    cosine: float
    comparison: PairComparison | None
    reason: str | None

    @property
    def verified(self) -> bool:
        """Whether the pair is a copy."""
        return self.reason is None


@dataclass
class Verification:
    """The pairs checked, and whether every candidate was (``complete`` False: stopped, by Ctrl-C or ``MAX_PAIRS``)."""

    pairs: list[CheckedPair]
    candidates: int
    seconds: float
    complete: bool = True
    stopped_because: str | None = None
    interrupted: bool = False  # stopped by Ctrl-C (the command then exits 130 after listing what was verified)

    @property
    def pairs_per_second(self) -> float:
        """Pairs checked per second of wall clock."""
        return len(self.pairs) / self.seconds if self.seconds > 0 else 0.0


class FeatureCache:
    """Each image's features, computed once while among the last ``size`` used (thread-safe; None: unreadable)."""

    def __init__(self, load: Callable[[int], Image.Image | None], background: Sequence[int],
                 size: int = FEATURE_CACHE) -> None:
        self.load, self.background, self.size = load, tuple(background), size
        self._kept: OrderedDict[int, ImageFeatures | None] = OrderedDict()
        self._running: dict[int, threading.Event] = {}  # images being computed, each by one thread
        self._lock = threading.Lock()
        self.computed = 0
        self.sides: dict[int, int] = {}  # each image's longer side as loaded (which of a group's copies is kept)

    def get(self, image_id: int) -> ImageFeatures | None:
        """The features of ``image_id``: cached, being computed by another thread (waited for), or computed now."""
        while True:
            with self._lock:
                if image_id in self._kept:
                    self._kept.move_to_end(image_id)
                    return self._kept[image_id]
                running = self._running.get(image_id)
                if running is None:
                    running = self._running[image_id] = threading.Event()
                    break
            running.wait()  # another thread computes it: read what it kept (again if evicted meanwhile)
        try:
            picture = self.load(image_id)
            features = None if picture is None else image_features(picture, self.background)
            with self._lock:
                self.computed += 1
                if picture is not None:
                    self.sides[image_id] = max(picture.size)
                self._kept[image_id] = features
                while len(self._kept) > self.size:
                    self._kept.popitem(last=False)
            return features
        finally:
            with self._lock:
                del self._running[image_id]
            running.set()


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
        return compared(features, rules, int(first[position]), int(second[position]), float(cosines[position]))

    stopped = None if limit == total else f"the first {limit:,} of {total:,} candidate pairs (at most {max_pairs:,})"
    bar = progress_bar(total=limit, desc="verifying pairs", unit="pair", disable=not progress)
    interrupted = False

    def keep(position: int, pair: CheckedPair) -> None:
        results[position] = pair
        bar.update(1)

    try:
        # at most 4 pairs a worker in flight, the main thread awake however long a pair takes: Ctrl-C is answered
        # within the pairs running (those that finished kept), never after the batch
        workers = max(1, workers)
        bounded_map(check, order[:limit].tolist(), keep, workers, in_flight=4 * workers)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
    if interrupted:
        stopped = f"stopped by Ctrl-C after {len(results):,} of {total:,} candidate pairs"
    pairs = [results[p] for p in sorted(results)]
    return Verification(pairs, total, time.perf_counter() - started, stopped is None, stopped, interrupted)


# --- groups
@dataclass(frozen=True)
class CopyGroup:
    """A verified group: ``ids`` the first (the one kept) then the others ascending; ``pairs`` each of the others
    checked against the first, in that order; ``unconfirmed``: members listed but never proposed for removal (not
    compared with every other member: two of them may be colour variants, both copies of the first)."""

    ids: np.ndarray
    pairs: list[CheckedPair]
    unconfirmed: frozenset[int] = frozenset()

    @property
    def removable(self) -> list[int]:
        """The members proposed for removal: all but the first and the unconfirmed ones."""
        return [int(i) for i in self.ids[1:] if int(i) not in self.unconfirmed]


# ``check(first, second)``: the pairs (first[i] < second[i]) compared to form groups, as ``verify_pairs`` compares
# candidates (on its workers, Ctrl-C keeping what finished: ``interrupted``)
GroupCheck = Callable[[np.ndarray, np.ndarray], Verification]
# ``keep(first, joined)``: the member a group keeps, of its first and the images verified against it (with the pairs)
GroupKeep = Callable[[int, Sequence[tuple[int, CheckedPair]]], int]


def copy_groups(pairs: Sequence[CheckedPair], check: GroupCheck | None = None,
                max_checks: int = MAX_EXTRA_CHECKS, cross_check: bool = False,
                keep: GroupKeep | None = None, check_kept: GroupCheck | None = None) -> list[CopyGroup]:
    """Groups in which every member is verified against the group's first image and no two members' colours
    differ. Verified pairs are joined (union-find) into sets; in each set the image verified against the most others
    not yet placed (an original rather than one of its crops, which are verified against it but seldom against each
    other), the lowest id among equals, is a group's first (the one kept) and takes every other image verified
    against it: a pair checked already, or one compared by ``check`` (the extra comparisons of a round, in one batch)
    where the two were linked only through others; the rest are grouped again the same way. A dense set (copies of
    one picture, each linked to a few of the others) is thus one group after one round.

    Two members found to differ in colour (``COLOURS_DIFFER``: by a pair checked already, or with ``cross_check`` by
    comparing the members with each other) are two products: the first lies between them (a copy of one whose
    colours drifted towards the other), so the member nearest its colours becomes the first instead and takes the
    images verified against it; a member that still differs in colour from one nearer the first is left for a group
    of its own. Extra checks go to the smaller sets first and stop after ``max_checks`` or at Ctrl-C (the groups then
    come from the pairs checked).

    ``keep(first, joined)``: where given, the group keeps (puts first) the member it names (the most detailed: an
    original rather than its downscaled, cropped or re-encoded copies, which may be verified against more others)
    and holds the members verified against that one (compared by ``check_kept``, default ``check``, where they were
    not yet, or where ``check`` passed over them as ``NOT_CANDIDATES``); the others are grouped again.

    Members are compared with each other lazily, at most the checks left (never every pair of a large group); a
    member not compared with every other (no check left, or passed over) is ``unconfirmed``: listed, never proposed
    for removal, since two such may be colour variants that are both copies of the first."""
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
    known: dict[tuple[int, int], CheckedPair] = {}
    # per image: the images it was compared with, and those whose colours differ from its own (a group's members are
    # looked up through these, never through every pair of members)
    compared_with: dict[int, set[int]] = {}
    differ: dict[int, set[int]] = {}

    def learn(found: Iterable[CheckedPair]) -> None:
        for p in found:
            known[(p.first, p.second)] = p
            if p.comparison is not None and p.reason != NOT_CANDIDATES:
                compared_with.setdefault(p.first, set()).add(p.second)
                compared_with.setdefault(p.second, set()).add(p.first)
            if p.reason == COLOURS_DIFFER:
                differ.setdefault(p.first, set()).add(p.second)
                differ.setdefault(p.second, set()).add(p.first)

    learn(pairs)
    budget = {"left": max_checks if check is not None else 0}

    def compare_missing(keys: Iterable[tuple[int, int]], kept: bool = False) -> None:
        """The pairs (lower id first, produced lazily) not checked yet, compared in one batch: at most the budget
        left is drawn from ``keys``; ``kept``: with ``check_kept``, the ones ``check`` passed over too."""
        comparing = (check_kept or check) if kept else check
        if comparing is None or budget["left"] <= 0:
            return
        missing = list(itertools.islice(_unique(key for key in keys if key not in known or (
            kept and known[key].reason == NOT_CANDIDATES)), budget["left"]))
        if not missing:
            return
        budget["left"] -= len(missing)
        try:
            result = comparing(np.asarray([a for a, _ in missing], np.int64),
                               np.asarray([b for _, b in missing], np.int64))
        except KeyboardInterrupt:
            budget["left"] = 0  # no more extra checks: what is known groups
            return
        learn(result.pairs)
        if result.interrupted:
            budget["left"] = 0

    neighbours: dict[int, set[int]] = {}
    for p in verified:
        neighbours.setdefault(p.first, set()).add(p.second)
        neighbours.setdefault(p.second, set()).add(p.first)

    def joining(head: int, rest: set[int]) -> list[tuple[int, CheckedPair]]:
        """The images of ``rest`` verified against ``head`` (compared now where they were not yet), by id."""
        if budget["left"] > 0:
            others = sorted(rest - {head})
            compare_missing((min(head, o), max(head, o)) for o in others)
        else:  # no check left: only the images verified against it can join
            others = sorted(neighbours[head] & rest)
        return [(other, pair) for other in others
                if (pair := known.get((min(head, other), max(head, other)))) is not None and pair.verified]

    def clashing(joined: list[tuple[int, CheckedPair]]) -> set[tuple[int, int]]:
        """The pairs of ``joined`` whose colours differ (the members compared with each other first, if asked)."""
        ids = [i for i, _ in joined]  # ascending
        if cross_check and budget["left"] > 0:
            compare_missing(itertools.combinations(ids, 2))  # drawn lazily, at most the budget
        members = set(ids)
        return {(a, b) for a in ids for b in differ.get(a, ()) if a < b and b in members}

    def unconfirmed(joined: list[tuple[int, CheckedPair]]) -> frozenset[int]:
        """The members of ``joined`` not compared with every other: never proposed for removal."""
        members = {i for i, _ in joined}
        return frozenset(i for i in members
                         if sum(o in members for o in compared_with.get(i, ())) < len(members) - 1)

    groups = []
    # the smaller sets first: one large set of lookalikes does not spend the checks the many small ones need
    for ids in sorted(members.values(), key=len):
        rest = set(ids)
        # each image's verified links to images not placed yet, in a heap (most first, the lowest id among equals;
        # outdated entries skipped): a round costs its first's links, not a pass over every image left
        links = {i: len(neighbours[i]) for i in ids}
        heap = [(-links[i], i) for i in ids]
        heapq.heapify(heap)
        while len(rest) > 1 and heap:
            count, head = heapq.heappop(heap)
            if head not in rest or -count != links[head]:
                continue
            joined = joining(head, rest)
            if not joined:  # nothing verified against the best linked image: none is against another either
                break
            clashes = clashing(joined)
            if clashes:  # the head lies between two products: the one nearest its colours is kept instead
                popped = head
                head = min({i for key in clashes for i in key}, key=lambda i: (_colour_apart(dict(joined)[i]), i))
                joined = joining(head, rest)
                clashes = clashing(joined)
                heapq.heappush(heap, (-links[popped], popped))  # in case it does not join the new first
            joined = _without_clashes(joined, clashes)
            if keep is not None:
                head, joined = _kept_first(head, joined, keep(head, joined), compare_missing, known)
            groups.append(CopyGroup(np.asarray([head, *(i for i, _ in joined)], np.int64), [p for _, p in joined],
                                    unconfirmed(joined)))
            for placed in (head, *(i for i, _ in joined)):
                rest.discard(placed)
                for other in neighbours[placed] & rest:
                    links[other] -= 1
                    heapq.heappush(heap, (-links[other], other))
    return sorted(groups, key=lambda g: (-len(g.ids), int(g.ids[0])))


def _kept_first(head: int, joined: list[tuple[int, CheckedPair]], kept: int,
                compare_missing: Callable[[Iterable[tuple[int, int]], bool], None],
                known: dict[tuple[int, int], CheckedPair]) -> tuple[int, list[tuple[int, CheckedPair]]]:
    """The group (``head`` and ``joined``) around its member ``kept``: that member first, with the members verified
    against it (compared now where they were not yet, within the budget). The kept member is verified against
    ``head``, so ``head`` stays; one verified against ``head`` alone is left out (grouped again)."""
    members = [head, *(i for i, _ in joined)]
    if kept == head or kept not in members:
        return head, joined
    keys = {other: (min(kept, other), max(kept, other)) for other in sorted(members) if other != kept}
    compare_missing(list(keys.values()), True)
    return kept, [(other, pair) for other, key in keys.items()
                  if (pair := known.get(key)) is not None and pair.verified]


def _unique(keys: Iterable[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """``keys`` without repeats, lazily (only the keys drawn are remembered)."""
    seen: set[tuple[int, int]] = set()
    for key in keys:
        if key not in seen:
            seen.add(key)
            yield key


def _colour_apart(pair: CheckedPair) -> float:
    return pair.comparison.colour_mismatch if pair.comparison is not None else math.inf


def _without_clashes(joined: list[tuple[int, CheckedPair]],
                     clashes: set[tuple[int, int]]) -> list[tuple[int, CheckedPair]]:
    """``joined`` (by id) less each member whose colours differ from a member nearer the first's colours."""
    apart: dict[int, set[int]] = {}  # each member's clashes: a member costs its own, not a pass over those kept
    for a, b in clashes:
        apart.setdefault(a, set()).add(b)
        apart.setdefault(b, set()).add(a)
    kept: set[int] = set()
    for other, _ in sorted(joined, key=lambda j: (_colour_apart(j[1]), j[0])):
        if not apart.get(other, set()) & kept:
            kept.add(other)
    return [(other, pair) for other, pair in joined if other in kept]


def compared(features: FeatureCache, rules: CopyRules, a: int, b: int, cosine: float) -> CheckedPair:
    """Pair (``a``, ``b``) compared now; an image that cannot be read or compared makes the pair's reason, never an
    error (one odd image must not stop the job)."""
    try:
        fa, fb = features.get(a), features.get(b)
        if fa is None or fb is None:
            return CheckedPair(a, b, cosine, None, "unreadable image")
        comparison = compare_pair(fa, fb)
    except Exception as exc:  # noqa: BLE001  (the pair says why)
        return CheckedPair(a, b, cosine, None, f"could not be compared ({type(exc).__name__})")
    return CheckedPair(a, b, cosine, comparison, rules.reason(comparison))


def check_workers(workers: int) -> int:
    """``workers`` as an int within [1, 64], else a ParameterError."""
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or not 1 <= workers <= 64:
        raise ParameterError("workers", f"must be a whole number of threads between 1 and 64, got {workers!r}")
    return int(workers)
