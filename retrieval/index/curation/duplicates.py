"""The near-duplicate summary of an index (``retrieval index duplicates``, the app's view): the groups found at a
threshold, given or calibrated (``duplicates_threshold``), cut around their first image (``linked_groups``), listed
with their paths and labels, and the removal it proposes with its warnings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from PIL import Image

from retrieval.errors import ParameterError
from retrieval.index.curation.catalogued_images import catalogued_image_loader
from retrieval.index.curation.duplicates_threshold import CALIBRATION_SAMPLE, calibrate_on_index
from retrieval.index.curation.linked_groups import DuplicateGroup, duplicate_groups, split_around_first
from retrieval.index.curation.neighbour_graph import NeighbourGraph, index_graph, stored_vectors
from retrieval.index.query_embedder import ImageEmbedder
from retrieval.index.search import Index

MAX_GROUPS_SHOWN = 100  # groups a summary lists (largest first); the count covers every group
MAX_MEMBERS_SHOWN = 20  # images listed per group; its size counts all
# linked images whose vectors are read to cut chained groups around their first image (200,000 x 512 floats: 400 MB);
# beyond, the groups are left as linked and the summary says so
MAX_SPLIT_IMAGES = 200_000


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


def find_duplicates(index: Index, threshold: float | str = "auto", k: int = 10,
                    load: Callable[[int], Image.Image | None] | None = None, embedder: ImageEmbedder | None = None,
                    calibration_sample: int = CALIBRATION_SAMPLE, max_images: int | None = None,
                    max_groups: int = MAX_GROUPS_SHOWN, max_members: int = MAX_MEMBERS_SHOWN, seed: int = 0,
                    graph: NeighbourGraph | None = None) -> dict[str, Any]:
    """The near-duplicate groups of an index as a JSON-able summary (``groups``: the largest ``max_groups``).
    ``threshold`` "auto" calibrates on planted copies (``calibrate_on_index``: ``load`` reads an image, default its
    catalogued file; ``embedder`` default the index's model). ``max_images``: search a seeded sample only (each
    sampled image's copies are found among all indexed images). ``graph``: one already computed with ``k``."""
    if isinstance(threshold, str) and threshold != "auto":
        raise ParameterError("threshold", f"must be a cosine in [-1, 1] or auto, got {threshold!r}")
    graph = graph if graph is not None else index_graph(index, k, max_images, seed)
    calibration = None
    if threshold == "auto":
        calibration = calibrate_on_index(index, graph, load or catalogued_image_loader(index),
                                         embedder or index.embedder, calibration_sample, seed)
        threshold = calibration.threshold
    groups = duplicate_groups(graph, float(threshold))
    linked = np.unique(np.concatenate([g.ids for g in groups])) if groups else np.zeros(0, np.int64)
    split = len(linked) <= MAX_SPLIT_IMAGES
    if split and len(linked):
        ids, vectors = stored_vectors(index, linked)
        groups = split_around_first(groups, dict(zip(ids.tolist(), vectors, strict=True)), float(threshold))
    counts = index.catalogue.counts()
    listed = group_summaries(index, groups, max_groups, max_members)
    calibrated = calibration.to_dict() if calibration is not None else None
    return {
        "index_dir": str(index.layout.root),
        "images": int(len(graph.ids)),
        "indexed": len(index),
        "sampled": graph.sampled,
        "k": graph.k,
        "search": graph.search,
        "threshold": float(threshold),
        "calibration": calibrated,
        "split": split,  # groups cut around their first image (False: left as linked, too many images)
        "groups_found": len(groups),
        "images_in_groups": int(sum(len(g.ids) for g in groups)),
        "copies_in_groups": int(sum(len(g.ids) - 1 for g in groups)),
        "exact_duplicates": int(counts.get("duplicate", 0)),  # same bytes: skipped when indexed, never searched
        "groups": listed,
    } | advice(calibrated, listed)


def advice(calibration: dict[str, Any] | None, groups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What a summary proposes and warns of: ``removal`` (the copies of the listed groups whose labels agree;
    ``left_out``: the numbers, from 1, of those mixing labels, never proposed) and ``warnings`` for people (the
    calibration's, and the groups mixing labels)."""
    mixed = [number for number, group in enumerate(groups, 1) if group.get("labels_mixed")]
    warnings = [calibration["warning"]] if calibration and calibration.get("warning") else []
    if mixed:
        listed = ", ".join(map(str, mixed[:20])) + (" ..." if len(mixed) > 20 else "")
        warnings.append(f"{len(mixed)} of {len(groups)} groups listed mix labels ({listed}): distinct images alike "
                        "to the model, or a copy filed under another label; they are left out of the removal "
                        "proposed: look at them first")
    ids = [i for group in groups if not group.get("labels_mixed") for i in group["ids"][1:]]
    return {"removal": {"ids": ids, "groups": len(groups) - len(mixed), "left_out": mixed}, "warnings": warnings}
