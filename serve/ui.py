"""The Gradio app: Search, Evaluation, Results and Index tabs over one ``SearchService``."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

import gradio as gr
from PIL import Image

from retrieval.analysis.results import table_markdown
from retrieval.data import open_image
from serve.defaults import RESULTS_COMMAND
from serve.images import QueryError
from serve.reports import (
    curves_plot,
    load_report,
    load_results,
    recall_plot,
    results_curve_image,
    summary_markdown,
    triplet_plot,
)
from serve.service import SearchService

THUMBNAIL = 256
EXAMPLE_COUNT = 12
WORST_CLASSES = 10


class ExampleSet:
    """Gallery images offered as example queries, copied so that Gradio serves nothing else of the gallery."""

    def __init__(self, service: SearchService, folder: Path, count: int = EXAMPLE_COUNT) -> None:
        self.files: list[str] = []
        for row in service.catalogue.sample(count):
            path = service.image_path(row["id"])
            if path is not None:
                copy = folder / f"{row['id']}{path.suffix.lower()}"
                shutil.copyfile(path, copy)
                self.files.append(str(copy))


def thumbnail(path: Path | None) -> Image.Image:
    if path is None:
        return Image.new("RGB", (THUMBNAIL, THUMBNAIL), (230, 230, 230))
    image = open_image(path)
    image.thumbnail((THUMBNAIL, THUMBNAIL))
    return image


class SearchTab:
    def __init__(self, service: SearchService, examples: ExampleSet) -> None:
        self.service, self.examples = service, examples

    def search(self, image: str | None, k: float) -> tuple[list[tuple[Image.Image, str]], str]:
        """Search by the uploaded file's bytes, as the API does: a query that is a gallery item (identical
        bytes) is recognised and left out of its own results (``exclude_self``)."""
        if image is None:
            raise gr.Error("Upload, paste or pick an image first.")
        with open(image, "rb") as handle:  # one byte over the limit is enough for the service to refuse it
            data = handle.read(self.service.max_upload_bytes + 1)
        try:
            response = self.service.search(data, self.service.check_k(int(k)), exclude_self=True)
        except QueryError as exc:
            raise gr.Error(str(exc)) from exc
        known = response.query_item
        items = []
        for result in response.results:
            caption = f"{result.score:.3f} · {result.label or '(no label)'}"
            if known is not None and known.label is not None:
                caption = ("✓ " if result.label == known.label else "✗ ") + caption
            items.append((thumbnail(self.service.image_path(result.id)), caption))
        t = response.timing
        lines = [
            f"**{len(items)} results** · embed {t.get('embed_ms', 0):.1f} ms "
            f"(batch of {int(t.get('batch_size', 1))}) · search {t['search_ms']:.1f} ms · "
            f"total {t['total_ms']:.1f} ms"
        ]
        if known is not None:
            correct = sum(r.label == known.label for r in response.results)
            lines.append(
                f"Query is gallery image #{known.id} (label **{known.label}**), left out of its own "
                f"results; {correct}/{len(items)} results share its label (✓ correct, ✗ wrong)."
            )
        return items, "\n\n".join(lines)

    def build(self) -> None:
        with gr.Row():
            with gr.Column(scale=1, min_width=280):
                query = gr.Image(
                    type="filepath",  # the uploaded file itself (its bytes identify a gallery item)
                    image_mode=None,
                    sources=["upload", "clipboard"],
                    label="Query image",
                    elem_id="query-image",
                    height=280,
                )
                top_k = gr.Slider(
                    1,
                    max(1, min(100, len(self.service))),
                    value=min(10, len(self.service)),
                    step=1,
                    label="K (number of results)",
                    elem_id="top-k",
                )
                button = gr.Button("Search", variant="primary", elem_id="search-button")
                timing = gr.Markdown(elem_id="search-timing")
                if self.examples.files:
                    gr.Examples(
                        [[file] for file in self.examples.files],
                        inputs=[query],
                        label="Examples from the gallery (results are marked ✓/✗ by label)",
                        examples_per_page=EXAMPLE_COUNT,
                    )
            with gr.Column(scale=3):
                gallery = gr.Gallery(
                    label="Results",
                    columns=5,
                    height="auto",
                    object_fit="contain",
                    elem_id="results-gallery",
                    allow_preview=True,
                )
        button.click(self.search, [query, top_k], [gallery, timing], api_name="search")


MAX_REPORT_BYTES = 50 * 2**20


class EvaluationTab:
    def __init__(self, service: SearchService, report: Path | None) -> None:
        self.service, self.report = service, report
        self._cache: dict[tuple[str, int], tuple] = {}

    def allowed(self, path: str) -> str | None:
        """Why ``path`` may not be opened from the browser, or None.

        Anyone who reaches the page can type a path, so only report-sized JSON files under the server's working
        directory or the folder above the ``--report`` it was started with (e.g. artifacts/demo) are read.
        """
        target = Path(path).expanduser().resolve()
        roots = [Path.cwd().resolve()] + ([Path(self.report).resolve().parent.parent] if self.report else [])
        if target.suffix != ".json" or not any(target.is_relative_to(root) for root in roots):
            return (f"only report .json files under {' or '.join(str(r) for r in roots)} can be opened here; "
                    "start the server with `--report PATH` for another one")
        if target.is_file() and target.stat().st_size > MAX_REPORT_BYTES:
            return f"{path} is larger than {MAX_REPORT_BYTES // 2**20} MiB: not a run report"
        return None

    def open_report(self, path: str) -> tuple[str, Any, Any, Any, Any]:
        """The report's summary, metrics table and plots (drawn once per report file version)."""
        refused = self.allowed(path) if path else None
        if refused:
            return f"**Cannot open the report:** {refused}", None, None, None, None
        try:
            key = (str(Path(path).resolve()), Path(path).stat().st_mtime_ns) if path else None
        except OSError:
            key = None
        if key is not None and key in self._cache:
            return self._cache[key]
        shown = self._open_report(path)
        if key is not None:
            self._cache = {key: shown}  # keep only the latest
        return shown

    def _open_report(self, path: str) -> tuple[str, Any, Any, Any, Any]:
        if not path:
            return (
                "No report given: start with `--report RUN_DIR/report.json` (or enter a path above).",
                None,
                None,
                None,
                None,
            )
        try:
            report = load_report(path)
        except (FileNotFoundError, ValueError) as exc:
            return f"**Cannot open the report:** {exc}", None, None, None, None
        headers, rows = report.metrics_table()
        return (
            summary_markdown(report),
            gr.Dataframe(value=rows, headers=headers),
            recall_plot(report),
            curves_plot(report),
            triplet_plot(report),
        )

    def worst_classes(self) -> tuple[str, Any, list[tuple[Image.Image, str]]]:
        loo = self.service.leave_one_out()
        if not loo.classes:
            return f"No per-class analysis: {loo.note}.", None, []
        summary = (
            f"Leave-one-out over the index ({loo.note}, {loo.queries} queries): each labelled image is "
            f"searched against all others; Recall@1 = **{loo.recall_at_1:.4f}**. Worst classes:"
        )
        worst = loo.classes[:WORST_CLASSES]
        rows = [[c.label, c.queries, c.correct, round(c.recall_at_1, 4)] for c in worst]
        pairs = []
        for c in worst:
            for failure in c.failures[:1]:
                pairs.append(
                    (thumbnail(self.service.image_path(failure.query_id)), f"query: {failure.query_label}")
                )
                pairs.append(
                    (
                        thumbnail(self.service.image_path(failure.top1_id) if failure.top1_id >= 0 else None),
                        f"✗ {failure.score:.3f} · top-1: {failure.top1_label}",
                    )
                )
        table = gr.Dataframe(value=rows, headers=["class", "queries", "correct top-1", "Recall@1"])
        return summary, table, pairs

    def build(self, demo: gr.Blocks) -> None:
        with gr.Row():
            path = gr.Textbox(
                value=str(self.report or ""),
                label="Run report (report.json of `retrieval train` or `retrieval evaluate`)",
                scale=4,
                elem_id="report-path",
            )
            button = gr.Button("Open report", scale=1)
        summary = gr.Markdown(elem_id="report-summary")
        metrics = gr.Dataframe(label="Metrics", interactive=False, elem_id="metrics-table")
        with gr.Row():
            recall = gr.Image(label="Recall@K", type="pil", interactive=False, elem_id="recall-plot")
            triplet = gr.Image(label="Triplet diagram", type="pil", interactive=False, elem_id="triplet-plot")
        curves = gr.Image(
            label="Training curves (metrics.jsonl)", type="pil", interactive=False, elem_id="curves-plot"
        )
        gr.Markdown("### Classes with the worst Recall@1 in this index")
        loo_summary = gr.Markdown()
        worst = gr.Dataframe(interactive=False, elem_id="worst-classes")
        failures = gr.Gallery(
            label="Example failures: query, then its wrong top-1",
            columns=6,
            height="auto",
            object_fit="contain",
            elem_id="failures-gallery",
        )
        outputs = [summary, metrics, recall, curves, triplet]
        button.click(self.open_report, [path], outputs, api_name="open_report")
        demo.load(self.open_report, [path], outputs, api_name=False)
        demo.load(self.worst_classes, None, [loo_summary, worst, failures], api_name=False)


class ResultsTab:
    """The results grid of ``benchmarks/quality.py``: one table at a time, its discussion and its figure."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.results: dict[str, Any] | None = None
        self.problem = "no results file configured"
        if path is not None:
            try:
                self.results = load_results(path)
            except (FileNotFoundError, ValueError) as exc:
                self.problem = str(exc)

    def titles(self) -> list[tuple[str, str]]:
        return [(t["title"], t["id"]) for t in (self.results or {}).get("tables", [])]

    def show(self, table_id: str | None) -> tuple[str, Image.Image | None]:
        if self.results is None:
            return (f"**No results grid to show:** {self.problem}. Run `{RESULTS_COMMAND}` (1.5-2 h on 2 CPU "
                    "cores, resumable; `--shard` splits it over processes) to produce docs/results.json and "
                    "docs/RESULTS.md.", None)
        table = next((t for t in self.results["tables"] if t["id"] == table_id), None)
        if table is None:
            return f"No table {table_id!r} in {self.path}.", None
        setup = self.results.get("setup", {})
        header = (f"{setup.get('runs', '?')} runs, seeds {setup.get('seeds', '?')}, created "
                  f"{self.results.get('created', '?')} · from `{self.path}`\n\n")
        return header + table_markdown(table, commands=True), results_curve_image(self.results, table["id"])

    def build(self, demo: gr.Blocks) -> None:
        choices = self.titles()
        first = choices[0][1] if choices else None
        picker = gr.Dropdown(choices=choices, value=first, label="Table", elem_id="results-table-picker")
        text = gr.Markdown(elem_id="results-table")
        figure = gr.Image(label="Figure", type="pil", interactive=False, elem_id="results-figure")
        picker.change(self._shown, [picker], [text, figure], api_name="results_table")
        demo.load(self._shown, [picker], [text, figure], api_name=False)

    def _shown(self, table_id: str | None) -> tuple[str, Any]:
        text, image = self.show(table_id)
        return text, gr.Image(value=image, visible=image is not None)  # no empty frame for tables without one


class IndexTab:
    def __init__(self, service: SearchService) -> None:
        self.service = service

    def stats(self) -> tuple[Any, dict[str, Any]]:
        s = self.service.index_stats()
        k = next((key for key in s if key.startswith("recall_") and key != "recall_1_at_1"), None)
        rows = [
            ["vectors", s["vectors"]],
            ["index type", s["index_key"]],
            ["parameters", ", ".join(f"{a}={b}" for a, b in s["params"].items()) or "(none: exact search)"],
            ["embedding dimension", s["model"]["embedding_dim"]],
            ["size on disk (MiB)", round(s["size_on_disk_bytes"]["total"] / 2**20, 3)],
            ["1-recall@1 vs exact search", round(s["recall_1_at_1"], 4)],
        ]
        if k:
            rows.append([k.replace("_", "-", 1).replace("_at_", "@") + " vs exact search", round(s[k], 4)])
        rows += [
            ["search latency p50 (ms)", round(s["latency"]["p50_ms"], 3)],
            ["search latency p99 (ms)", round(s["latency"]["p99_ms"], 3)],
            [
                "images: errors / duplicates / removed",
                f"{s['counts']['error']} / {s['counts']['duplicate']} / {s['counts']['removed']}",
            ],
        ]
        return gr.Dataframe(value=rows, headers=["statistic", "value"]), s | {
            "batcher": self.service.batcher.stats()
        }

    def build(self, demo: gr.Blocks) -> None:
        table = gr.Dataframe(interactive=False, elem_id="index-stats")
        details = gr.JSON(label="All statistics")
        refresh = gr.Button("Refresh")
        refresh.click(self.stats, None, [table, details], api_name="index_stats")
        demo.load(self.stats, None, [table, details], api_name=False)


def build_ui(
    service: SearchService,
    report: str | Path | None = None,
    example_dir: Path | None = None,
    results: str | Path | None = None,
) -> tuple[gr.Blocks, Path]:
    """The Blocks app and the folder holding its example copies (pass it to Gradio's allowed_paths)."""
    if example_dir is None:
        example_dir = Path(tempfile.mkdtemp(prefix="retrieval-examples-"))
        atexit.register(shutil.rmtree, example_dir, True)
    examples = ExampleSet(service, example_dir)
    info = service.describe()
    with gr.Blocks(title="Image retrieval", analytics_enabled=False) as demo:
        gr.Markdown(
            f"## Image retrieval · {info['vectors']} images · `{info['index_key']}` · "
            f"{info['embedding_dim']}-d embeddings · model `{info['model_hash']}`"
        )
        with gr.Tabs():
            with gr.Tab("Search", id="search"):
                SearchTab(service, examples).build()
            with gr.Tab("Evaluation", id="evaluation"):
                EvaluationTab(service, Path(report) if report else None).build(demo)
            with gr.Tab("Results", id="results"):
                ResultsTab(Path(results) if results else None).build(demo)
            with gr.Tab("Index", id="index"):
                IndexTab(service).build(demo)
    return demo, example_dir
