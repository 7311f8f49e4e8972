"""The Gradio app: its page, assembled from the Search, Evaluation, Results and Index tabs (a module each) over
one ``SearchService``.

- ``search``: the Search tab: a query image or a description in words, K, filters and re-ranking -> the results.
- ``evaluation``: the Evaluation tab: a run report's metrics and pictures, and the served index's own analyses.
- ``results``: the Results tab: the results grid, one table at a time with its figure.
- ``index``: the Index tab: the served index's statistics and its model's micro-batcher.
- ``shared``: what the tabs share: the gallery's facts, thumbnails, the limits on shown text.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import gradio as gr

from retrieval.serve.page_text import MAX_PROSE_CHARS, markdown_code, markdown_text
from retrieval.serve.service import SearchService
from retrieval.serve.ui.evaluation import EvaluationTab
from retrieval.serve.ui.index import IndexTab
from retrieval.serve.ui.results import ResultsTab
from retrieval.serve.ui.search import ExampleSet, SearchTab
from retrieval.serve.ui.shared import NO_LATEX, GalleryFacts
from retrieval.serve.upload_cache import UploadRecords

# Passed to gr.mount_gradio_app (serve.server): Gradio 6 takes page CSS there, not in gr.Blocks.
UI_CSS = """
/* Results and failures grow with their content: Gradio caps a gallery at 55vh with an inner scrollbar. */
#results-gallery .grid-wrap, #failures-gallery .grid-wrap { max-height: none !important; min-height: 0 !important;
  overflow-y: visible !important; }
/* Captions sit under their image and wrap instead of being cut with an ellipsis (long label names, narrow
   screens); the enlarged view's caption wraps too. */
#results-gallery .thumbnail-lg, #failures-gallery .thumbnail-lg { aspect-ratio: auto; height: auto;
  display: flex; flex-direction: column; }
#results-gallery .thumbnail-lg > img, #failures-gallery .thumbnail-lg > img { aspect-ratio: 1; height: auto; }
#results-gallery .caption-label, #failures-gallery .caption-label { position: static; max-width: none;
  white-space: normal; text-overflow: clip; overflow-wrap: anywhere; border: none; border-radius: 0;
  line-height: 1.25; opacity: 1 !important; }
#results-gallery .caption, #failures-gallery .caption { white-space: normal; text-overflow: clip;
  overflow-wrap: anywhere; }
/* A long title is cut after four lines in the grid; the enlarged view and the selection line show it whole. */
#results-gallery .caption-label { display: -webkit-box; -webkit-box-orient: vertical; -webkit-line-clamp: 4;
  overflow: hidden; padding-top: 0 !important; padding-bottom: 0 !important; margin: 6px 0; }
/* Narrow screens: two columns, so that thumbnails and their captions keep a readable size. */
@media (max-width: 720px) {
  /* A phone's screen: the query, its description and Search, then the results at once; the status line, K,
     re-ranking and filters follow them (the columns and the form group step aside so that their parts can be
     ordered). */
  #search-row { flex-direction: column !important; flex-wrap: nowrap !important; }
  #query-column, #results-column, #query-column > .form { display: contents !important; }
  #purpose h1, #purpose h2, #purpose p { font-size: 1.15rem !important; line-height: 1.3 !important; }
  #query-image { order: 1; height: 170px !important; }
  #query-text { order: 2; }
  #search-button { order: 3; }
  #results-gallery { order: 4; }
  #selected-result { order: 5; }
  #search-timing { order: 6; }
  #top-k { order: 7; }
  #rerank-method { order: 8; }
  #filter { order: 9; }
  #results-gallery .grid-container { grid-template-columns: repeat(2, minmax(0, 1fr)) !important; }
  /* failures: two query / wrong top-1 pairs a row, in smaller print (they are examples, not the answer) */
  #failures-gallery .grid-container { grid-template-columns: repeat(4, minmax(0, 1fr)) !important; }
  #failures-gallery .caption-label { font-size: 0.7em; }
}
"""


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
    facts = GalleryFacts.of(service)
    info = service.describe()
    with gr.Blocks(title="Image retrieval", analytics_enabled=False) as demo:
        # first, in plain words; the details fold away
        gr.Markdown(f"## {markdown_text(facts.purpose(), MAX_PROSE_CHARS)}", elem_id="purpose",
                    latex_delimiters=NO_LATEX)
        with gr.Accordion("Index and model", open=False, elem_id="about"):
            gr.Markdown(
                f"**Image retrieval** · {info['vectors']} images · {markdown_code(info['index_key'])} · "
                f"{info['embedding_dim']}-d embeddings · "
                + (f"model {markdown_code(info['model_hash'])}" if info.get("model_hash") is not None
                   else "no model (built from embeddings)"),
                elem_id="technical-header"
            )
        # the tabs that show metrics, named on the Search tab: Results only with a grid to show
        tabs = ("Evaluation", *(("Results",) if results is not None else ()), "Index")
        with gr.Tabs():
            with gr.Tab("Search", id="search"):
                SearchTab(service, examples, UploadRecords(demo), facts, tabs).build(demo)
            with gr.Tab("Evaluation", id="evaluation"):
                EvaluationTab(service, Path(report) if report else None, facts).build(demo)
            if results is not None:  # a results grid belongs to the data it was measured on: only when given
                with gr.Tab("Results", id="results"):
                    ResultsTab(Path(results)).build(demo)
            with gr.Tab("Index", id="index"):
                IndexTab(service).build(demo)
    return demo, example_dir
