"""The near-duplicate summary of an index (``retrieval index duplicates``, the app's view), listed with paths and
labels, and the removal it proposes with its warnings.

By default (``threshold="auto"``) the groups are verified copies (``copy_verification``): candidates above a loose
cosine, each pair checked by local features, aligned content and colour, grouped without chaining; the candidates
that fail are listed apart as "similar, not copies". A cosine given as ``threshold`` (or ``verify=False``, which
calibrates one: ``duplicates_threshold``) groups by that cosine alone, cut around each group's first image
(``linked_groups``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from retrieval.errors import ParameterError
from retrieval.index.curation.catalogued_images import KeptImage, catalogued_image_loader
from retrieval.index.curation.copy_calibration import (
    MIN_CANDIDATE_COSINE,
    NEAREST_CANDIDATES,
    VERIFY_SAMPLE,
    VerificationCalibration,
    calibrate_verification,
    group_precision,
)
from retrieval.index.curation.copy_verification import (
    MAX_EXTRA_CHECKS,
    MAX_PAIRS,
    NOT_CANDIDATES,
    CheckedPair,
    CopyGroup,
    FeatureCache,
    Verification,
    check_workers,
    copy_groups,
    verify_pairs,
)
from retrieval.index.curation.duplicates_threshold import CALIBRATION_SAMPLE, calibrate_on_index
from retrieval.index.curation.linked_groups import DuplicateGroup, duplicate_groups, duplicate_links, split_around_first
from retrieval.index.curation.neighbour_graph import NeighbourGraph, index_graph, stored_vectors
from retrieval.index.query_embedder import ImageEmbedder
from retrieval.index.search import Index

MAX_GROUPS_SHOWN = 100  # groups a summary lists (largest first); the count covers every group
MAX_MEMBERS_SHOWN = 20  # images listed per group; its size counts all
# linked images whose vectors are read to cut chained groups around their first image (200,000 x 512 floats: 400 MB);
# beyond, the groups are left as linked and the summary says so
MAX_SPLIT_IMAGES = 200_000
NOT_WITH_FIRST = "verified, but not against its group's first image"


def group_summaries(index: Index, groups: Sequence[DuplicateGroup], max_groups: int = MAX_GROUPS_SHOWN,
                    max_members: int = MAX_MEMBERS_SHOWN) -> list[dict[str, Any]]:
    """The first ``max_groups`` groups as JSON: size, ids, paths (as the API shows them), labels, each image's
    cosine to the group's first image (1.0 for itself), the weakest and best link; ``max_members`` images each."""
    shown = list(groups[:max_groups])
    wanted = np.unique(np.concatenate([g.ids[:max_members] for g in shown])) if shown else np.zeros(0, np.int64)
    ids, vectors = stored_vectors(index, wanted)
    vector_of = {int(i): v for i, v in zip(ids.tolist(), vectors, strict=True)}
    # every member's label, not only those listed: one of another label among the rest still mixes the group
    everyone = np.unique(np.concatenate([g.ids for g in shown])) if shown else np.zeros(0, np.int64)
    rows = index.indexed_rows(everyone.tolist())
    out = []
    for group in shown:
        labels = {rows[int(i)]["label"] for i in group.ids if int(i) in rows} - {None}
        members = [int(i) for i in group.ids[:max_members]]
        first = vector_of.get(members[0])
        similarities = [round(float(vector_of[i] @ first), 4) if first is not None and i in vector_of else None
                        for i in members]
        out.append({
            "size": int(len(group.ids)),
            "ids": members,
            "paths": [index.public_path(rows[i]["path"]) if i in rows else None for i in members],
            "labels": [rows[i]["label"] if i in rows else None for i in members],
            "labels_mixed": len(labels) > 1,  # distinct images, perhaps: never proposed for removal
            "similarities": similarities,
            "weakest_link": round(group.weakest_link, 4),
            "best_link": round(group.best_link, 4),
            "shown": len(members),
        })
    return out


@dataclass(frozen=True)
class DuplicateOptions:
    """How ``find_duplicates`` reads an index. ``threshold`` "auto" with ``verify``: verified copies
    (``find_copies``); "auto" without: a cosine calibrated on planted copies (``calibrate_on_index``); a cosine: the
    groups at it. ``k``: neighbours per image; ``calibration_sample``: images copies are planted of (default the
    mode's own); ``max_images``: search a seeded sample only; ``max_groups``, ``max_members``: listed in the
    summary; ``seed``: the sample's and the calibration's; ``workers``: threads comparing pairs; ``progress``: a bar;
    ``max_pairs``: candidate pairs compared at most."""

    threshold: float | str = "auto"
    k: int = 10
    calibration_sample: int | None = None
    max_images: int | None = None
    max_groups: int = MAX_GROUPS_SHOWN
    max_members: int = MAX_MEMBERS_SHOWN
    seed: int = 0
    verify: bool = True
    workers: int = 2
    progress: bool = False
    max_pairs: int = MAX_PAIRS


def find_duplicates(index: Index, options: DuplicateOptions | None = None, *,
                    load: Callable[[int], Image.Image | None] | None = None, embedder: ImageEmbedder | None = None,
                    graph: NeighbourGraph | None = None,
                    verification: VerificationCalibration | None = None) -> dict[str, Any]:
    """The near-duplicate groups of an index as a JSON-able summary (``groups``: the largest ``max_groups``), read
    as ``options`` say (``DuplicateOptions``). ``load`` reads an image (default its catalogued file); ``embedder``
    embeds planted copies (default the index's model); ``graph``: one already computed with ``k``;
    ``verification``: a calibration already made for it."""
    options = DuplicateOptions() if options is None else options
    if not isinstance(options, DuplicateOptions):
        raise ParameterError("options", f"must be a DuplicateOptions (DuplicateOptions(threshold=..., k=...)), got "
                                        f"{type(options).__name__} {options!r:.60}")
    threshold, calibration_sample = options.threshold, options.calibration_sample
    if isinstance(threshold, str) and threshold != "auto":
        raise ParameterError("threshold", f"must be a cosine in [-1, 1] or auto, got {threshold!r}")
    graph = graph if graph is not None else index_graph(index, options.k, options.max_images, options.seed)
    load = load or catalogued_image_loader(index)
    if threshold == "auto" and options.verify:
        return find_copies(index, graph, load, options, embedder, verification)
    calibration = None
    if threshold == "auto":
        calibration = calibrate_on_index(index, graph, load, embedder or index.embedder,
                                         CALIBRATION_SAMPLE if calibration_sample is None else calibration_sample,
                                         options.seed)
        threshold = calibration.threshold
    groups = duplicate_groups(graph, float(threshold))
    linked = np.unique(np.concatenate([g.ids for g in groups])) if groups else np.zeros(0, np.int64)
    split = len(linked) <= MAX_SPLIT_IMAGES
    if split and len(linked):
        ids, vectors = stored_vectors(index, linked)
        groups = split_around_first(groups, dict(zip(ids.tolist(), vectors, strict=True)), float(threshold))
    listed = group_summaries(index, groups, options.max_groups, options.max_members)
    calibrated = calibration.to_dict() if calibration is not None else None
    return {
        **_counts(index, graph),
        "mode": "cosine",
        "threshold": float(threshold),
        "calibration": calibrated,
        "split": split,  # groups cut around their first image (False: left as linked, too many images)
        "groups_found": len(groups),
        "images_in_groups": int(sum(len(g.ids) for g in groups)),
        "copies_in_groups": int(sum(len(g.ids) - 1 for g in groups)),
        "groups": listed,
    } | advice(calibrated, listed)


def _counts(index: Index, graph: NeighbourGraph) -> dict[str, Any]:
    return {"index_dir": str(index.layout.root), "images": int(len(graph.ids)), "indexed": len(index),
            "sampled": graph.sampled, "k": graph.k, "search": graph.search,
            # same bytes: skipped when indexed, never searched
            "exact_duplicates": int(index.catalogue.counts().get("duplicate", 0))}


def find_copies(index: Index, graph: NeighbourGraph, load: Callable[[int], Image.Image | None],
                options: DuplicateOptions | None = None, embedder: ImageEmbedder | None = None,
                calibration: VerificationCalibration | None = None) -> dict[str, Any]:
    """Verified copy groups of the graph's images: candidates at the calibrated loose cosine (and each image's
    nearest, ``NEAREST_CANDIDATES``), each pair verified (``verify_pairs``), grouped without chaining
    (``copy_groups``: every member verified against the kept image, the most detailed, no two of other colours),
    each group with its estimated precision; the candidates that fail are ``similar`` (with the reason).
    ``calibration``: one already made for this graph; ``options.max_pairs``: the most candidate pairs compared
    (the first ones by id; the summary says when it stopped)."""
    options = options or DuplicateOptions()
    workers, max_pairs = check_workers(options.workers), options.max_pairs
    embedder = embedder or index.embedder
    if calibration is None:
        sample = VERIFY_SAMPLE if options.calibration_sample is None else options.calibration_sample
        calibration = calibrate_verification(index, graph, load, embedder, sample, options.seed, workers)
    first, second, cosines = duplicate_links(graph, calibration.candidate_cosine, NEAREST_CANDIDATES,
                                             MIN_CANDIDATE_COSINE)
    features = FeatureCache(load, embedder.preprocessing.background)
    checked = verify_pairs(first, second, cosines, features, calibration.rules, workers, options.progress,
                           max_pairs)
    extra: list[CheckedPair] = []  # the pairs compared to form groups (images linked only through others)
    grouping = {"interrupted": False}

    def check_extra(a: np.ndarray, b: np.ndarray) -> Verification:
        # only pairs alike enough to be candidates are compared: a chain of links must not have its first compared
        # with every image of a large set of lookalikes, each comparison a chance for a false match
        cosines = _pair_cosines(index, a, b)
        alike = cosines >= calibration.candidate_cosine
        done = verify_pairs(a[alike], b[alike], cosines[alike], features, calibration.rules, workers, progress=False)
        extra.extend(done.pairs)
        grouping["interrupted"] |= done.interrupted
        # the others are known not to be copies (not asked again), and not listed as similar
        unlike = [CheckedPair(int(x), int(y), float(c), None, NOT_CANDIDATES) for x, y, c in
                  zip(a[~alike].tolist(), b[~alike].tolist(), cosines[~alike].tolist(), strict=True)]
        return dataclasses.replace(done, pairs=[*done.pairs, *unlike])

    def check_kept(a: np.ndarray, b: np.ndarray) -> Verification:
        # a group's members against the image it keeps, whatever their cosine: they are verified copies of its first
        done = verify_pairs(a, b, _pair_cosines(index, a, b), features, calibration.rules, workers, progress=False)
        extra.extend(done.pairs)
        grouping["interrupted"] |= done.interrupted
        return done

    # the extra comparisons are bounded as the candidates are (the app's click, ``max_pairs``); after Ctrl-C there
    # are none: what was verified is grouped as it is
    # each group keeps its most detailed image (an original, not one of its downscaled or re-encoded copies)
    groups = copy_groups(checked.pairs, None if checked.interrupted else check_extra,
                         max_checks=min(MAX_EXTRA_CHECKS, max_pairs), cross_check=True,
                         keep=KeptImage(index, features.sides), check_kept=check_kept)
    interrupted = checked.interrupted or grouping["interrupted"]
    verified_pairs = sum(p.verified for p in checked.pairs)
    # what the precision reads the share of copies among the candidates from
    verified_share = verified_pairs / max(1, len(checked.pairs))
    max_groups, max_members = options.max_groups, options.max_members
    listed = group_summaries(index, [_as_linked(g) for g in groups], max_groups, max_members)
    for summary, group in zip(listed, groups, strict=False):
        summary["verified"] = True
        # members not compared with every other member: listed, never proposed for removal (two colour variants)
        summary["unconfirmed"] = sorted(group.unconfirmed)
        summary["estimated_precision"] = round(group_precision(group, calibration, verified_share), 3)
        summary["checks"] = [p.comparison.to_dict() if p.comparison is not None else None
                             for p in group.pairs[:max_members - 1]]
    grouped = {int(i): n for n, g in enumerate(groups) for i in g.ids}
    # what a person should look at: candidates that failed, and verified pairs (candidates or extra checks) whose
    # images did not end up in one group (each verified against a different first image)
    similar = [p if not p.verified else dataclasses.replace(p, reason=NOT_WITH_FIRST)
               for p in [*checked.pairs, *extra]
               if grouped.get(p.first, -1) != grouped.get(p.second, -2)]
    similar.sort(key=lambda p: (-p.cosine if math.isfinite(p.cosine) else 1.0, p.first, p.second))
    calibrated = calibration.to_dict()
    verification = {"candidates": checked.candidates, "checked": len(checked.pairs), "verified": verified_pairs,
                    "seconds": round(checked.seconds, 2), "pairs_per_second": round(checked.pairs_per_second, 1),
                    "images_read": features.computed, "workers": workers, "complete": checked.complete,
                    "stopped_because": checked.stopped_because, "interrupted": interrupted,
                    "estimated_precision": round(calibration.precision(verified_share), 3),
                    # distinct pairs among the candidates the calibration's false rate would verify
                    "expected_false_pairs": round(calibration.false_rate * (len(checked.pairs) - verified_pairs), 1)}
    summary = {
        **_counts(index, graph),
        "mode": "verified",
        "threshold": calibration.candidate_cosine,  # the candidates' cosine; each pair is then verified
        "calibration": calibrated,
        "verification": verification,
        "split": True,
        "groups_found": len(groups),
        "images_in_groups": int(sum(len(g.ids) for g in groups)),
        "copies_in_groups": int(sum(len(g.ids) - 1 for g in groups)),
        "groups": listed,
        "similar_found": len(similar),
        "similar": similar_summaries(index, similar[:max_groups]),
    } | advice(calibrated, listed)
    if not checked.complete:
        summary["warnings"].insert(0, f"verification not finished ({checked.stopped_because}): the groups come from "
                                      "the pairs checked, the first by id")
    unconfirmed = sum(len(g.unconfirmed) for g in groups)
    if unconfirmed:
        summary["warnings"].append(f"{unconfirmed:,} images of groups were not compared with every other member of "
                                   "their group (stopped, or past the checks allowed): listed, not proposed for "
                                   "removal, as two of them may be colour variants")
    if grouping["interrupted"]:
        summary["warnings"].insert(0, "grouping stopped by Ctrl-C: an image linked to a group's first only through "
                                      "others and not compared with it yet is left out of that group")
    return summary


def _as_linked(group: CopyGroup) -> DuplicateGroup:
    return DuplicateGroup(group.ids, [(p.first, p.second, p.cosine) for p in group.pairs])


def _pair_cosines(index: Index, first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """The cosine of each pair (``first[i]``, ``second[i]``) from the stored vectors; -1 where one was removed."""
    ids, vectors = stored_vectors(index, np.concatenate([first, second]))
    held = np.isin(first, ids) & np.isin(second, ids)
    cosines = np.full(len(first), -1.0, np.float32)
    a, b = np.searchsorted(ids, first[held]), np.searchsorted(ids, second[held])
    cosines[held] = np.einsum("ij,ij->i", vectors[a], vectors[b])
    return cosines


def similar_summaries(index: Index, pairs: Sequence[CheckedPair]) -> list[dict[str, Any]]:
    """Candidate pairs that were not verified as copies, as JSON: ids, paths, labels, cosine, why not, and what the
    comparison measured."""
    wanted = sorted({i for p in pairs for i in (p.first, p.second)})
    rows = index.indexed_rows(wanted)
    out = []
    for pair in pairs:
        ids = [pair.first, pair.second]
        out.append({"ids": ids, "paths": [index.public_path(rows[i]["path"]) if i in rows else None for i in ids],
                    "labels": [rows[i]["label"] if i in rows else None for i in ids],
                    "cosine": round(pair.cosine, 4), "reason": pair.reason,
                    "check": pair.comparison.to_dict() if pair.comparison is not None else None})
    return out


def advice(calibration: dict[str, Any] | None, groups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What a summary proposes and warns of: ``removal`` (the copies of the listed groups whose labels agree;
    ``left_out``: the numbers, from 1, of those mixing labels, never proposed; a group's ``unconfirmed`` members
    are never proposed either) and ``warnings`` for people (the
    calibration's, and the groups mixing labels)."""
    mixed = [number for number, group in enumerate(groups, 1) if group.get("labels_mixed")]
    warnings = [calibration["warning"]] if calibration and calibration.get("warning") else []
    if mixed:
        listed = ", ".join(map(str, mixed[:20])) + (" ..." if len(mixed) > 20 else "")
        warnings.append(f"{len(mixed)} of {len(groups)} groups listed mix labels ({listed}): distinct images alike "
                        "to the model, or a copy filed under another label; they are left out of the removal "
                        "proposed: look at them first")
    ids = [i for group in groups if not group.get("labels_mixed") for i in group["ids"][1:]
           if i not in group.get("unconfirmed", ())]
    return {"removal": {"ids": ids, "groups": len(groups) - len(mixed), "left_out": mixed}, "warnings": warnings}
