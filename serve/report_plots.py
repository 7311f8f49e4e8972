"""A run report's pictures for the Evaluation tab, and the results grid's curves: drawn here (Recall@K, the training
curves) or opened from the run's folder as training drew them.

Each line has its own marker and line style so that lines lying on top of each other (MAP@R = Recall@1 when each
query has one relevant item) stay visible.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from retrieval.analysis.plain_text import cut_long_texts, plain_text
from retrieval.reports import read_steps
from retrieval.serve.page_text import METRIC_UNIT, percent
from retrieval.serve.report_files import VALIDATION_KEY, RunReport, flat_metrics, is_number, number_at, recall_k

# (marker, line style) per line: overlapping lines stay distinguishable, in colour and in grey
LINE_STYLES = (("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."), ("v", (0, (5, 1))), ("P", (0, (3, 1, 1, 1))))


def _figure(width: float, height: float, panels: int = 1):
    """A matplotlib figure without pyplot (no figure manager shared between Gradio's worker threads), its axes."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height))
    axes = figure.subplots(1, panels, squeeze=False)[0]
    return figure, list(axes)


def _image(figure) -> Image.Image:
    """The figure as an RGB picture."""
    cut_long_texts(figure)  # model, set and block names: never a picture stretched by one
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight", pad_inches=0.15)
    buffer.seek(0)
    with Image.open(buffer) as image:
        return image.convert("RGB")


def _lines(ax, series: dict[str, tuple[Sequence[float], Sequence[float]]]) -> None:
    """One line per series, each with its own marker and line style, and a legend."""
    for i, (name, (xs, ys)) in enumerate(series.items()):
        marker, style = LINE_STYLES[i % len(LINE_STYLES)]
        marker = marker if len(xs) <= 60 else None  # a per-step curve: a line, not thousands of markers
        ax.plot(xs, ys, marker=marker, linestyle=style, markersize=6 - (i % 3), linewidth=1.6, label=name,
                markerfacecolor="none" if i % 2 else None)
    if series:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _open(path: Path | None) -> Image.Image | None:
    """A picture of the run's folder as RGB; None without one."""
    if path is None:
        return None
    with Image.open(path) as image:
        return image.convert("RGB")


@plain_text()  # model, set and block names in legends and titles: drawn as written, one picture at a time
def recall_plot(report: RunReport) -> Image.Image | None:
    """Recall@K (%) against K, one line per model (the start, best, last; or the evaluated one)."""
    series = {}
    for name, values in report.metric_columns().items():
        points = sorted((recall_k(k), percent(v)) for k, v in values.items() if recall_k(k) is not None and
                        is_number(v))
        if points:
            series[name] = ([k for k, _ in points], [y for _, y in points])
    if not series:
        return None
    figure, (ax,) = _figure(5.8, 3.9)
    _lines(ax, series)
    for i, (xs, ys) in enumerate(series.values()):
        offset = (0, -13) if i == 0 and len(series) > 1 else (0, 6)  # first line's numbers below its points
        for x, y in zip(xs, ys, strict=True):
            ax.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=offset, ha="center", fontsize=7)
    ks = sorted({k for xs, _ in series.values() for k in xs})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set(xlabel="K", ylabel=f"Recall@K ({METRIC_UNIT})", ylim=(0, 105), title="Recall@K on the test split")
    return _image(figure)


Series = dict[str, tuple[list[float], list[float]]]  # name -> (epochs, values)


def curve_panels(history: list[dict[str, Any]], steps: list[dict[str, Any]] | None = None
                 ) -> list[tuple[str, str, Series]]:
    """The training curves' panels from metrics.jsonl's rows, (title, unit, series), only for what the rows hold:
    the loss (per step too, where ``steps`` has it); the evaluation metrics (%): the test split where it was
    measured, the validation classes (``validation: recall@1``, every epoch where best.pt is chosen on them) and each
    --eval-extra set; the hard-triplet share (%)."""
    history = [r for r in history if isinstance(r, dict) and number_at(r, "epoch")]  # a row's x: its epoch
    trained = [r for r in history if r["epoch"] > 0 and number_at(r, "loss")]
    if not trained:
        return []
    steps = [r for r in steps or [] if isinstance(r, dict) and number_at(r, "epoch") and number_at(r, "loss")]
    rows = [flat_metrics(r) for r in history]
    extra = sorted({k for r in rows for k in r if k.endswith(": recall@1") and not k.startswith(VALIDATION_KEY)})
    losses = {"loss": ([r["epoch"] for r in trained], [r["loss"] for r in trained])}
    if steps:  # per optimizer step, each at its place in its epoch
        losses = {"loss per step": ([r["epoch"] for r in steps], [r["loss"] for r in steps]),
                  "epoch mean": losses["loss"]}
    panels = [("training loss", "", losses)]
    validation = (f"{VALIDATION_KEY}: recall@1", f"{VALIDATION_KEY}: map@r")
    for title, keys in (("evaluation (epoch 0 = before training)", ("recall@1", "map@r", "nmi", *validation, *extra)),
                        ("hard triplets (S_an > S_ap)", ("hard_fraction_train", "hard_fraction_test"))):
        series = {key: ([r["epoch"] for r in rows if number_at(r, key)],
                        [percent(r[key]) for r in rows if number_at(r, key)])
                  for key in keys if any(number_at(r, key) for r in rows)}
        if series:  # a panel only for what the log has
            panels.append((title, METRIC_UNIT, series))
    return panels


@plain_text()
def curves_plot(report: RunReport) -> Image.Image | None:
    """Training curves from metrics.jsonl: loss, evaluation metrics (%) and hard-triplet share (%) per epoch
    (``curve_panels``)."""
    panels = curve_panels(report.history(), read_steps(report.folder))
    if not panels:
        return None
    from matplotlib.ticker import MaxNLocator

    figure, axes = _figure(4.5 * len(panels), 3.8, len(panels))
    for ax, (title, unit, series) in zip(axes, panels, strict=True):
        _lines(ax, series)
        ax.set(title=title, xlabel="epoch", ylabel=unit)
        if unit:
            ax.set_ylim(0, 100)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    cut_long_texts(figure)  # before the layout: a long name would stretch it
    figure.tight_layout()
    return _image(figure)


def triplet_plot(report: RunReport) -> Image.Image | None:
    """The run's triplet diagram of the test split, else of the train split, as the training drew it."""
    return _open(report.plot_file("triplet_test") or report.plot_file("triplet_train"))


def domains_plot(report: RunReport) -> Image.Image | None:
    """The run's in-domain vs out-of-domain Recall@1 per epoch (--eval-extra), as the training drew it."""
    return _open(report.plot_file("domains"))


def compatibility_plot(report: RunReport) -> Image.Image | None:
    """--compatible-with: Recall@1 per epoch of new/new, new queries against the old gallery, and old/old."""
    return _open(report.plot_file("compatibility"))


def wise_plot(report: RunReport) -> Image.Image | None:
    """The run's WiSE-FT curve: validation Recall@1 against the mixing weight (--wise-alpha)."""
    return _open(report.plot_file("wise"))


def moved_plot(report: RunReport) -> Image.Image | None:
    """A run without labels: the images whose neighbourhood moved most, with their neighbours before and after."""
    return _open(report.plot_file("moved"))


def pseudo_labels_plot(report: RunReport) -> Image.Image | None:
    """A run without labels: the pseudo-labels' group sizes and their stability, epoch by epoch."""
    return _open(report.plot_file("pseudo_labels"))


def retrieval_plot(report: RunReport) -> Image.Image | None:
    """Queries of the evaluation with their top 5, right and wrong marked, as the run or evaluation drew them."""
    return _open(report.plot_file("retrieval"))


def embedding_map_plot(report: RunReport) -> Image.Image | None:
    """The evaluation's embeddings in 2-D (UMAP or t-SNE), coloured by class."""
    return _open(report.plot_file("embedding_map"))


# --- the results grid (retrieval results run) -----------------------------------------------------------------
@plain_text()
def results_curve_image(results: dict[str, Any], table_id: str) -> Image.Image | None:
    """The per-epoch curve figure of one table (e.g. SCT Figure 6) in percent; None when it has none."""
    curve = next((c for c in results.get("curves", []) if c.get("id") == table_id), None)
    if curve is None or not curve.get("series"):
        return None
    from matplotlib.ticker import MaxNLocator

    blocks = curve["series"]
    figure, axes = _figure(5.8 * len(blocks), 4.2, len(blocks))
    for ax, (block, lines) in zip(axes, blocks.items(), strict=True):
        _lines(ax, {label: (range(1, len(ys) + 1), [percent(y) for y in ys]) for label, ys in lines.items()})
        ax.set(title=block, xlabel="epoch", ylabel=f"{curve.get('ylabel', '')} ({METRIC_UNIT})", ylim=(0, None))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.suptitle(curve.get("title", ""))
    cut_long_texts(figure)  # before the layout: a long name would stretch it
    figure.tight_layout()
    return _image(figure)
