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

from retrieval.compatibility import neighbour_overlap, top_k
from retrieval.errors import ParameterError
from retrieval.index.catalogue_reader import CatalogueReader
from retrieval.index.embedding.embed_rows import RowEmbedder
from retrieval.index.layout import IndexLayout
from retrieval.index.portable import gallery_place
from retrieval.index.query_embedder import ImageEmbedder
from retrieval.index.search import gallery_root, public_path
from retrieval.index.shards import ShardStore
from retrieval.index.vectors import done_chunks

DEFAULT_SAMPLE = 2000  # gallery images compared: exact kNN among them costs sample^2 x d per model
MOST_CHANGED = 10


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
    info = layout.read_info()
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
        "old_model_hash": info["model_hash"], "new_model_hash": embedder.model_hash,
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
