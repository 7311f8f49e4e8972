"""The Index tab: the served index's statistics and its model's micro-batcher."""

from __future__ import annotations

from typing import Any

import gradio as gr

from retrieval.serve.page_text import METRIC_UNIT, percent
from retrieval.serve.service import SearchService
from retrieval.serve.stats_view import human_bytes, statistics_markdown
from retrieval.serve.ui.shared import NO_LATEX


class IndexTab:
    def __init__(self, service: SearchService) -> None:
        self.service = service

    def stats(self) -> tuple[Any, str]:
        """The summary table and every statistic, as readable sections, of one state and its model's batcher."""
        with self.service.acquire() as state:
            _, s = self.service.public_stats(state)
            batcher = state.batcher.stats()
        k = next((key for key in s if key.startswith("recall_") and key != "recall_1_at_1"), None)
        rows = [
            ["vectors", s["vectors"]],
            ["index type", s["index_key"]],
            ["parameters", ", ".join(f"{a}={b}" for a, b in s["params"].items()) or "(none: exact search)"],
            ["embedding dimension", s["model"]["embedding_dim"]],
            ["size on disk", human_bytes(s["size_on_disk_bytes"]["total"])],
            [f"1-recall@1 vs exact search ({METRIC_UNIT})", percent(s["recall_1_at_1"])],
        ]
        if k:
            name = k.replace("_", "-", 1).replace("_at_", "@")
            rows.append([f"{name} vs exact search ({METRIC_UNIT})", percent(s[k])])
        rows += [
            ["search latency p50 (ms)", round(s["latency"]["p50_ms"], 3)],
            ["search latency p99 (ms)", round(s["latency"]["p99_ms"], 3)],
            [
                "images: errors / duplicates / removed",
                f"{s['counts']['error']} / {s['counts']['duplicate']} / {s['counts']['removed']}",
            ],
        ]
        return gr.Dataframe(value=rows, headers=["statistic", "value"]), statistics_markdown(s, batcher)

    def build(self, demo: gr.Blocks) -> None:
        table = gr.Dataframe(interactive=False, elem_id="index-stats")
        with gr.Accordion("All statistics", open=True, elem_id="index-details-fold"):
            details = gr.Markdown(elem_id="index-details", latex_delimiters=NO_LATEX)
        refresh = gr.Button("Refresh")
        refresh.click(self.stats, None, [table, details], api_name="index_stats")
        demo.load(self.stats, None, [table, details], api_name=False)
