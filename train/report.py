"""The run report: report.json plus the pictures people would rather look at than read."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.analysis.plain_text import cut_long_texts, plain_text
from retrieval.compatibility import KEPT
from retrieval.records.run_config import RunFolderConfig
from retrieval.reports import read_steps, save_report, train_report


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@plain_text()  # data set, run and model names in legends and titles: drawn as written
def plot_training_curves(history: list[dict[str, Any]], path: Path,
                         steps: list[dict[str, float]] | None = None) -> Path | None:
    """Loss (per optimizer step when ``steps`` has them, else per epoch), evaluation metrics and hard-triplet
    shares against the epoch."""
    trained = [r for r in history if r.get("epoch", 0) > 0 and "loss" in r]
    if not trained:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    epochs = [r["epoch"] for r in trained]
    if steps:  # each step at its place in its epoch (1.5: half-way through the second); the epoch means on top
        axes[0].plot([r["epoch"] for r in steps], [r["loss"] for r in steps], "-", color="tab:purple", alpha=0.45,
                     linewidth=0.8, label="each step")
    axes[0].plot(epochs, [r["loss"] for r in trained], "o-", color="tab:purple", label="epoch mean")
    axes[0].set(title="training loss", xlabel="epoch")
    if steps:
        axes[0].legend(fontsize=8)
    evals = [r for r in history if "recall@1" in r]
    for key, color in (("recall@1", "tab:blue"), ("map@r", "tab:orange"), ("nmi", "tab:green")):
        if evals and key in evals[0]:
            axes[1].plot([r["epoch"] for r in evals], [r[key] for r in evals], "o-", label=key, color=color)
    validated = [r for r in history if "recall@1" in (r.get("validation") or {})]
    for key, color in (("recall@1", "tab:blue"), ("map@r", "tab:orange")):  # what best.pt is chosen on
        if validated and key in validated[0]["validation"]:
            axes[1].plot([r["epoch"] for r in validated], [r["validation"][key] for r in validated], "s--",
                         label=f"validation {key}", color=color, alpha=0.7)
    kept = [r for r in history if KEPT in r]  # without labels: the neighbours kept from the start
    if kept:
        axes[1].plot([r["epoch"] for r in kept], [r[KEPT] for r in kept], "^:", label=f"{KEPT} (no labels)",
                     color="tab:gray")
    grouped = [r for r in history if "stability" in (r.get("pseudo_labels") or {})]
    if grouped:
        axes[1].plot([r["epoch"] for r in grouped], [r["pseudo_labels"]["stability"] for r in grouped], "d--",
                     label="pseudo-label stability (ARI)", color="tab:brown")
    axes[1].set(title="evaluation (epoch 0 = before training)", xlabel="epoch", ylim=(0, 1))
    if axes[1].lines:
        axes[1].legend()
    for key, color in (("hard_fraction_train", "tab:red"), ("hard_fraction_test", "tab:gray")):
        rows = [r for r in history if key in r]
        if rows:
            axes[2].plot([r["epoch"] for r in rows], [r[key] for r in rows], "o-", label=key, color=color)
    axes[2].set(title="fraction of hard triplets (S_an > S_ap)", xlabel="epoch", ylim=(0, 1))
    if axes[2].lines:
        axes[2].legend()
    cut_long_texts(fig)  # model and set names
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@plain_text()
def plot_recall_at_k(curves: dict[str, dict[str, float]], path: Path) -> Path | None:
    """Recall@K lines, one per model (e.g. pretrained-only vs trained)."""
    curves = {name: m for name, m in curves.items() if any(key.startswith("recall@") for key in m)}
    if not curves:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ks: list[int] = []
    for i, (name, metrics) in enumerate(curves.items()):
        ks = sorted(int(k.split("@")[1]) for k in metrics if k.startswith("recall@"))
        values = [metrics[f"recall@{k}"] for k in ks]
        ax.plot(ks, values, "o-", label=name)
        offset = (0, -13) if i == 0 and len(curves) > 1 else (0, 6)  # first curve's labels below its points
        for k, v in zip(ks, values, strict=True):
            ax.annotate(f"{v:.3f}", (k, v), textcoords="offset points", xytext=offset, ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set(xlabel="K", ylabel="Recall@K", ylim=(0, 1.05), title="Recall@K on the test split")
    ax.legend()
    cut_long_texts(fig)  # model and set names
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@plain_text()
def plot_domains(history: list[dict[str, Any]], reference: dict[str, Any] | None, path: Path) -> Path | None:
    """Recall@1 per epoch on the test split and on each --eval-extra set, with the pretrained backbone at its own
    resolution as a dotted line: the in-domain gain and the out-of-domain change side by side."""
    evals = [r for r in history if "recall@1" in r and r.get("extra")]
    if not evals:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.2, 3.9))
    epochs = [r["epoch"] for r in evals]
    ax.plot(epochs, [r["recall@1"] for r in evals], "o-", color="tab:blue", label="test split (in domain)")
    colors = ("tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
    for i, name in enumerate(evals[-1]["extra"]):
        color = colors[i % len(colors)]
        rows = [r for r in evals if name in r["extra"]]
        ax.plot([r["epoch"] for r in rows], [r["extra"][name]["recall@1"] for r in rows], "s--", color=color,
                label=f"{name} (out of domain)")
        ref = ((reference or {}).get("sets") or {}).get(name, {}).get("test")
        if ref:
            ax.axhline(ref["recall@1"], color=color, linestyle=":", linewidth=1.2,
                       label=f"{name}: pretrained backbone at {reference['input_size']} px")
    return _save_per_epoch(plt, fig, ax, "Recall@1 in and out of domain", path)


def _save_per_epoch(plt: Any, fig: Any, ax: Any, title: str, path: Path) -> Path:
    """Finish a plot of Recall@1 against the epoch (whole epochs, 0 = before training) and save it."""
    from matplotlib.ticker import MaxNLocator

    ax.set(title=title, xlabel="epoch (0 = before training)", ylabel="Recall@1", ylim=(0, 1.03))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=7)
    cut_long_texts(fig)  # model and set names
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@plain_text()
def plot_compatibility(history: list[dict[str, Any]], path: Path) -> Path | None:
    """--compatible-with: Recall@1 per epoch of the new model on its own, of the old model on its own and of new
    queries against the old model's gallery (BCT's cross-model test, with its bootstrap intervals where the run
    has them); the title gives the last evaluation's verdict."""
    evals = [r for r in history if (r.get("compatibility") or {}).get("cross_model")]
    if not evals:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.2, 3.9))
    epochs = [r["epoch"] for r in evals]
    for block, label, style in (("new", "new / new", "o-"), ("cross_model", "new queries / old gallery", "s-"),
                                ("old", "old / old (the bar to clear)", "k:")):
        values = [r["compatibility"][block]["recall@1"] for r in evals]
        line = ax.plot(epochs, values, style, label=label)[0]
        bounds = [((r["compatibility"].get("interval") or {}).get(block) or {}).get("recall@1") for r in evals]
        if block != "new" and all(bounds):  # the intervals the verdict reads (a run before them has none)
            ax.fill_between(epochs, [b[0] for b in bounds], [b[1] for b in bounds], color=line.get_color(),
                            alpha=0.15, linewidth=0)
    verdict = evals[-1]["compatibility"].get("verdict")
    title = (f"Compatibility with the old model: {verdict}" if verdict
             else "Compatibility with the old model (BCT: cross-model >= old/old)")
    return _save_per_epoch(plt, fig, ax, title, path)


@plain_text()
def plot_wise(wise: dict[str, Any] | None, path: Path) -> Path | None:
    """WiSE-FT: validation Recall@1 in and out of domain against the mixing weight alpha, the alpha taken marked."""
    curve = (wise or {}).get("curve") or []
    if not curve:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    alphas = [p["alpha"] for p in curve]
    for key, label, style in (("in_domain", "in domain (validation, held out of train)", "o-"),
                              ("out_of_domain", "out of domain (extra sets' val part)", "s--"),
                              ("kept", "neighbours kept from alpha 0 (extra sets' val part, no labels)", "^:")):
        if all(p.get(key) is not None for p in curve):
            ax.plot(alphas, [p[key] for p in curve], style, label=label)
    ax.axvline(wise["alpha"], color="gray", linestyle=":", label=f"alpha taken: {wise['alpha']:g} ({wise['chosen']})")
    ax.set(title="WiSE-FT: (1 - alpha) start + alpha fine-tuned", xlabel="alpha (0 = start, 1 = fine-tuned)",
           ylabel="validation Recall@1 (neighbours kept: share)", ylim=(0, 1.03))
    ax.legend(fontsize=7)
    cut_long_texts(fig)  # model and set names
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@plain_text()
def plot_pseudo_labels(groups: list[dict[str, Any]], path: Path) -> Path | None:
    """Training without labels: the last epoch's group sizes (groups of each size, singletons in "1"), and the
    groups, the share of images in them and their stability, epoch by epoch."""
    if not groups:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    buckets = groups[-1].get("size_histogram") or []
    bars = axes[0].bar([str(label) for label, _ in buckets], [count for _, count in buckets], color="tab:blue")
    axes[0].bar_label(bars, fontsize=8)  # counts over bars: singletons outnumber the rest by far, read them
    axes[0].set(title=f"group sizes, epoch {groups[-1]['epoch']}", xlabel="images in a group", ylabel="groups")
    epochs = [g["epoch"] for g in groups]
    axes[1].plot(epochs, [g["clustered_share"] for g in groups], "o-", label="share of images in a group")
    axes[1].plot(epochs, [g["largest_share"] for g in groups], "s--", label="share in the largest group")
    stable = [g for g in groups if "stability" in g]
    if stable:
        axes[1].plot([g["epoch"] for g in stable], [g["stability"] for g in stable], "d:",
                     label="stability (ARI with the epoch before)")
    axes[1].set(title="pseudo-labels, epoch by epoch", xlabel="epoch", ylim=(-0.05, 1.05))
    axes[1].xaxis.get_major_locator().set_params(integer=True)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def triplet_plots(out: Path, test: tuple[np.ndarray, np.ndarray], train_sample) -> dict[str, str]:
    try:
        from retrieval.analysis.plots import plot_triplet_diagram
        from retrieval.analysis.triplet_diagram import triplet_diagram
    except ImportError:
        return {}
    plots = {}
    for split, data in (("test", test), ("train", train_sample)):
        if data is None:
            continue
        path = out / f"triplet_{split}.png"
        plot_triplet_diagram(triplet_diagram(*data), path, title=f"triplet diagram ({split})")
        plots[f"triplet_{split}"] = path.name
    return plots


def write_report(
    out: Path,
    run_config: RunFolderConfig,
    history: list[dict[str, Any]],
    baseline: dict[str, float] | None,
    best: dict[str, Any] | None,
    last: dict[str, Any] | None,
    test_embeddings: tuple[np.ndarray, np.ndarray] | None,
    train_sample: tuple[np.ndarray, np.ndarray] | None,
    bad_images: list[dict[str, Any]] | None = None,
    with_plots: bool = True,
    reference: dict[str, Any] | None = None,
    wise: dict[str, Any] | None = None,
    pictures: Callable[[], dict[str, str]] | None = None,
    class_split: dict[str, Any] | None = None,
    best_metric: str = "recall@1",
    selection: dict[str, Any] | None = None,
    label_free: dict[str, Any] | None = None,
    pretrained: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write RUN_DIR/report.json and its plots (``with_plots``); ``bad_images`` lists the files the run skipped,
    each once; ``pictures()`` draws more plots into the run folder and returns their names; ``selection``: the
    split best was chosen on (``selected_on``, ``selection_note``); ``pretrained``: top-level keys of the pretrained
    export's measurement (``pretrained_export``, ``keep_pretrained``...)."""
    plots: dict[str, str] = {}
    if with_plots and plot_training_curves(history, out / "curves.png", read_steps(out)):
        plots["curves"] = "curves.png"
    if with_plots and plot_recall_at_k({"pretrained only": baseline or {}, "trained (last)": last or {}},
                                       out / "recall.png"):
        plots["recall"] = "recall.png"
    if with_plots and plot_domains(history, reference, out / "domains.png"):
        plots["domains"] = "domains.png"
    if with_plots and plot_wise(wise, out / "wise.png"):
        plots["wise"] = "wise.png"
    if with_plots and plot_compatibility(history, out / "compatibility.png"):
        plots["compatibility"] = "compatibility.png"
    if with_plots and test_embeddings is not None:
        plots.update(triplet_plots(out, test_embeddings, train_sample))
    if label_free and label_free.get("picture"):
        plots["moved"] = label_free["picture"]
    if with_plots and label_free and plot_pseudo_labels(label_free.get("groups") or [], out / "pseudo_labels.png"):
        plots["pseudo_labels"] = "pseudo_labels.png"
    if with_plots and pictures is not None:
        plots.update(pictures())
    report = {**train_report(run_config, history, baseline, best, last, plots, bad_images, reference, wise,
                             class_split, best_metric, selection, label_free), **(pretrained or {})}
    save_report(report, out / "report.json")
    return report
