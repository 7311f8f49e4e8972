"""The Results tab: the results grid of ``retrieval results run``, one table at a time with its figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gradio as gr
from PIL import Image

from retrieval.analysis.results import RESULTS_COMMAND, table_markdown
from retrieval.serve.page_text import MAX_PROSE_CHARS, METRIC_UNIT, markdown_code, markdown_text, shown_text
from retrieval.serve.report_files import load_results
from retrieval.serve.report_plots import results_curve_image


class ResultsTab:
    """The results grid of ``retrieval results run``: one table at a time, its discussion and its figure."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.results: dict[str, Any] | None = None
        self.problem = "no results file configured"
        if path is not None:
            try:
                self.results = load_results(path)
            except (FileNotFoundError, ValueError) as exc:  # the page names the file, not the server's folders
                self.problem = str(exc).replace(str(path), path.name)

    def titles(self) -> list[tuple[str, str]]:
        return [(shown_text(t["title"]), t["id"]) for t in (self.results or {}).get("tables", [])]

    def show(self, table_id: str | None) -> tuple[str, Image.Image | None]:
        if self.results is None:
            problem = markdown_text(self.problem, MAX_PROSE_CHARS)  # names the file, which is anyone's
            return (f"**No results grid to show:** {problem}. Run `{RESULTS_COMMAND}` (1.5-2 h on 2 CPU "
                    "cores, resumable; `--shard` splits it over processes) to produce docs/results.json and "
                    "docs/RESULTS.md.", None)
        table = next((t for t in self.results["tables"] if t["id"] == table_id), None)
        if table is None:
            return f"No table {markdown_code(table_id, 80)} in {markdown_code(self.path.name)}.", None
        setup = self.results.get("setup", {})
        header = (f"{markdown_text(setup.get('runs', '?'))} runs, seeds {markdown_text(setup.get('seeds', '?'))}, "
                  f"created {markdown_text(self.results.get('created', '?'))} · from {markdown_code(self.path.name)} "
                  "· metrics in percent "
                  f"({METRIC_UNIT}), mean ± standard deviation over seeds\n\n")
        return header + table_markdown(table, commands=True), results_curve_image(self.results, table["id"])

    def build(self, demo: gr.Blocks) -> None:
        choices = self.titles()
        first = choices[0][1] if choices else None
        picker = gr.Dropdown(choices=choices, value=first, label="Table", elem_id="results-table-picker")
        text = gr.Markdown(elem_id="results-table")
        figure = gr.Image(label="Figure", show_label=False, type="pil", interactive=False, elem_id="results-figure")
        picker.change(self._shown, [picker], [text, figure], api_name="results_table")
        demo.load(self._shown, [picker], [text, figure], api_name=False)

    def _shown(self, table_id: str | None) -> tuple[str, Any]:
        text, image = self.show(table_id)
        return text, gr.Image(value=image, visible=image is not None)  # no empty frame for tables without one
