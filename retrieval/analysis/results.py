"""The results grid (``retrieval results run``) as data: aggregation, Markdown tables and the hard-fraction plot.

One JSON document (format ``retrieval-results/1``) is written by the grid; the generated parts of docs/RESULTS.md
(``results_document``: between ``<!-- results: ID -->`` and ``<!-- end results -->``, the prose around them written
by hand) and the app's Results tab (``table_markdown``) are rendered from it, so both show the same numbers. Shape::

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
import re
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


def _block_lines(table: dict[str, Any]) -> list[str]:
    columns = table["columns"]
    lines = []
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
    return lines


def _command_lines(table: dict[str, Any]) -> list[str]:
    rows = [(block["title"], row) for block in table["blocks"] for row in block["rows"] if row.get("command")]
    if not rows:
        return []
    lines = ["<details><summary>Commands (one run per seed S)</summary>", ""]
    lines += [f"- {title} · {row['label']}: `{row['command']}`" for title, row in rows]
    return lines + ["", "</details>", ""]


def blocks_markdown(table: dict[str, Any]) -> str:
    """A table's numbers: one Markdown table per block, then the discussion computed from them."""
    return "\n".join(_block_lines(table))


def commands_markdown(table: dict[str, Any]) -> str:
    """Each row's ``retrieval train`` command, folded ("" when no row has one)."""
    return "\n".join(_command_lines(table))


def table_markdown(table: dict[str, Any], commands: bool = True) -> str:
    """One table of the grid on its own (the app's Results tab): its title, claim, numbers, discussion, caveats and
    (optionally) each row's command."""
    lines = [f"## {table['title']}", ""]
    if table.get("claim"):
        lines += [f"*Paper:* {table['claim']}", ""]
    lines += _block_lines(table)
    if table.get("caveats"):
        lines += [f"*Caveats:* {table['caveats']}", ""]
    if commands:
        lines += _command_lines(table)
    return "\n".join(lines)


def results_markdown(results: dict[str, Any], commands: bool = True) -> str:
    """Every table of a results document, in order, each on its own (``table_markdown``)."""
    return "\n".join(table_markdown(t, commands) for t in results.get("tables", []))


# --- docs/RESULTS.md: prose written by hand, the numbers' parts generated between markers --------------------------
OPENING, END = "<!-- results: ", "<!-- end results -->"
MARKER = re.compile(r"<!-- results: (?P<id>[\w .-]+?) -->\n(?:(?!<!-- results: ).)*?<!-- end results -->", re.DOTALL)
FIGURE_FILE = "{id}_hard_fraction.png"  # a curve's figure in the figures folder (docs/results)
OPTIMISERS = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}


def generated_block(block_id: str, content: str) -> str:
    """A generated part of the document between its markers (blank lines around it, as Markdown wants)."""
    body = content.strip("\n")
    return f"<!-- results: {block_id} -->\n" + (f"\n{body}\n\n" if body else "") + "<!-- end results -->"


def _sources(results: dict[str, Any]) -> list[tuple[list[str], str, dict[str, Any]]]:
    """(tables, created, setup) of each grid call the results come from, oldest first: a call that re-ran some
    tables keeps the others from the file before it (``setup.kept``), which may have kept some in turn."""
    sources = []
    ids, created, setup = [t["id"] for t in results.get("tables", [])], results.get("created", "?"), \
        results.get("setup", {})
    while True:
        kept = setup.get("kept") or {}
        older = [i for i in ids if i in kept.get("tables", [])]
        sources.append(([i for i in ids if i not in older], created, setup))
        if not older:
            return sources[::-1]
        ids, created, setup = older, kept.get("from", "?"), kept.get("setup", {})


def _listed(ids: list[str]) -> str:
    names = ids if len(ids) < 2 else [", ".join(ids[:-1]), ids[-1]]
    return ("table " if len(ids) == 1 else "tables ") + " and ".join(names)


def grid_size(results: dict[str, Any]) -> str:
    """Where the numbers come from: each grid call's tables, runs and training time."""
    sources = [s for s in _sources(results) if s[0]]
    missing = sum(len(setup.get("cells_not_finished", [])) for _, _, setup in sources)
    if len(sources) == 1:
        setup = sources[0][2]
        text = (f"Grid size: {setup.get('runs', '?')} runs; their training and evaluation took "
                f"{setup.get('train_seconds_total', 0) / 60:.0f} min in all on this machine (sum of the runs' own "
                "times, without the one-off feature extraction; runs of parallel `--shard` processes overlap)")
    else:
        parts = []
        for n, (ids, created, setup) in enumerate(sources):
            call = f"`{setup['command']}`" if setup.get("command") else "the grid"
            minutes = f"{setup.get('train_seconds_total', 0) / 60:.0f} min"
            if n == 0:
                minutes += " of training and evaluation, the sum of the runs' own times"
            parts.append(f"{_listed(ids)} {'come' if len(ids) > 1 else 'comes'} from {call} of {created} "
                         f"({setup.get('runs', '?')} runs, {minutes})")
        text = "Grid size: " + "; ".join(parts)
    if missing:
        text += f"; {missing} cells had not finished all their seeds and are left empty"
    return text + "."


def setup_markdown(results: dict[str, Any]) -> str:
    """The training setup every cell shares, each dataset's batch and steps, and the grid's size."""
    setup = results.get("setup", {})
    common = setup.get("common", {})
    datasets: dict[str, dict[str, Any]] = {}
    for _, _, source in _sources(results):
        datasets.update(source.get("datasets", {}))
    used = [b["dataset"] for t in results.get("tables", []) for b in t["blocks"] if b.get("dataset") in datasets]
    order = list(dict.fromkeys(used)) or list(datasets)  # the tables' datasets, in the tables' order
    lines = [f"Every method: {OPTIMISERS.get(common.get('optimizer'), common.get('optimizer'))}, lr "
             f"{common.get('lr')}, weight decay {common.get('weight_decay')}, {common.get('schedule')} schedule; "
             f"seeds {', '.join(map(str, setup.get('seeds', [])))}.", "",
             "| Dataset | Batch (P x N) | Steps | Source |", "|---|---|---:|---|"]
    for key in order:
        o = datasets[key]["overrides"]
        lines.append(f"| {datasets[key]['title']} | {o['batch_size']} ({o['batch_size'] // o['per_class']} x "
                     f"{o['per_class']}) | {o['epochs'] * o['batches_per_epoch']} | `{o['dataset']}` |")
    return "\n".join(lines + ["", grid_size(results)])


def generated_blocks(results: dict[str, Any], figures: dict[str, str] | None = None) -> dict[str, str]:
    """Every generated part of docs/RESULTS.md by its marker's id: ``setup``; per table ``ID`` (its numbers and
    discussion) and ``ID commands``; per curve ``ID figure`` (``figures``: curve id -> the image's link; None: the
    figures folder next to docs/RESULTS.md, ``results/`` + ``FIGURE_FILE``); ``failures``."""
    blocks = {"setup": setup_markdown(results)}
    for table in results.get("tables", []):
        blocks[table["id"]] = blocks_markdown(table)
        blocks[f"{table['id']} commands"] = commands_markdown(table)
    for curve in results.get("curves", []):
        link = "results/" + FIGURE_FILE.format(id=curve["id"]) if figures is None else figures.get(curve["id"])
        blocks[f"{curve['id']} figure"] = f"![{curve['title']}]({link})" if link else ""  # no figure drawn: none
    failures = results.get("failures", [])
    blocks["failures"] = ("## Runs that failed (missing from the tables)\n\n"
                          + "".join(f"- `{f['run']}`: {f['error']}\n" for f in failures)) if failures else ""
    return blocks


def marker_ids(text: str) -> list[str]:
    """The ids of the generated parts a document has places for, in order."""
    return [m["id"] for m in MARKER.finditer(text)]


def _new_section(table: dict[str, Any], blocks: dict[str, str]) -> str:
    """A table's section for a document that has no place for it yet: the grid's words for its prose (to edit)."""
    parts = [f"## {table['title']}"]
    if table.get("claim"):
        parts.append(f"*Paper:* {table['claim']}")
    parts.append(generated_block(table["id"], blocks[table["id"]]))
    if f"{table['id']} figure" in blocks:  # under the discussion, which refers to it
        parts.append(generated_block(f"{table['id']} figure", blocks[f"{table['id']} figure"]))
    if table.get("caveats"):
        parts.append(f"*Caveats:* {table['caveats']}")
    parts.append(generated_block(f"{table['id']} commands", blocks[f"{table['id']} commands"]))
    return "\n\n".join(parts) + "\n"


def results_document(text: str | None, results: dict[str, Any], figures: dict[str, str] | None = None) -> str:
    """docs/RESULTS.md with its generated parts rewritten from ``results`` and everything else (the prose) kept.

    ``text``: the document as it is (None: there is none yet). A table the document has no place for gets a new
    section at its end, with the grid's claim and caveats as a first draft of its prose, and so does any other part
    with something to show (the setup, failed runs); a place whose id the results do not produce (a table not in
    them) keeps what it holds."""
    if text is not None and not text.count(OPENING) == text.count(END) == len(marker_ids(text)):
        raise ValueError(f"the document's markers do not pair up: each `{OPENING}ID -->` line needs its own "
                         f"`{END}` after it (the generated parts would overwrite the prose)")
    blocks = generated_blocks(results, figures)
    fresh = text is None  # a new document gets a place for every part, empty ones (failures) included
    text = MARKER.sub(lambda m: generated_block(m["id"], blocks[m["id"]]) if m["id"] in blocks else m[0],
                      "# Results\n" if fresh else text)
    present = set(marker_ids(text))
    tables = [t for t in results.get("tables", []) if t["id"] not in present]
    in_sections = {i for t in tables for i in (t["id"], f"{t['id']} commands", f"{t['id']} figure")}
    new = [generated_block(i, b) + "\n" for i, b in blocks.items()
           if (b or fresh) and i not in present and i not in in_sections]
    at = int("setup" not in present)  # the tables follow the setup when that is new too
    new[at:at] = [_new_section(t, blocks) for t in tables]
    return text.rstrip("\n") + "\n\n" + "\n".join(new) if new else text


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
