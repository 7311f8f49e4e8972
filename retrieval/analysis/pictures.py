"""What people would rather look at than read: a grid of queries with their top-k results (right and wrong
marked), and a 2-D map of the embeddings coloured by class.

Plain functions over arrays (as faiss' contrib): the caller embeds, and gives a way to load the image of a row
(``eval_set_pictures`` gives them for an evaluation's data sets).
The map is UMAP (``umap-learn``) when it is installed and asked for, else t-SNE (scikit-learn); both are bounded
(``MAP_MAX_POINTS``, ``MAP_MAX_CLASSES``) so a large evaluation split costs seconds, not minutes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from retrieval.analysis.plain_text import plain_text

if TYPE_CHECKING:
    from retrieval.metrics.evaluation import EvalSets

RIGHT, WRONG = "#2ca02c", "#d62728"
GRID_QUERIES = 8  # rows of the grid: half whose top-1 is right, half wrong, where the split has both
GRID_K = 5
MAP_MAX_POINTS = 2000
MAP_MAX_CLASSES = 20  # colours a reader can tell apart; more classes: a seeded sample of them is drawn
MAP_METHODS = ("auto", "umap", "tsne")
# the PNG text chunk in which the map records what it shows (JSON: classes drawn and in all, images drawn and in
# all, method, seed), so that a page showing the picture can say so in words (serve.report_summary.embedding_map_note)
MAP_METADATA_KEY = "retrieval-map"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def pick_queries(correct: np.ndarray, count: int, seed: int = 0) -> np.ndarray:
    """Row indices of ``count`` queries: half (rounded up) whose top-1 is right, the rest wrong, topped up from
    the other kind when one runs short; seeded, in ascending order within each kind."""
    rng = np.random.default_rng(seed)
    right, wrong = np.flatnonzero(correct), np.flatnonzero(~correct)
    take_right = min(len(right), max(count - len(wrong), (count + 1) // 2))
    take_wrong = min(len(wrong), count - take_right)
    chosen = [np.sort(rng.choice(right, take_right, replace=False)), np.sort(rng.choice(wrong, take_wrong,
                                                                                        replace=False))]
    return np.concatenate(chosen).astype(np.int64)


def grid_rows(query: np.ndarray, query_labels: np.ndarray, gallery: np.ndarray | None = None,
              gallery_labels: np.ndarray | None = None, queries: int = GRID_QUERIES, k: int = GRID_K,
              seed: int = 0) -> tuple[list[tuple[int, list[tuple[int, bool]]]], float]:
    """What the grid shows: [(query row, [(gallery row, same class?) for its top k])] for the picked queries, and
    the share of all queries whose top-1 is right. ``gallery`` None: leave-one-out in the query set."""
    from retrieval.metrics import knn

    leave_one_out = gallery is None
    gallery, gallery_labels = (query, query_labels) if leave_one_out else (gallery, gallery_labels)
    k = min(k, len(gallery) - int(leave_one_out))
    if len(query) == 0 or k < 1:
        return [], 0.0
    _, neighbours = knn(query, gallery, k=k, exclude_self=leave_one_out)
    same = gallery_labels[neighbours] == query_labels[:, None]
    rows = pick_queries(same[:, 0], min(queries, len(query)), seed)
    return ([(int(r), [(int(h), bool(s)) for h, s in zip(neighbours[r], same[r], strict=True)]) for r in rows],
            float(same[:, 0].mean()))


def plot_retrieval_grid(query: np.ndarray, query_labels: np.ndarray, load_query: Callable[[int], Image.Image],
                        path: Path, gallery: np.ndarray | None = None, gallery_labels: np.ndarray | None = None,
                        load_gallery: Callable[[int], Image.Image] | None = None,
                        label_names: Callable[[int], str] = str, queries: int = GRID_QUERIES, k: int = GRID_K,
                        seed: int = 0) -> Path | None:
    """One PNG: a row per query (its image, then its top ``k`` results, a green frame where the label matches, a
    red one where not; ``grid_rows``). ``load_*(row)`` gives the image of an embedding row. None when there is
    nothing to draw."""
    leave_one_out = gallery is None
    rows, top1 = grid_rows(query, query_labels, gallery, gallery_labels, queries, k, seed)
    if not rows:
        return None
    gallery_labels, load_gallery = (query_labels, load_query) if leave_one_out else (gallery_labels, load_gallery)
    width = len(rows[0][1])
    shown = sum(hits[0][1] for _, hits in rows)
    with plain_text():
        plt = _pyplot()
        fig, axes = plt.subplots(len(rows), width + 1, figsize=(1.6 * (width + 1), 1.75 * len(rows)), squeeze=False)
        for r, (row, hits) in enumerate(rows):
            _tile(axes[r][0], load_query(row), f"query\n{label_names(int(query_labels[row]))}", "#444444")
            for c, (hit, same) in enumerate(hits, start=1):
                _tile(axes[r][c], load_gallery(hit),
                      f"{'✓' if same else '✗'} {c}: {label_names(int(gallery_labels[hit]))}", RIGHT if same else WRONG)
        fig.suptitle(f"Queries and their top {width} ({'leave-one-out, ' if leave_one_out else ''}green = same "
                     f"class, red = another); {shown} of {len(rows)} shown have a right top-1, {top1:.1%} of all "
                     f"{len(query)} queries", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
    return path


def _tile(ax, image: Image.Image, title: str, colour: str) -> None:
    image = image.convert("RGB")
    image.thumbnail((128, 128))
    ax.imshow(np.asarray(image))
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_edgecolor(colour)
        spine.set_linewidth(3)
    ax.set_title(title[:28], fontsize=7, color=colour)


def map_method(method: str = "auto") -> str:
    """The 2-D map's method: "umap" when asked for (or "auto" and umap-learn is installed), else "tsne"."""
    if method not in MAP_METHODS:
        raise ValueError(f"the embedding map's method must be one of {', '.join(MAP_METHODS)}, got {method!r}")
    if method == "tsne":
        return "tsne"
    try:
        import umap  # noqa: F401
    except ImportError:
        if method == "umap":
            raise ValueError("the UMAP map needs umap-learn: pip install umap-learn, or use the t-SNE map") from None
        return "tsne"
    return "umap"


def map_sample(labels: np.ndarray, seed: int = 0, max_points: int = MAP_MAX_POINTS,
               max_classes: int = MAP_MAX_CLASSES) -> np.ndarray:
    """The rows the map draws: every row of at most ``max_classes`` classes (a seeded sample of them), at most
    ``max_points`` rows (a seeded sample), in ascending order."""
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    if len(classes) > max_classes:
        classes = rng.choice(classes, max_classes, replace=False)
    rows = np.flatnonzero(np.isin(labels, classes))
    if len(rows) > max_points:
        rows = rng.choice(rows, max_points, replace=False)
    return np.sort(rows)


def embed_2d(embeddings: np.ndarray, method: str, seed: int = 0) -> np.ndarray:
    """[n, 2] coordinates of ``embeddings`` (cosine geometry: rows L2-normalised first)."""
    x = embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
    if method == "umap":
        import umap

        return umap.UMAP(n_components=2, metric="cosine", random_state=seed).fit_transform(x)
    from sklearn.manifold import TSNE

    perplexity = float(min(30.0, max(2.0, (len(x) - 1) / 3)))
    return TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=seed).fit_transform(x)


def plot_embedding_map(embeddings: np.ndarray, labels: np.ndarray, path: Path,
                       label_names: Callable[[int], str] = str, method: str = "auto", seed: int = 0) -> Path | None:
    """One PNG: the embeddings in 2-D (UMAP or t-SNE), one colour per class; None with fewer than 5 rows."""
    rows = map_sample(labels, seed)
    if len(rows) < 5:
        return None
    chosen = map_method(method)
    points = embed_2d(embeddings[rows], chosen, seed)
    classes = np.unique(labels[rows])
    total = len(np.unique(labels))
    facts = {"classes_shown": int(len(classes)), "classes": int(total), "images_shown": int(len(rows)),
             "images": int(len(labels)), "method": "UMAP" if chosen == "umap" else "t-SNE", "seed": int(seed)}
    sampled = f"{len(classes)} of {total} classes, " if len(classes) < total else ""
    with plain_text():
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(6.4, 5.2))
        colours = plt.get_cmap("tab20")(np.linspace(0, 1, max(len(classes), 2)))
        for colour, cls in zip(colours, classes, strict=False):
            mask = labels[rows] == cls
            ax.scatter(points[mask, 0], points[mask, 1], s=9, color=colour, label=label_names(int(cls))[:24])
        ax.set(title=f"{facts['method']} of the test embeddings ({sampled}{len(rows)} images)", xticks=[], yticks=[])
        ax.title.set_fontsize(9)
        if len(classes) <= MAP_MAX_CLASSES:
            ax.legend(fontsize=6, markerscale=1.5, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
        fig.tight_layout()
        fig.savefig(path, dpi=100, metadata={MAP_METADATA_KEY: json.dumps(facts)})
        plt.close(fig)
    return path


def draw_evaluation_pictures(folder: Path, query: np.ndarray, query_labels: np.ndarray,
                             load_query: Callable[[int], Image.Image], gallery: np.ndarray | None = None,
                             gallery_labels: np.ndarray | None = None,
                             load_gallery: Callable[[int], Image.Image] | None = None,
                             label_names: Callable[[int], str] = str, seed: int = 0,
                             method: str = "auto") -> dict[str, str]:
    """The query grid (retrieval.png) and the embedding map (embedding_map.png) of an evaluation, drawn into
    ``folder``; returns the report's plot names of those drawn."""
    plots = {}
    if plot_retrieval_grid(query, query_labels, load_query, folder / "retrieval.png", gallery, gallery_labels,
                           load_gallery, label_names, seed=seed):
        plots["retrieval"] = "retrieval.png"
    if plot_embedding_map(query, query_labels, folder / "embedding_map.png", label_names, method, seed):
        plots["embedding_map"] = "embedding_map.png"
    return plots


def eval_set_pictures(folder: Path, sets: EvalSets, embedded: tuple, query_rows: np.ndarray,
                      gallery_rows: np.ndarray | None, seed: int = 0, method: str = "auto") -> dict[str, str]:
    """The query grid and the embedding map of an evaluation (``embedded`` = (query, query_labels, gallery,
    gallery_labels), whose rows are the data sets' positions ``query_rows`` / ``gallery_rows``), drawn into
    ``folder``; returns the report's plot names."""
    from retrieval.metrics.evaluation import class_names, row_loader  # torch: only where an evaluation draws

    q, ql, g, gl = embedded
    names = class_names(sets.query)
    return draw_evaluation_pictures(
        folder, q, ql, row_loader(sets.query, query_rows), g, gl,
        row_loader(sets.gallery, gallery_rows) if sets.gallery is not None else None,
        lambda label: names[label], seed=seed, method=method)
