"""PNG figures: the triplet diagram (SCT paper, Fig. 1) and weight vs similarity (unified paper, Fig. 1).

matplotlib runs on the Agg backend (files only, no display needed); figures are closed after saving.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from retrieval.analysis.plain_text import cut_long_texts, plain_text
from retrieval.analysis.triplet_diagram import TripletDiagram

HARD_COLOUR = "tab:red"
EASY_COLOUR = "tab:blue"
POSITIVE_PAIR_COLOUR = "tab:green"  # unified paper Fig. 1: positives solid green, negatives dotted blue
NEGATIVE_PAIR_COLOUR = "tab:blue"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cut_long_texts(fig)  # a run's or a results file's titles and names
    fig.savefig(path, dpi=120, bbox_inches="tight")
    _pyplot().close(fig)
    return path


@plain_text()
def plot_triplet_diagram(diagram: TripletDiagram, path: str | Path, title: str | None = None) -> Path:
    """Scatter S_an (y) against S_ap (x): red above the diagonal (hard), blue below (easy)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 5.5))
    hard = diagram.hard
    size = 12 if len(diagram) < 2000 else 4
    ax.scatter(diagram.s_ap[~hard], diagram.s_an[~hard], s=size, c=EASY_COLOUR, alpha=0.6, label="easy")
    ax.scatter(
        diagram.s_ap[hard],
        diagram.s_an[hard],
        s=size,
        c=HARD_COLOUR,
        alpha=0.6,
        label="hard ($S_{an} > S_{ap}$)",
    )
    ax.plot([-1, 1], [-1, 1], color="black", linewidth=1)
    ax.set(
        xlim=(-1, 1),
        ylim=(-1, 1),
        aspect="equal",
    )
    # the axes' and the legend's formulas are the diagram's own (no label in them): drawn as maths
    ax.set_xlabel("$S_{ap}$ (anchor-positive similarity)", parse_math=True)
    ax.set_ylabel("$S_{an}$ (anchor-negative similarity)", parse_math=True)
    heading = f"hard triplets: {100 * diagram.hard_fraction:.1f}% of {len(diagram)}"
    ax.set_title(f"{title}\n{heading}" if title else heading)
    for text in ax.legend(loc="lower right", fontsize=8).get_texts():
        text.set_parse_math(True)
    ax.grid(alpha=0.3)
    return _save(fig, path)


@plain_text()
def plot_pair_weights(
    similarity: torch.Tensor | np.ndarray,
    weights: torch.Tensor | np.ndarray,
    labels: torch.Tensor | np.ndarray,
    path: str | Path,
    title: str | None = None,
) -> Path:
    """Weight of every pair (i, j), i != j, against its cosine similarity; positives and negatives in two
    colours, as the unified paper's Figure 1 (S, W as returned by ``retrieval.losses.pair_weights``)."""
    s, w, y = _numpy(similarity), _numpy(weights), _numpy(labels)
    if s.ndim != 2 or s.shape[0] != s.shape[1] or w.shape != s.shape or y.shape != s.shape[:1]:
        raise ValueError(f"expected S and W [B, B] and labels [B], got {s.shape}, {w.shape} and {y.shape}")
    off_diagonal = ~np.eye(len(y), dtype=bool)
    same = (y[:, None] == y[None, :]) & off_diagonal
    different = y[:, None] != y[None, :]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.scatter(
        s[different],
        w[different],
        s=6,
        c=NEGATIVE_PAIR_COLOUR,
        alpha=0.4,
        marker="x",
        label=f"negative pairs ({int(different.sum())})",
    )
    ax.scatter(
        s[same], w[same], s=10, c=POSITIVE_PAIR_COLOUR, alpha=0.7, label=f"positive pairs ({int(same.sum())})"
    )
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_xlim(-1, 1)
    ax.set_xlabel("cosine similarity $S_{ij}$", parse_math=True)  # the plot's own formulas: maths on purpose
    ax.set_ylabel("weight $w_{ij}$", parse_math=True)
    nonzero = float((w[off_diagonal] != 0).mean()) if off_diagonal.any() else 0.0
    heading = f"pairs with non-zero weight: {100 * nonzero:.1f}%"
    ax.set_title(f"{title}\n{heading}" if title else heading)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)
