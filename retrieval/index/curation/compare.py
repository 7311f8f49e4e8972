"""How much a new model changes each gallery image's neighbours, without labels: the overlap of an image's top-k
under the new model with its top-k under the model that built the index (or any baseline), on the images it will
serve. Labels, where the gallery has them, add each model's Recall@1 and precision@k on the same images.

An overlap near 1 means the new model keeps the gallery's neighbourhoods (fine-tuning refined them); near 0, it
orders the gallery anew, for better or worse: the images that change most are listed to be looked at. Read side
only: the stored vectors are read from the shards, the new ones are embedded here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from retrieval.compatibility import label_metrics_per_query, neighbour_overlap, top_k, worse_on_labels
from retrieval.data.decode import DEFAULT_MAX_PIXELS
from retrieval.errors import ParameterError
from retrieval.index.catalogue_reader import CatalogueQueries, CatalogueReader
from retrieval.index.embedding.embed_rows import RowEmbedder
from retrieval.index.layout import IndexLayout
from retrieval.index.portable import gallery_place
from retrieval.index.query_embedder import ImageEmbedder
from retrieval.index.search import gallery_root, public_path
from retrieval.index.shards import ShardStore
from retrieval.index.vectors import done_chunks
from retrieval.utils.unit_rows import l2_normalize_rows

DEFAULT_SAMPLE = 2000  # gallery images compared: exact kNN among them costs sample^2 x d per model
MOST_CHANGED = 10
# what an upgrade measures on the index's labels: at most LABEL_SAMPLE images, PER_LABEL of each label drawn, so
# that each query has others of its class among them ([n, n] similarities per model: bounded memory and time)
LABEL_SAMPLE = 1000
PER_LABEL = 10


def label_agreement(vectors: np.ndarray, labels: list[str | None], k: int) -> dict[str, float]:
    """Recall@1 and precision@k of the labelled rows among all rows (leave-one-out)."""
    found = top_k(vectors, k)
    own = np.asarray([label is not None for label in labels])
    same = np.asarray([[labels[j] == labels[i] for j in row] for i, row in enumerate(found)])
    return {"recall@1": float(same[own, 0].mean()), f"precision@{k}": float(same[own].mean())}


def compare_embeddings(old: np.ndarray, new: np.ndarray, paths: list[str], labels: list[str | None],
                       k: int = 10) -> dict[str, Any]:
    """The overlap of each image's top-k under ``new`` with its top-k under ``old``, summarised, the images that
    change most, and each model's label agreement where there are labels."""
    overlap = neighbour_overlap(old, new, k)
    order = np.argsort(overlap, kind="stable")[:MOST_CHANGED]
    summary = {
        "images": len(paths), "k": k,
        "overlap": {"mean": float(overlap.mean()), "median": float(np.median(overlap)),
                    "p10": float(np.quantile(overlap, 0.1)), "p90": float(np.quantile(overlap, 0.9)),
                    "share_below_half": float((overlap < 0.5).mean())},
        "most_changed": [{"path": paths[i], "label": labels[i], "overlap": float(overlap[i])} for i in order],
        "labels": None,
    }
    if sum(label is not None for label in labels) >= 2:
        summary["labels"] = {"old": label_agreement(old, labels, k), "new": label_agreement(new, labels, k)}
    return summary


def compare_with_index(index_dir: str | Path, embedder: ImageEmbedder, sample: int = DEFAULT_SAMPLE, k: int = 10,
                       seed: int = 0, batch_size: int = 64, workers: int = 1) -> dict[str, Any]:
    """``compare_embeddings`` of a seeded sample of the index's images: their stored vectors (the index's model)
    against the same files embedded by ``embedder``. Paths as the API shows them."""
    if int(sample) < 2:
        raise ParameterError("sample", f"must be >= 2 images, got {sample}")
    layout = IndexLayout(index_dir)
    layout.require_finished()
    info = layout.read_record()
    catalogue = CatalogueReader(layout.catalogue)
    try:
        done = catalogue.done_shards()
        ids = np.fromiter(done, np.int64, len(done))
        if len(ids) > sample:
            ids = np.sort(np.random.default_rng(seed).choice(ids, int(sample), replace=False))
        rows = catalogue.rows(ids.tolist())
        root = gallery_root(info, catalogue)
    finally:
        catalogue.close()
    place = gallery_place(info, root, layout.root)  # the files where they are now: the gallery may have moved
    files = {int(i): place.file(rows[int(i)]["path"]) for i in ids}
    embedded = RowEmbedder(embedder, batch_size, workers).embed([(i, file) for i, file in files.items()
                                                                  if file is not None])
    kept = embedded.ids  # files unreadable now are left out of both sides
    old = dict(_stored(ShardStore(layout.shards, read_only=True), {int(i): done[int(i)] for i in kept}))
    return compare_embeddings(np.stack([old[int(i)] for i in kept]), embedded.vectors,
                              [public_path(rows[int(i)]["path"], root) for i in kept],
                              [rows[int(i)]["label"] for i in kept], min(int(k), len(kept) - 1)) | {
        "old_model_hash": info.value_of("model_hash"), "new_model_hash": embedder.model_hash,
        "unreadable": len(ids) - len(kept)}


def compare_on_folder(images: str | Path, old: ImageEmbedder, new: ImageEmbedder, sample: int = DEFAULT_SAMPLE,
                      k: int = 10, seed: int = 0, batch_size: int = 64, workers: int = 1) -> dict[str, Any]:
    """``compare_embeddings`` of a seeded sample of any folder's images (labelled by their sub-folders, where they
    are in one) embedded by ``old`` (a baseline: the served model, or the pretrained backbone exported) and by
    ``new``. Paths relative to the folder."""
    from retrieval.index.sources import list_gallery

    if int(sample) < 2:
        raise ParameterError("sample", f"must be >= 2 images, got {sample}")
    gallery = list_gallery(images)
    items = sorted(gallery.items, key=lambda item: item.path)
    if len(items) > sample:
        chosen = np.sort(np.random.default_rng(seed).choice(len(items), int(sample), replace=False))
        items = [items[i] for i in chosen]
    if len(items) < 2:
        raise ParameterError("images", f"holds {len(items)} readable image(s) to compare; give a folder of at least 2")
    rows = [(n, item.path) for n, item in enumerate(items)]
    by_old, by_new = (RowEmbedder(model, batch_size, workers).embed(rows) for model in (old, new))
    kept = np.intersect1d(by_old.ids, by_new.ids)  # a file one model's preprocessing cannot read: out of both
    pick_old, pick_new = np.searchsorted(by_old.ids, kept), np.searchsorted(by_new.ids, kept)
    root = Path(gallery.root)
    paths = [Path(items[int(i)].path).relative_to(root).as_posix() if Path(items[int(i)].path).is_relative_to(root)
             else Path(items[int(i)].path).name for i in kept]
    return compare_embeddings(by_old.vectors[pick_old], by_new.vectors[pick_new], paths,
                              [items[int(i)].label for i in kept], min(int(k), len(kept) - 1)) | {
        "old_model_hash": old.model_hash, "new_model_hash": new.model_hash, "unreadable": len(items) - len(kept)}


def labelled_sample(catalogue: CatalogueQueries, limit: int = LABEL_SAMPLE, per_label: int = PER_LABEL,
                    seed: int = 0) -> list[tuple[int, str]]:
    """A seeded sample of up to ``limit`` indexed (id, label): whole labels drawn at random, up to ``per_label``
    images of each, among the labels with two images or more (a query needs another of its class to find). Reads
    the label counts and the chosen labels' rows only."""
    counts = {label: n for label, n in catalogue.label_counts().items() if label is not None and n >= 2}
    rng = np.random.default_rng(seed)
    names = sorted(counts)
    chosen, total = [], 0
    for i in rng.permutation(len(names)).tolist():
        take = min(counts[names[i]], per_label, limit - total)
        if take < 2:
            break
        chosen.append(names[i])
        total += take
    by_label: dict[str, list[int]] = {}
    for image_id, label in catalogue.labelled_with(chosen):
        by_label.setdefault(label, []).append(image_id)
    picked, left = [], limit
    for label in chosen:  # the drawn order: the last label takes what the limit leaves
        ids = by_label.get(label, [])
        take = min(len(ids), per_label, left)
        if take >= 2:
            picked += [(int(i), label) for i in rng.choice(ids, take, replace=False)]
            left -= take
    return sorted(picked)


def measure_on_labels(catalogue: CatalogueQueries, store: ShardStore, embedder: ImageEmbedder, cross: bool,
                      limit: int = LABEL_SAMPLE, seed: int = 0, batch_size: int = 64, workers: int = 1,
                      max_pixels: int = DEFAULT_MAX_PIXELS) -> dict[str, Any]:
    """How ``embedder`` would search the index against how its stored vectors do, on the index's own labels
    (``labelled_sample``; leave-one-out among the sample): Recall@1 and MAP@R of the stored vectors (``old``), of
    ``embedder``'s (``new``) and, with ``cross``, of ``embedder``'s queries against the stored vectors
    (``cross_model``: a compatible model serving the old gallery), each compared with ``old``
    (``compatibility.worse_on_labels``: ``compared``, ``worse``). Without labels to measure on: ``measured`` False
    and the ``reason``. Files unreadable now are left out of every side."""
    sample = labelled_sample(catalogue, limit, seed=seed)
    unmeasured = {"measured": False, "worse": False, "images": len(sample), "sample_limit": int(limit),
                  "seed": int(seed)}
    if not sample:
        return unmeasured | {"reason": "the index has no labels (no label has two images) to measure the models on"}
    labels = dict(sample)
    rows = catalogue.rows([i for i, _ in sample])
    embedded = RowEmbedder(embedder, batch_size, workers, max_pixels).embed(
        [(i, rows[i]["path"]) for i, _ in sample if i in rows])
    done = catalogue.shards_of(embedded.ids.tolist())
    stored = dict(_stored(store, done))
    kept = [i for i in embedded.ids.tolist() if i in stored]
    new = l2_normalize_rows(embedded.vectors[np.isin(embedded.ids, kept)], zero_rows="keep")
    old = l2_normalize_rows(np.stack([stored[i] for i in kept]), zero_rows="keep") if kept else \
        np.zeros((0, 1), np.float32)
    names = [labels[i] for i in kept]
    series = {"old": label_metrics_per_query(old, old, names), "new": label_metrics_per_query(new, new, names)}
    if cross:
        series["cross_model"] = label_metrics_per_query(new, old, names)
    if series["old"] is None:
        return unmeasured | {"images": len(kept), "reason": f"of the {len(sample)} labelled images sampled, "
                             f"{len(kept)} could be read, too few of one label to measure on"}
    compared = {name: worse_on_labels(series[name], series["old"]) for name in series if name != "old"}
    return {"measured": True, "images": len(kept), "labels": len(set(names)), "sample_limit": int(limit),
            "seed": int(seed), "unreadable": len(sample) - len(kept),
            **{name: {metric: float(values.mean()) for metric, values in per_query.items()}
               for name, per_query in series.items()},
            "compared": compared, "worse": any(check["worse"] for check in compared.values())}


def model_names(first: str | Path, second: str | Path, first_hash: str | None = None,
                second_hash: str | None = None) -> tuple[str, str]:
    """Names for a baseline and a new model file that tell them apart: the shortest differing path ends, else hashes."""
    a, b = Path(first).resolve(), Path(second).resolve()
    names = (a.name, b.name)
    # runs/a/model.onnx and runs/b/model.onnx: the parent folders differ, so "a/model.onnx" and "b/model.onnx"
    for n in range(1, max(len(a.parts), len(b.parts)) + 1):
        names = (Path(*a.parts[-n:]).as_posix(), Path(*b.parts[-n:]).as_posix())
        if names[0] != names[1]:
            return names
    if first_hash and second_hash and first_hash != second_hash:  # one path, a file rewritten since: the hashes
        width = next((w for w in range(8, len(first_hash) + 1) if first_hash[:w] != second_hash[:w]), len(first_hash))
        return f"{a.name} ({first_hash[:width]})", f"{b.name} ({second_hash[:width]})"
    return f"{a.name} (baseline)", f"{b.name} (new: the same file)"


def _stored(store: ShardStore, wanted: dict[int, str]):
    for chunk_ids, vectors in done_chunks(store, wanted):
        yield from zip(chunk_ids.tolist(), vectors, strict=True)
