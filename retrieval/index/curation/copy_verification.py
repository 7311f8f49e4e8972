"""Near-duplicates verified as copies: candidate pairs from the embedding, each checked by ``copy_check``, and groups
that do not chain. The rules are calibrated by ``copy_calibration``.

- ``CopyRules``: what makes a compared pair a copy (features agreeing, aligned content, colour).
- ``verify_pairs``: each candidate pair compared on ``workers`` threads (OpenCV and NumPy release the GIL), each
  image's features computed once while cached (``FeatureCache``); a progress bar; Ctrl-C or ``MAX_PAIRS`` stops it
  and what was checked is kept (``Verification.complete`` False).
- ``copy_groups``: an image joins a group only if it is verified against the group's first image (the one kept by
  the removal proposed): verified pairs never chain two distinct images together; the comparisons with the first
  are made in batches on the verification's workers, Ctrl-C stopping them within a comparison.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from retrieval.errors import ParameterError
from retrieval.index.curation.copy_check import ImageFeatures, PairComparison, compare_pair, image_features
from retrieval.index.curation.linked_groups import UnionFind
from retrieval.utils.progress import progress_bar

MIN_INLIERS = 4  # features agreeing under the transform, at least (a similarity is fitted from 2)
# fewer features than this agreeing is weak evidence (two 8 px digits or 28 px shirts of one kind align by 4-6): the
# content must then correlate halfway from the cut to 1
FEW_INLIERS = 8
MIN_OVERLAP = 0.25  # share of the smaller image the aligned other covers, at least
FEATURE_CACHE = 256  # images whose features are kept (3.4 MB each at most: a 512 px source and three levels)
MAX_PAIRS = 5_000_000  # candidate pairs verified at most (bounds the job: docs/BENCHMARKS.md, copy verification)
MAX_EXTRA_CHECKS = 20_000  # pairs compared to form groups beyond the candidates (images linked only through others)
WAKE_SECONDS = 0.25  # the most the main thread waits on the pairs in flight before it looks for Ctrl-C again


# --- the rules
@dataclass(frozen=True)
class CopyRules:
    """What makes a compared pair a copy: ``MIN_INLIERS`` features agreeing under one transform over at least
    ``MIN_OVERLAP`` of the smaller image, the aligned grey levels correlating at ``correlation`` or more (halfway from
    it to 1 where fewer than ``FEW_INLIERS`` features agree), and their
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
        needed = self.correlation if comparison.inliers >= FEW_INLIERS else (1 + self.correlation) / 2
        if comparison.correlation < needed:
            return "content differs"
        if comparison.colour_mismatch > self.colour_mismatch:
            return "colours differ"
        return None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form."""
        return {"min_inliers": self.min_inliers, "min_overlap": MIN_OVERLAP,
                "correlation": round(self.correlation, 4), "colour_mismatch": round(self.colour_mismatch, 4)}


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
    pool = ThreadPoolExecutor(max(1, workers))
    pending: set[Future] = set()
    interrupted = False

    def collect(waiting: set[Future]) -> set[Future]:
        finished, waiting = wait(waiting, timeout=WAKE_SECONDS, return_when=FIRST_COMPLETED)
        for future in finished:
            results[future.position] = future.result()  # type: ignore[attr-defined]
            bar.update(1)
        return waiting

    try:
        # at most 4 pairs a worker in flight, the main thread awake every WAKE_SECONDS however long a pair takes:
        # Ctrl-C is answered within the pairs running, never after the batch
        for position in order[:limit].tolist():
            future = pool.submit(check, position)
            future.position = position  # type: ignore[attr-defined]
            pending.add(future)
            while len(pending) >= 4 * max(1, workers):
                pending = collect(pending)
        while pending:
            pending = collect(pending)
    except KeyboardInterrupt:
        interrupted = True
        for future in pending:
            future.cancel()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    # the checks that finished before Ctrl-C or while the pool wound down are kept
    for future in pending:
        if future.done() and not future.cancelled() and future.exception() is None:
            results.setdefault(future.position, future.result())  # type: ignore[attr-defined]
    if interrupted:
        stopped = f"stopped by Ctrl-C after {len(results):,} of {total:,} candidate pairs"
    pairs = [results[p] for p in sorted(results)]
    return Verification(pairs, total, time.perf_counter() - started, stopped is None, stopped, interrupted)


# --- groups
@dataclass(frozen=True)
class CopyGroup:
    """A verified group: ``ids`` the first (the one kept) then the others ascending; ``pairs`` each of the others
    checked against the first, in that order."""

    ids: np.ndarray
    pairs: list[CheckedPair]


# ``check(first, second)``: the pairs (first[i] < second[i]) compared to form groups, as ``verify_pairs`` compares
# candidates (on its workers, Ctrl-C keeping what finished: ``interrupted``)
GroupCheck = Callable[[np.ndarray, np.ndarray], Verification]


def copy_groups(pairs: Sequence[CheckedPair], check: GroupCheck | None = None,
                max_checks: int = MAX_EXTRA_CHECKS) -> list[CopyGroup]:
    """Groups in which every member is verified against the group's first image. Verified pairs are joined
    (union-find) into sets; in each set the image verified against the most others not yet placed (an original
    rather than one of its crops, which are verified against it but seldom against each other), the lowest id among
    equals, is a group's first (the one kept) and takes every other image verified against it: a pair checked
    already, or one compared by ``check`` (the extra comparisons of a round, in one batch) where the two were linked
    only through others; the rest are grouped again the same way. A dense set (copies of one picture, each linked to
    a few of the others) is thus one group after one round. Extra checks go to the smaller sets first and stop after
    ``max_checks`` or at Ctrl-C (the groups then come from the pairs checked)."""
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
    budget = {"left": max_checks if check is not None else 0}

    def compare_missing(head: int, others: list[int]) -> None:
        """The pairs of ``head`` with ``others`` not checked yet, compared in one batch (within the budget)."""
        missing = [key for key in ((min(head, o), max(head, o)) for o in others) if key not in known]
        missing = missing[:budget["left"]]
        if not missing:
            return
        budget["left"] -= len(missing)
        try:
            result = check(np.asarray([a for a, _ in missing], np.int64),  # type: ignore[misc]
                           np.asarray([b for _, b in missing], np.int64))
        except KeyboardInterrupt:
            budget["left"] = 0  # no more extra checks: what is known groups
            return
        known.update(((p.first, p.second), p) for p in result.pairs)
        if result.interrupted:
            budget["left"] = 0

    neighbours: dict[int, set[int]] = {}
    for p in verified:
        neighbours.setdefault(p.first, set()).add(p.second)
        neighbours.setdefault(p.second, set()).add(p.first)
    groups = []
    # the smaller sets first: one large set of lookalikes does not spend the checks the many small ones need
    for ids in sorted(members.values(), key=len):
        rest = set(ids)
        # each image's verified links to images not placed yet, in a heap (most first, the lowest id among equals;
        # outdated entries skipped): a round costs its first's links, not a pass over every image left
        links = {i: len(neighbours[i]) for i in ids}
        heap = [(-links[i], i) for i in ids]
        heapq.heapify(heap)
        while len(rest) > 1:
            count, head = heapq.heappop(heap)
            if head not in rest or -count != links[head]:
                continue
            if budget["left"] > 0:
                others = sorted(rest - {head})
                compare_missing(head, others)
            else:  # no check left: only the images verified against it can join
                others = sorted(neighbours[head] & rest)
            joined = [(other, pair) for other in others
                      if (pair := known.get((min(head, other), max(head, other)))) is not None and pair.verified]
            if not joined:  # nothing verified against the best linked image: none is against another either
                break
            groups.append(CopyGroup(np.asarray([head, *(i for i, _ in joined)], np.int64), [p for _, p in joined]))
            for placed in (head, *(i for i, _ in joined)):
                rest.discard(placed)
                for other in neighbours[placed] & rest:
                    links[other] -= 1
                    heapq.heappush(heap, (-links[other], other))
    return sorted(groups, key=lambda g: (-len(g.ids), int(g.ids[0])))


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
