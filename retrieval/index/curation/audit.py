"""Label audit: the images whose label disagrees with their neighbours', ranked, each with the label it has, the one
its neighbours suggest and a score. A kNN vote read the way confident learning reads a classifier's out-of-sample
probabilities (Northcutt, Jiang and Chuang, "Confident Learning: Estimating Uncertainty in Dataset Labels", JAIR
2021), over the graph of each image's k nearest other images (``neighbour_graph``: never all pairs).

The formula, for image i with label y_i and its k nearest other images j (cosine s_ij):

- vote:       p_i(c) = sum_j w_ij [y_j = c] / sum_j w_ij, with w_ij = max(s_ij, 0) over the labelled neighbours
              (leave-one-out: i never votes for itself);
- thresholds: t_c = the mean of p_i(c) over the images labelled c (CL's per-class threshold, the average
              self-confidence);
- suggestion: s_i = argmax of p_i(c) over the classes with p_i(c) >= t_c (none when no class reaches its threshold:
              CL's confident joint);
- suspect:    s_i exists and differs from y_i (an off-diagonal entry of the confident joint);
- score:      p_i(s_i) - p_i(y_i), the margin by which the neighbours prefer the suggestion (CL's normalised
              margin, without the normalisation: the vote's shares already sum to 1); suspects are ranked by it,
              highest first, then by the lowest self-confidence p_i(y_i).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.errors import ParameterError
from retrieval.index.curation.neighbour_graph import NeighbourGraph, exact_graph, index_graph
from retrieval.index.query_embedder import ImageEmbedder
from retrieval.index.search import Index

TOP_SUSPECTS = 50  # suspects a summary lists, best first; the count covers all
NEIGHBOURS_SHOWN = 5  # neighbours listed with each suspect
MAX_FOLDER_IMAGES = 20_000  # `retrieval audit --images`: exact kNN among them costs n^2 d
VOTE_CHUNK = 65_536  # rows whose k x k label comparison is held at once
Describe = Callable[[int], dict[str, Any]]  # an image's id -> the fields that name it (id and path, or path)


@dataclass(frozen=True)
class LabelVote:
    """The kNN vote of each image: per neighbour column, the share of the vote its label has."""

    labels: np.ndarray  # int64 [n]: each image's class (-1: unlabelled)
    neighbour_labels: np.ndarray  # int64 [n, k]: each neighbour's class (-1: none or unlabelled)
    shares: np.ndarray  # float64 [n, k]: p_i(class of neighbour column c); 0 where that neighbour has no label
    self_confidence: np.ndarray  # float64 [n]: p_i(y_i); NaN where i has no labelled neighbour or no label

    @property
    def voted(self) -> np.ndarray:
        """Whether the image has a label and at least one labelled neighbour."""
        return ~np.isnan(self.self_confidence)


def label_vote(labels: np.ndarray, neighbour_labels: np.ndarray, scores: np.ndarray) -> LabelVote:
    """The similarity-weighted kNN vote (weights max(cosine, 0)) of each row's labelled neighbours."""
    labels = np.asarray(labels, dtype=np.int64)
    neighbour_labels = np.asarray(neighbour_labels, dtype=np.int64)
    weights = np.where(neighbour_labels >= 0, np.maximum(np.nan_to_num(scores, neginf=0.0), 0.0), 0.0)
    total = weights.sum(axis=1)
    shares = np.zeros(neighbour_labels.shape, dtype=np.float64)
    for start in range(0, len(labels), VOTE_CHUNK):  # the k x k comparison, a bounded number of rows at a time
        part = slice(start, start + VOTE_CHUNK)
        same = neighbour_labels[part, :, None] == neighbour_labels[part, None, :]
        shares[part] = (same * weights[part, None, :]).sum(axis=2)
    with np.errstate(invalid="ignore", divide="ignore"):
        shares = np.where(total[:, None] > 0, shares / total[:, None], 0.0) * (neighbour_labels >= 0)
        own = (weights * (neighbour_labels == labels[:, None])).sum(axis=1) / total
    own = np.where((total > 0) & (labels >= 0), own, np.nan)
    return LabelVote(labels, neighbour_labels, shares, own)


@dataclass(frozen=True)
class Suspicion:
    """Confident learning over a vote: the per-class thresholds, each image's suggestion and score."""

    thresholds: np.ndarray  # float64 [C]: t_c (NaN for a class no image with a vote carries)
    suggested: np.ndarray  # int64 [n]: s_i, -1 where no class reaches its threshold
    suggested_share: np.ndarray  # float64 [n]: p_i(s_i), 0 where none
    score: np.ndarray  # float64 [n]: p_i(s_i) - p_i(y_i); NaN where there is no suggestion or vote
    suspect: np.ndarray  # bool [n]: s_i exists and differs from y_i

    def ranked(self, vote: LabelVote) -> np.ndarray:
        """The suspects' rows, highest score first, then lowest self-confidence, then row."""
        rows = np.flatnonzero(self.suspect)
        order = np.lexsort((rows, vote.self_confidence[rows], -self.score[rows]))
        return rows[order]


def class_thresholds(vote: LabelVote, num_classes: int) -> np.ndarray:
    """t_c: the mean self-confidence of the images labelled c that have a vote (NaN for a class with none)."""
    voted = vote.voted
    counts = np.bincount(vote.labels[voted], minlength=num_classes).astype(np.float64)
    sums = np.bincount(vote.labels[voted], weights=vote.self_confidence[voted], minlength=num_classes)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / counts, np.nan)


def confident_suspects(vote: LabelVote, num_classes: int) -> Suspicion:
    """The confident-learning reading of ``vote`` (the module's formula)."""
    thresholds = class_thresholds(vote, num_classes)
    # a class no voted image carries has no threshold: it is never suggested
    limit = np.where(np.isnan(thresholds), np.inf, thresholds)
    labelled = vote.neighbour_labels >= 0
    reach = labelled & (vote.shares >= limit[np.clip(vote.neighbour_labels, 0, None)])
    candidates = np.where(reach, vote.shares, -1.0)
    column = np.argmax(candidates, axis=1)  # ties: the nearer neighbour's column, which carries the same share
    rows = np.arange(len(column))
    found = candidates[rows, column] >= 0
    voted = vote.voted
    suggested = np.where(found & voted, vote.neighbour_labels[rows, column], -1)
    share = np.where(suggested >= 0, vote.shares[rows, column], 0.0)
    score = np.where(suggested >= 0, share - np.nan_to_num(vote.self_confidence), np.nan)
    return Suspicion(thresholds, suggested, share, score, (suggested >= 0) & (suggested != vote.labels))


@dataclass(frozen=True)
class Audit:
    """A graph's audit: the classes, the vote, the suspicion, and the graph itself (for the neighbours shown)."""

    graph: NeighbourGraph
    classes: list[str]
    vote: LabelVote
    suspicion: Suspicion

    def suspect_rows(self) -> np.ndarray:
        return self.suspicion.ranked(self.vote)


def audit_graph(graph: NeighbourGraph, label_of: dict[int, str]) -> Audit:
    """Audit the labels ``label_of`` (id -> label; absent: unlabelled) of the graph's images."""
    classes = sorted(set(label_of.values()))
    code = {name: n for n, name in enumerate(classes)}
    lookup = {int(i): code[label] for i, label in label_of.items()}
    labels = np.fromiter((lookup.get(int(i), -1) for i in graph.ids), np.int64, len(graph.ids))
    flat = graph.neighbours.reshape(-1)
    neighbour_labels = np.fromiter((lookup.get(int(i), -1) for i in flat), np.int64, len(flat))
    vote = label_vote(labels, neighbour_labels.reshape(graph.neighbours.shape), graph.scores)
    return Audit(graph, classes, vote, confident_suspects(vote, len(classes)))


def parse_label_noise(text: str) -> tuple[str, float]:
    """``symmetric:0.1`` -> ("symmetric", 0.1), as `retrieval train --label-noise` takes it."""
    mode, _, rate = str(text).partition(":")
    try:
        value = float(rate)
        ok = mode in ("symmetric", "asymmetric") and 0 <= value < 1
    except ValueError:
        ok = False
    if not ok:
        raise ParameterError("label_noise", f"must look like symmetric:0.1 or asymmetric:0.2 (a rate in [0, 1)), "
                                            f"got {text!r}")
    return mode, value


def noise_evaluation(audit: Audit, flipped: np.ndarray, top: int) -> dict[str, Any]:
    """How well the ranked suspects find the ``flipped`` rows (bool [n]): precision of the top ``top`` (fewer when
    there are fewer suspects) and of the top as many as were flipped (R-precision), and the precision and recall of
    every suspect."""
    ranked = audit.suspect_rows()
    hits = flipped[ranked]
    count = int(flipped.sum())

    def precision_at(n: int) -> float | None:
        return round(float(hits[:n].mean()), 4) if n > 0 and len(hits) else None

    shown = min(top, len(ranked))
    return {"flipped": count, "suspects": int(len(ranked)), "top": shown, "precision_at_top": precision_at(shown),
            "precision_at_flipped": precision_at(min(count, len(ranked))),
            "precision": round(float(hits.mean()), 4) if len(hits) else None,
            "recall": round(float(hits.sum() / count), 4) if count else None}


def suspect_entries(audit: Audit, top: int, describe: Describe) -> list[dict[str, Any]]:
    """The first ``top`` ranked suspects as JSON; ``describe(id)`` gives an image's identifying fields (its id and
    path as the API shows them, or its path in a folder)."""
    entries = []
    graph, vote, suspicion = audit.graph, audit.vote, audit.suspicion
    for row in audit.suspect_rows()[:top]:
        neighbours = [
            {**describe(int(j)), "label": audit.classes[c] if c >= 0 else None, "similarity": round(float(s), 4)}
            for j, c, s in zip(graph.neighbours[row], vote.neighbour_labels[row], graph.scores[row], strict=True)
            if j >= 0][:NEIGHBOURS_SHOWN]
        entries.append({
            **describe(int(graph.ids[row])),
            "label": audit.classes[vote.labels[row]],
            "suggested": audit.classes[suspicion.suggested[row]],
            "score": round(float(suspicion.score[row]), 4),
            "self_confidence": round(float(vote.self_confidence[row]), 4),
            "suggested_confidence": round(float(suspicion.suggested_share[row]), 4),
            "neighbours": neighbours,
        })
    return entries


def audit_summary(audit: Audit, top: int, describe: Describe) -> dict[str, Any]:
    """The JSON-able summary: counts, the method, the thresholds of the classes and the ``top`` suspects."""
    graph, vote, suspicion = audit.graph, audit.vote, audit.suspicion
    thresholds = {name: round(float(t), 4) for name, t in zip(audit.classes, suspicion.thresholds, strict=True)
                  if not np.isnan(t)}
    return {
        "images": int(len(graph.ids)),
        "labelled": int((vote.labels >= 0).sum()),
        "voted": int(vote.voted.sum()),
        "classes": len(audit.classes),
        "k": graph.k,
        "search": graph.search,
        "sampled": graph.sampled,
        "method": "similarity-weighted kNN vote (weights max(cosine, 0)); confident learning: per-class threshold = "
                  "mean self-confidence, suspect = a class other than the label reaches its threshold; score = "
                  "p(suggested) - p(label)",
        "suspects_found": int(suspicion.suspect.sum()),
        "thresholds": thresholds,
        "suspects": suspect_entries(audit, top, describe),
    }


def check_top(top: int) -> int:
    """``top`` as an int within [1, 10000], else a ParameterError."""
    if isinstance(top, bool) or not isinstance(top, (int, np.integer)) or not 1 <= top <= 10_000:
        raise ParameterError("top", f"must be a whole number of suspects between 1 and 10000, got {top!r}")
    return int(top)


def audit_index(index: Index, k: int = 10, top: int = TOP_SUSPECTS, max_images: int | None = None, seed: int = 0,
                graph: NeighbourGraph | None = None) -> dict[str, Any]:
    """Audit an index's labels (its catalogue's) through its own search; ``max_images``: a seeded sample of the
    images is audited, their neighbours being any indexed image. ``graph``: one already computed."""
    top = check_top(top)
    label_of = dict(index.catalogue.labelled())
    if not label_of:
        raise ParameterError("index", "has no labels to audit: its images were not in class sub-folders or a "
                                      "manifest with a label column; relabel it (retrieval index repair INDEX "
                                      "--label-from parent|top|manifest)")
    graph = graph if graph is not None else index_graph(index, k, max_images, seed)
    audit = audit_graph(graph, label_of)
    shown = [int(graph.ids[r]) for r in audit.suspect_rows()[:top]]
    wanted = set(shown) | {int(j) for r in audit.suspect_rows()[:top] for j in graph.neighbours[r] if j >= 0}
    rows = index.indexed_rows(sorted(wanted))

    def describe(image_id: int) -> dict[str, Any]:
        row = rows.get(image_id)
        return {"id": image_id, "path": index.public_path(row["path"]) if row else None}

    return {"index_dir": str(index.layout.root), "indexed": len(index), **audit_summary(audit, top, describe)}


def audit_folder(images: str | Path, embedder: ImageEmbedder, k: int = 10, top: int = TOP_SUSPECTS,
                 max_images: int = MAX_FOLDER_IMAGES, label_noise: str | None = None,
                 label_noise_transitions: str | Path | None = None, seed: int = 0, batch_size: int = 64,
                 workers: int = 1) -> dict[str, Any]:
    """Audit a training folder's labels (its sub-folders) with ``embedder``: every image embedded, exact kNN among
    them. ``label_noise`` (``symmetric:0.1``, as `retrieval train --label-noise`) flips labels first and the summary
    then says how well the suspects find the flipped images (``noise``)."""
    from retrieval.index.embedding.embed_rows import RowEmbedder
    from retrieval.index.sources import list_gallery

    top = check_top(top)
    noise = parse_label_noise(label_noise) if label_noise else None
    gallery = list_gallery(images)
    items = sorted((item for item in gallery.items if item.label is not None), key=lambda item: item.path)
    if len(items) > int(max_images):
        raise ParameterError("max_images", f"is {max_images}, but {images} holds {len(items)} labelled images: "
                                           "the audit embeds every one and compares it with all the others; raise "
                                           "it, or build an index of them (retrieval index build) and run "
                                           "retrieval index audit INDEX, which searches through faiss")
    if len({item.label for item in items}) < 2:
        raise ParameterError("images", f"{images} holds {len(items)} labelled images in "
                                       f"{len({item.label for item in items})} class(es): the audit needs images "
                                       "in at least 2 class sub-folders (the folder name is the label)")
    embedded = RowEmbedder(embedder, batch_size, workers).embed([(n, item.path) for n, item in enumerate(items)])
    kept = embedded.ids
    graph = exact_graph(embedded.vectors, kept, min(int(k), max(1, len(kept) - 1)))
    root = Path(gallery.root)
    paths = {int(n): _relative(items[int(n)].path, root) for n in kept}
    labels = {int(n): items[int(n)].label for n in kept}
    flipped = None
    noise_info: dict[str, Any] | None = None
    if noise is not None:
        labels, flipped, noise_info = _with_noise(labels, noise, label_noise_transitions, seed)
    audit = audit_graph(graph, labels)
    summary = {"images_dir": str(images), "unreadable": len(items) - len(kept), "model_hash": embedder.model_hash,
               **audit_summary(audit, top, lambda n: {"path": paths[n]})}
    if noise_info is not None and flipped is not None:
        summary["noise"] = noise_info | noise_evaluation(audit, flipped[np.searchsorted(kept, graph.ids)], top)
    return summary


def _relative(path: str, root: Path) -> str:
    return Path(path).relative_to(root).as_posix() if Path(path).is_relative_to(root) else Path(path).name


def _with_noise(labels: dict[int, str], noise: tuple[str, float], table: str | Path | None,
                seed: int) -> tuple[dict[int, str], np.ndarray, dict[str, Any]]:
    """``labels`` with noise injected by the toolkit's ``inject_label_noise`` (the labels `retrieval train
    --label-noise` trains on): the noisy labels, which rows flipped (in id order), what was done."""
    from retrieval.data.noise import KNOWN_TRANSITIONS, asymmetric_transitions, inject_label_noise

    mode, rate = noise
    ids = sorted(labels)
    classes = sorted(set(labels.values()))
    clean = np.asarray([classes.index(labels[i]) for i in ids], dtype=np.int64)
    transitions, chosen = None, {}
    if mode == "asymmetric":  # a known table whose classes are all here, else the file given
        known = next((name for name, pairs in KNOWN_TRANSITIONS.items()
                      if all(a in classes and b in classes for a, b in pairs)), "")
        try:
            transitions, chosen = asymmetric_transitions(known, classes, table)
        except ParameterError as exc:
            raise exc.renamed("label_noise_transitions") from None
    noisy, info = inject_label_noise(clean, mode, rate, len(classes), transitions, seed)
    return ({i: classes[c] for i, c in zip(ids, noisy.tolist(), strict=True)}, noisy != clean,
            {**info, **chosen})

