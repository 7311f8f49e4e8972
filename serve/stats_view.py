"""The Index tab's "All statistics": the served state's statistics (``SearchService.public_stats``) and its model's
batcher counters as Markdown sections of labelled values, sizes in binary units, metrics in percent.

Known keys get a section and a label each; a key this view does not know yet is still shown, under "Other", so
that nothing the index reports is hidden. Every value that is anyone's text (paths, error messages, index keys) is
escaped: it renders as that text. Table cells hold no code spans: a ``|`` inside one would still end the cell.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from retrieval.serve.page_text import METRIC_UNIT, markdown_text, percent
from retrieval.text.text_index import text_off_problem
from retrieval.utils.sizes import size_text

COUNT_LABELS = {  # the catalogue's statuses, as a reader names them
    "done": "indexed (searched)",
    "pending": "waiting to be indexed",
    "error": "unreadable",
    "duplicate": "skipped as exact duplicates",
    "removed": "removed",
    "not_listed": "paths the folder listing could not take",
    "total": "catalogued in all",
}
SIZE_LABELS = {"catalogue": "catalogue (SQLite)", "shards": "embedding shards", "faiss": "faiss index",
               "info": "index.json", "total": "total"}
BATCHER_LABELS = {"model_calls": "model calls", "requests": "queries embedded",
                  "largest_batch": "largest batch (queries in one call)",
                  "mean_requests_per_call": "mean queries per call", "max_batch": "batch limit (--max-batch)",
                  "max_wait_ms": "wait for more queries (--max-wait-ms)"}
# what the sections below show; any other key of the statistics goes under "Other"
SHOWN_KEYS = {"index_dir", "counts", "errors", "error_examples", "throughput", "vectors", "index_key",
              "index_key_requested", "params", "tuning", "budget", "model", "size_on_disk_bytes", "queries",
              "latency", "neighbour_similarity", "upgrade", "last_upgrade"}


def human_bytes(count: Any) -> str:
    """A byte count in binary units with three significant digits (``sizes.size_text``); anything else as shown."""
    if not isinstance(count, (int, float)) or isinstance(count, bool):
        return shown(count)
    return size_text(count)


def shown(value: Any) -> str:
    """A value for a table cell: numbers grouped and rounded, booleans as yes/no, anything else escaped text."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
    if isinstance(value, (dict, list)):
        return markdown_text(json.dumps(value, default=str), 400)
    return markdown_text(value)


def table(rows: Iterable[tuple[str, str]], header: tuple[str, str] = ("statistic", "value")) -> str:
    """A two-column Markdown table of (label, value) rows, both already Markdown."""
    lines = [f"| {header[0]} | {header[1]} |", "| --- | --- |"]
    lines += [f"| {label} | {value} |" for label, value in rows]
    return "\n".join(lines)


def section(title: str, body: str, note: str = "") -> str:
    return f"### {title}\n\n" + (f"{note}\n\n" if note else "") + body


def index_section(s: Mapping[str, Any]) -> str:
    model = s.get("model") or {}
    requested = s.get("index_key_requested")
    key = markdown_text(s.get("index_key"))
    if requested and requested != s.get("index_key"):
        key += f" (asked for: {markdown_text(requested)})"
    params = s.get("params") or {}
    rows = [
        ("images searched (vectors)", shown(s.get("vectors"))),
        ("index type", key),
        ("search parameters", ", ".join(markdown_text(f"{a}={b}") for a, b in params.items())
         or "none: exact search"),
        ("embedding dimension", shown(model.get("embedding_dim"))),
        ("model", " · ".join(part for part in (
            markdown_text(model["model_path"]) if model.get("model_path") else "",
            f"hash {markdown_text(model['model_hash'])}" if model.get("model_hash") else "",
            "L2-normalised embeddings" if model.get("model_normalized") else "",
            "none: built from embeddings" if model.get("source") == "embeddings" else "") if part) or "–"),
        ("index folder", markdown_text(s["index_dir"]) if s.get("index_dir") else "–"),
    ]
    return section("Index", table(rows))


# an upgrade's sentences (its measurement, a reason, the commands that re-fit a text model): whole, not cut at a
# label's length before the numbers or the command that matter
UPGRADE_CHARS = 1500


def upgrade_section(s: Mapping[str, Any]) -> str:
    """The upgrade under way or the last one: what it measured before it began, what it was forced past, and a text
    model it turned off."""
    rows = []
    for title, record in (("upgrade under way", s.get("upgrade")), ("last upgrade", s.get("last_upgrade"))):
        if not isinstance(record, Mapping):
            continue
        left = f"; {shown(record['left'])} images still hold an old vector" if "left" in record else ""
        rows.append((title, markdown_text(f"{record.get('mode')} from model {record.get('from')}"
                                          + (f" to {record['to']}" if record.get("to") else "")) + left))
        if record.get("verdict"):
            rows.append((f"{title}: its training's verdict", markdown_text(record["verdict"], UPGRADE_CHARS)))
        if record.get("on_labels_text"):
            rows.append((f"{title}: measured first on the index's labels",
                         markdown_text(record["on_labels_text"], UPGRADE_CHARS)))
        if record.get("on_text_text"):
            rows.append((f"{title}: its text model, measured first", markdown_text(record["on_text_text"],
                                                                                    UPGRADE_CHARS)))
        forced = record.get("forced") or []
        rows += [(f"{title}: upgraded anyway (--force)", markdown_text(reason, UPGRADE_CHARS)) for reason in forced]
        text = record.get("text_model") if isinstance(record.get("text_model"), Mapping) else {}
        model = (s.get("model") or {}).get("model_path") or "MODEL.onnx"
        off = text_off_problem(text, "<index>", str(model)) if text.get("state") == "off" else None
        if off is not None or text.get("state") == "kept":
            rows.append((f"{title}: text model", markdown_text(off or f"kept: {text.get('reason')}", UPGRADE_CHARS)))
    return section("Model upgrades", table(rows)) if rows else ""


def quality_section(s: Mapping[str, Any]) -> str:
    rows = []
    for key in sorted(k for k in s if k.startswith("recall_") and isinstance(s[k], (int, float))):
        name = key.removeprefix("recall_").replace("_at_", "-recall@")  # recall_10_at_10 -> 10-recall@10
        rows.append((f"{markdown_text(name)} vs exact search", f"{percent(s[key])} {METRIC_UNIT}"))
    latency = s.get("latency") or {}
    if latency:
        rows.append(("search latency, median / 99th percentile",
                     f"{latency.get('p50_ms', float('nan')):.2f} ms / {latency.get('p99_ms', float('nan')):.2f} ms"))
    tuning = s.get("tuning") or {}
    if tuning:
        met = tuning.get("target_met")
        rows.append(("search settings chosen by", (markdown_text(tuning["note"]) + "; " if tuning.get("note") else "")
                     + f"tried on {shown(tuning.get('queries'))} queries"
                     + ("" if met is None else f", recall target {'met' if met else 'not met'}")))
    note = (f"Measured on {shown(s.get('queries'))} of the index's own vectors, each left out of its own results "
            "(so they measure like new queries).") if s.get("queries") else ""
    return section("Search quality and speed", table(rows), note) if rows else ""


def neighbour_section(s: Mapping[str, Any]) -> str:
    n = s.get("neighbour_similarity")
    if not isinstance(n, Mapping):
        return ""
    share = 100 * (1 - float(n.get("quantile", 0.01)))
    rows = [
        ("gallery images measured", f"{shown(n.get('images'))}" + (" (a random sample)" if n.get("sampled") else "")),
        ("median similarity to the nearest other image", shown(n.get("median"))),
        (f"reached by {share:g} % of them", f"{shown(n.get('floor'))} or more"),
    ]
    return section("How close gallery images are to each other", table(rows),
                   f"A search whose best result scores below {shown(n.get('floor'))} is told that nothing in the "
                   "gallery is much like its image (docs/SERVING.md, \"Nothing similar\").")


def catalogue_section(s: Mapping[str, Any]) -> str:
    counts = s.get("counts") or {}
    rows = [(COUNT_LABELS.get(key, markdown_text(key)), shown(value)) for key, value in counts.items()]
    return section("Gallery files", table(rows, ("files", "count"))) if rows else ""


def size_section(s: Mapping[str, Any]) -> str:
    sizes = s.get("size_on_disk_bytes") or {}
    rows = [(SIZE_LABELS.get(key, markdown_text(key)), human_bytes(value)) for key, value in sizes.items()]
    return section("Size on disk", table(rows, ("part", "size"))) if rows else ""


def throughput_section(s: Mapping[str, Any]) -> str:
    engines = s.get("throughput") or {}
    if not isinstance(engines, Mapping) or not engines:
        return ""
    lines = ["| engine | images | seconds | images per second | runs |", "| --- | --- | --- | --- | --- |"]
    for engine, t in engines.items():
        t = t if isinstance(t, Mapping) else {}
        lines.append(f"| {markdown_text(engine)} | {shown(t.get('images'))} | {shown(t.get('seconds'))} | "
                     f"{shown(t.get('images_per_s'))} | {shown(t.get('runs'))} |")
    return section("Indexing throughput (decode, embed, write; faiss not included)", "\n".join(lines))


def budget_section(s: Mapping[str, Any]) -> str:
    budget = s.get("budget")
    if not isinstance(budget, Mapping):
        return ""
    rows = [
        ("memory limit (--max-index-memory)", human_bytes(budget["max_index_memory"])
         if budget.get("max_index_memory") is not None else "none"),
        ("estimated index memory", human_bytes(budget.get("estimated_bytes"))),
        ("memory limit met", shown(budget.get("memory_met"))),
        ("time per query allowed (--max-query-ms)", f"{shown(budget['max_query_ms'])} ms"
         if budget.get("max_query_ms") is not None else "none"),
        ("time per query measured", f"{shown(budget['latency_ms'])} ms"
         if budget.get("latency_ms") is not None else "–"),
        ("time limit met", shown(budget.get("latency_met"))),
    ]
    return section("Build budget", table(rows))


def errors_section(s: Mapping[str, Any]) -> str:
    examples = s.get("error_examples") or []
    total = s.get("errors") or 0
    if not examples and not total:
        return section("Unreadable files", "None: every gallery file could be read.")
    lines = ["| file | problem |", "| --- | --- |"]
    for row in examples:
        path = row.get("path")
        lines.append(f"| {markdown_text(path, 1000) if path else '–'} | {markdown_text(row.get('error'), 300)} |")
    more = f"{shown(total)} in all; the first {len(examples)} below." if total > len(examples) else ""
    return section("Unreadable files", "\n".join(lines), more)


def batcher_section(batcher: Mapping[str, Any]) -> str:
    rows = []
    for key, value in batcher.items():
        text = f"{shown(value)} ms" if key == "max_wait_ms" else shown(value)
        rows.append((BATCHER_LABELS.get(key, markdown_text(key)), text))
    note = "Queries arriving together share one model call (since this server started)."
    return section("Model calls", table(rows), note) if rows else ""


def other_section(s: Mapping[str, Any]) -> str:
    rows = [(markdown_text(key), shown(value)) for key, value in s.items()
            if key not in SHOWN_KEYS and not key.startswith("recall_")]  # recalls: "Search quality and speed"
    return section("Other", table(rows)) if rows else ""


def statistics_markdown(stats: Mapping[str, Any], batcher: Mapping[str, Any]) -> str:
    """Every statistic of one served state and its batcher's counters, as Markdown sections."""
    parts = [index_section(stats), upgrade_section(stats), quality_section(stats), neighbour_section(stats),
             catalogue_section(stats), errors_section(stats), size_section(stats), throughput_section(stats),
             budget_section(stats), batcher_section(batcher), other_section(stats)]
    return "\n\n".join(part for part in parts if part)
