"""The results grid (``retrieval results run``) as data: aggregation, Markdown tables and the hard-fraction plot.

One JSON document (format ``retrieval-results/1``) is written by the grid and read by ``docs/RESULTS.md`` and by
the app's Results tab, so both show the same numbers. Shape::

    {"format": "retrieval-results/1", "setup": {...}, "complete": bool, "wall_time_s": float,
     "tables": [{"id", "title", "claim", "caveats", "discussion": [str], "columns": [{"key", "label"}],
                 "blocks": [{"title", "rows": [{"label", "floor": bool, "command": str,
                                                 "cells": {column_key: {"mean", "std", "n"}}}]}]}],
     "curves": [{"title", "ylabel", "series": {block_title: {row_label: [y per epoch]}}}]}

Values are fractions in [0, 1]; tables show them as percentages (mean ± standard deviation over seeds), the
best mean of each column within a block in bold (the pretrained-only floor row is not a candidate).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from retrieval.analysis.plain_text import plain_text

RESULTS_FORMAT = "retrieval-results/1"
RESULTS_COMMAND = "retrieval results run"  # runs the grid and writes the document (retrieval.cli.results)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """{"mean", "std" (sample standard deviation, 0 for one value), "n"} of the per-seed values."""
    n = len(values)
    if n == 0:
        return {"mean": math.nan, "std": math.nan, "n": 0}
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "n": n}


def difference(a: dict[str, float], b: dict[str, float]) -> tuple[float, bool]:
    """(mean of a - mean of b, whether it exceeds two standard errors of the difference). With fewer than two
    seeds on either side the noise is unknown, so no difference counts as clear."""
    delta = a["mean"] - b["mean"]
    if a["n"] < 2 or b["n"] < 2:
        return delta, False
    se = math.sqrt(a["std"] ** 2 / a["n"] + b["std"] ** 2 / b["n"])
    return delta, abs(delta) > 2 * se


def best_rows(block: dict[str, Any], column: str) -> set[int]:
    """Indices of the non-floor rows with the highest mean in ``column`` (ties all count)."""
    means = {i: row["cells"][column]["mean"] for i, row in enumerate(block["rows"])
             if not row.get("floor") and column in row["cells"] and not math.isnan(row["cells"][column]["mean"])}
    if not means:
        return set()
    top = max(means.values())
    return {i for i, m in means.items() if m >= top - 1e-12}


def format_cell(cell: dict[str, float] | None, bold: bool = False) -> str:
    if not cell or not cell.get("n"):
        return "–"
    text = f"{100 * cell['mean']:.1f} ± {100 * cell['std']:.1f}" if cell["n"] > 1 else f"{100 * cell['mean']:.1f}"
    return f"**{text}**" if bold else text


def table_markdown(table: dict[str, Any], commands: bool = True) -> str:
    """One table of the grid: a Markdown table per block, the discussion, and (optionally) each row's command."""
    columns = table["columns"]
    lines = [f"## {table['title']}", ""]
    if table.get("claim"):
        lines += [f"*Paper:* {table['claim']}", ""]
    for block in table["blocks"]:
        lines += [f"**{block['title']}**", ""]
        lines.append("| Method | " + " | ".join(c["label"] for c in columns) + " |")
        lines.append("|---|" + "---:|" * len(columns))
        best = {c["key"]: best_rows(block, c["key"]) for c in columns}
        for i, row in enumerate(block["rows"]):
            label = f"*{row['label']}*" if row.get("floor") else row["label"]
            cells = [format_cell(row["cells"].get(c["key"]), i in best[c["key"]]) for c in columns]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    if table.get("discussion"):
        lines += ["**Discussion.**", ""] + [f"- {point}" for point in table["discussion"]] + [""]
    if table.get("caveats"):
        lines += [f"*Caveats:* {table['caveats']}", ""]
    if commands:
        rows = [(block["title"], row) for block in table["blocks"] for row in block["rows"] if row.get("command")]
        if rows:
            lines += ["<details><summary>Commands (one run per seed S)</summary>", ""]
            lines += [f"- {title} · {row['label']}: `{row['command']}`" for title, row in rows]
            lines += ["", "</details>", ""]
    return "\n".join(lines)


def results_markdown(results: dict[str, Any], commands: bool = True) -> str:
    """Every table of a results document, in order."""
    return "\n".join(table_markdown(t, commands) for t in results.get("tables", []))


@plain_text()
def plot_curves(curve: dict[str, Any], path: str | Path) -> Path:
    """One panel per block, one line per row: e.g. the hard-triplet fraction per epoch (SCT Figure 6)."""
    from retrieval.analysis.plots import _pyplot, _save

    plt = _pyplot()
    series = curve["series"]
    fig, axes = plt.subplots(1, max(len(series), 1), figsize=(5.5 * max(len(series), 1), 4), squeeze=False)
    for ax, (block, lines) in zip(axes[0], series.items(), strict=False):
        for label, ys in lines.items():
            ax.plot(range(1, len(ys) + 1), ys, marker="o", markersize=3, label=label)
        ax.set(title=block, xlabel="epoch", ylabel=curve.get("ylabel", ""), ylim=(0, None))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(curve.get("title", ""))
    return _save(fig, path)
