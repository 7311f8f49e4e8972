"""The Gradio app: Search, Evaluation, Results and Index tabs over one ``SearchService``."""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr
from PIL import Image

from retrieval.analysis.results import RESULTS_COMMAND, table_markdown
from retrieval.data import open_image
from retrieval.data.emoji import emoji_name, is_code_point_sequence
from retrieval.errors import ParameterError
from retrieval.index.filters import MAX_FILTER_CHARS, MAX_IN_VALUES
from retrieval.reports import READINGS_FILE
from retrieval.rerank import NONE, PAPER_NEIGHBOURHOOD, RERANKERS, RerankConfig, method_names
from retrieval.serve.curation_view import CurationView, ThresholdError, parse_threshold
from retrieval.serve.defaults import API_DOCS_PATH
from retrieval.serve.diagnostics import duplicates
from retrieval.serve.examples import example_ids
from retrieval.serve.images import QueryError, decode_base64
from retrieval.serve.reports import (
    MAP_EQUALS_RECALL_NOTE,
    MAX_PROSE_CHARS,
    METRIC_UNIT,
    RunReport,
    compatibility_plot,
    curves_plot,
    data_relation_markdown,
    domains_plot,
    embedding_map_note,
    embedding_map_plot,
    load_report,
    load_results,
    markdown_code,
    markdown_text,
    percent,
    recall_plot,
    results_curve_image,
    retrieval_plot,
    shown_text,
    summary_markdown,
    triplet_plot,
    wise_plot,
)
from retrieval.serve.service import NO_MATCH_NOTE, SearchResponse, SearchService, ServedIndex, no_model_refusal
from retrieval.serve.stats_view import human_bytes, statistics_markdown
from retrieval.serve.upload_cache import UploadRecords

log = logging.getLogger(__name__)

THUMBNAIL = 256
MAX_SLIDER_K = 100  # the K slider's top: the app shows at most this many results (the API allows MAX_K)
EXAMPLE_COUNT = 12
WORST_CLASSES = 10
DUPLICATES_SHOWN = 50
PICTURE_HEIGHT = 420  # a run report's plot on the Evaluation tab, in pixels
TALL_PICTURE_HEIGHT = 560  # the query grid (a row per query) and the embedding map with its legend
FAILURE_COLUMNS = 10  # failure thumbnails per row
INFO_JSON_BYTES = 1 << 20  # a data set's info.json is a few KiB; anything bigger is not one
NO_IMAGE = "Upload, paste or pick an image first."
METRIC_TABS = ("Evaluation", "Index")  # the tabs that show metrics on every page (Results: with a grid)
MAX_ERROR_CHARS = 2000  # the API's messages are a few lines; one that echoes a long filter is cut
MAX_NOTE_CHARS = 2000  # a note on the query, e.g. how a filter that matched nothing compares (it lists the columns)
MAX_PATH_CHARS = 1000  # a gallery path in a caption: whole, so that it can be copied into the filter box
IMAGE_STATUSES = (400, 413)  # the service's answers to an upload it cannot read (K and filter problems come first)
MAX_COLUMNS_SHOWN = 20  # a manifest's filter columns named in the where box's label
MAX_COLUMN_CHARS = 40  # each of those names (the index allows 64)
MAX_PICKED_LABEL_CHARS = 1000  # the label picker offers labels up to this long (a where holds 4,000 characters)
# Markdown components showing text from users: no LaTeX ($$ ... $$ in a label would be typeset as maths)
NO_LATEX: list[dict[str, Any]] = []
# Run in the page before a search: closes the pop-ups still open (they were about an earlier try).
CLOSE_TOASTS = "() => { document.querySelectorAll('.toast-close').forEach((button) => button.click()); return []; }"
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
/* Narrow screens: two columns, so that thumbnails and their captions keep a readable size. */
@media (max-width: 720px) {
  #results-gallery .grid-container { grid-template-columns: repeat(2, minmax(0, 1fr)) !important; }
  /* failures: two query / wrong top-1 pairs a row, in smaller print (they are examples, not the answer) */
  #failures-gallery .grid-container { grid-template-columns: repeat(4, minmax(0, 1fr)) !important; }
  #failures-gallery .caption-label { font-size: 0.7em; }
}
"""


def tab_names(tabs: Sequence[str]) -> str:
    """``Evaluation, Results and Index``: the tabs in the page's order, joined for a sentence."""
    return ", ".join(tabs[:-1]) + f" and {tabs[-1]}" if len(tabs) > 1 else "".join(tabs)


def read_dataset_info(folder: Path, levels: int = 2) -> dict[str, Any] | None:
    """The ``info.json`` that ``retrieval data prepare`` writes, in ``folder`` or up to ``levels`` folders above."""
    for candidate in [folder, *folder.parents][: levels + 1]:
        info = candidate / "info.json"
        try:
            if info.is_file() and info.stat().st_size <= INFO_JSON_BYTES:
                data = json.loads(info.read_text(encoding="utf-8"))
                if isinstance(data, dict) and isinstance(data.get("dataset"), str):
                    return data
        except (OSError, ValueError):
            continue
    return None


@dataclass(frozen=True)
class GalleryFacts:
    """What the index holds, for the page's opening line and its labels."""

    images: int
    labelled: int
    classes: int
    example_labels: list[str]
    folder: Path | None  # the folder holding the gallery's files
    dataset: dict[str, Any] | None  # info.json of a `retrieval data prepare` folder: "dataset", "description"
    unicode_labels: bool  # every label is a code-point sequence (1F600, 1F469-200D-1F52C): shown with its name

    @classmethod
    def of(cls, service: SearchService) -> GalleryFacts:
        """The facts of the state served now (one state for all of them)."""
        with service.acquire() as state:
            return cls.of_state(state)

    @classmethod
    def of_state(cls, state: ServedIndex) -> GalleryFacts:
        """The facts of one served state."""
        labels = [label for _, label in state.catalogue.labelled()]
        classes = sorted(set(labels))
        paths = [row["path"] for row in state.catalogue.sample(200)]
        try:
            folder = Path(os.path.commonpath([str(Path(p).parent) for p in paths])) if paths else None
        except ValueError:  # files on different drives
            folder = None
        return cls(
            images=len(state),
            labelled=len(labels),
            classes=len(classes),
            example_labels=classes[: min(3, len(classes))],
            folder=folder,
            dataset=read_dataset_info(folder) if folder else None,
            unicode_labels=bool(classes) and all(is_code_point_sequence(c) for c in classes),
        )

    def label_name(self, label: str | None) -> str | None:
        """The Unicode name of a code-point label (``GRINNING FACE`` for ``1F600``), else None."""
        return emoji_name(label) if label is not None and self.unicode_labels else None

    def label_text(self, label: str | None) -> str:
        """A label as shown, as plain text: ``1F600 · GRINNING FACE`` for code points Python's unicodedata names,
        else as is; one line, cut at ``MAX_SHOWN_CHARS`` (escape it for Markdown: ``markdown_text``)."""
        if label is None:
            return "(no label)"
        name = self.label_name(label)
        return shown_text(f"{label} · {name}" if name else label)

    def reading(self) -> dict[str, Any]:
        """How the data set's info.json says this gallery is read (``readings``: ``twin`` where every label is a
        code-point sequence, else ``subgroup``), falling back to its top-level texts; {} without info.json. Keys:
        ``purpose``, ``description`` and ``right`` (what a ✓ means)."""
        info = self.dataset or {}
        readings = info.get("readings")
        if isinstance(readings, dict):
            chosen = readings.get("twin" if self.unicode_labels else "subgroup")
            if isinstance(chosen, dict):
                return chosen
        return {key: info[key] for key in ("purpose", "description") if key in info}

    def purpose(self) -> str:
        """The page's first line: what the gallery is for, in one plain sentence (its info.json's "purpose" for the
        way it is read, as its preparer wrote it, else what any gallery offers), as plain text."""
        purpose = self.reading().get("purpose")
        if isinstance(purpose, str) and purpose.strip():
            return shown_text(purpose, MAX_PROSE_CHARS)
        if self.labelled:
            return "Find the images of this gallery most like yours, and whether they share its label."
        return "Find the images of this gallery most like yours."

    def intro_markdown(self, service: SearchService, tabs: Sequence[str] = METRIC_TABS) -> str:
        """The opening lines: what the gallery holds and where from, what to try, what the score means, and which
        of the page's ``tabs`` show metrics (every name and label in it escaped: they are anyone's text)."""
        info = service.describe()
        if self.labelled:
            labels = ", ".join(markdown_code(self.label_text(label)) for label in self.example_labels)
            kind = "Unicode code points with their names" if self.unicode_labels else "class names"
            holds = (f"**{self.images} images** in **{self.classes} classes** ({self.labelled} labelled; labels are "
                     f"{kind}, e.g. {labels})")
        else:
            holds = f"**{self.images} images** without labels"
        source = ""
        if self.dataset is not None:
            source = f" from the {markdown_code(self.dataset['dataset'])} data set"
            description = self.reading().get("description")  # what a query should find, as its preparer says
            if isinstance(description, str) and description:
                source += f", {markdown_text(description, MAX_PROSE_CHARS)}"
        right = self.reading().get("right")  # what a ✓ means for this reading, else a shared label
        right = markdown_text(right, MAX_PROSE_CHARS) if isinstance(right, str) and right else "same label"
        # names, no server paths
        where = f" Files in the gallery folder {markdown_code(self.folder.name)}" if self.folder else ""
        return (
            f"**The gallery:** {holds}{source}.{where}; index {markdown_code(service.index_dir.name)} (index.json: "
            f"{markdown_code(info['index_key'])}, {info['embedding_dim']}-d embeddings {model_words(info)}, labels "
            "from its catalogue).\n\n"
            "**Try it:** upload or paste an image (or click one of the examples below the results) and press "
            "Search: the K gallery images nearest to it appear, best first. A query that is itself a gallery "
            f"image is left out of its own results, and each result is marked ✓ ({right}) or ✗.\n\n"
            "**Score:** the cosine similarity of the L2-normalised embeddings, from -1 to 1 (1 = identical "
            f"direction, 0 = unrelated). Metrics ({tab_names(tabs)} tabs) are in percent ({METRIC_UNIT}).\n\n"
            f"**From a program:** the JSON API, documented at [{API_DOCS_PATH}]({API_DOCS_PATH}) (OpenAPI; also "
            "/redoc): `POST /search` with an image file or an embedding."
        )


class ExampleSet:
    """Gallery images offered as example queries, copied so that Gradio serves nothing else of the gallery."""

    def __init__(self, service: SearchService, folder: Path, count: int = EXAMPLE_COUNT) -> None:
        self.files: list[str] = []
        with service.acquire() as state:  # the rows and their files from one state (serve/examples.py: the rule)
            for image_id in example_ids(state, count) if count > 0 else []:
                path = service.image_path(image_id, state)
                if path is not None:
                    copy = folder / f"{image_id}{path.suffix.lower()}"
                    shutil.copyfile(path, copy)
                    self.files.append(str(copy))


def thumbnail(path: Path | None) -> Image.Image:
    if path is None:
        return Image.new("RGB", (THUMBNAIL, THUMBNAIL), (230, 230, 230))
    image = open_image(path)
    image.thumbnail((THUMBNAIL, THUMBNAIL))
    return image


def upload_name(upload: Any) -> str | None:
    """The file name the visitor's browser gave an upload (None for a pasted image or an example)."""
    name = upload.get("orig_name") if isinstance(upload, dict) else None
    return name if isinstance(name, str) and name else None


def model_words(info: dict[str, Any]) -> str:
    """Which model made the index's embeddings, for the page: its hash, or none (built from embeddings: searched
    with embeddings through the API)."""
    if info.get("model_hash") is None:
        return "built from embeddings, no model (search it with an embedding through the API)"
    return f"of model {markdown_code(info['model_hash'])}"


def failure_markdown(title: str, exc: Exception, name: str | None = None) -> str:
    """A failed search's status line: what failed (and which file), then the API's message, escaped (it may echo
    the visitor's filter)."""
    named = f" {markdown_code(name)}" if name else ""
    return f"⚠️ **{title}{named}:** {markdown_text(exc, MAX_ERROR_CHARS)}"


def unexpected_markdown(title: str, exc: Exception) -> str:
    """A curation button's unexpected failure, named on the page (its kind and message; an OS error without its
    file name, which is the server's) and logged whole: the page would otherwise show a bare "Error"."""
    log.error("%s", title, exc_info=exc)
    message = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"⚠️ **{title}:** {markdown_text(f'{type(exc).__name__}: {message}', MAX_ERROR_CHARS)}"


def unlike_markdown(response: SearchResponse, condition: str | None) -> str:
    """The hint for a query unlike the gallery: its best score against the gallery's own nearest-neighbour
    similarities (``NeighbourScores``)."""
    neighbours = response.neighbours
    assert neighbours is not None
    share = f"{100 * (1 - neighbours.quantile):g} %"
    among = "among the images matching the filter " if condition else "in the gallery "
    return (f"⚠️ **Nothing {among}is much like this image:** the best result scores "
            f"{response.results[0].score:.3f}, while {share} of the gallery's own images have a nearest other image "
            f"scoring {neighbours.floor:.3f} or more. The results are the least unlike it, not matches.")


class SearchTab:
    def __init__(self, service: SearchService, examples: ExampleSet, uploads: UploadRecords,
                 facts: GalleryFacts | None = None, tabs: Sequence[str] = METRIC_TABS) -> None:
        self.service, self.examples, self.uploads = service, examples, uploads
        self.facts = facts or GalleryFacts.of(service)
        self.tabs = tabs  # the page's tabs that show metrics, named in the opening lines

    def max_k(self) -> int:
        """The slider's top, and the largest K a call may ask for."""
        return max(1, min(MAX_SLIDER_K, len(self.service)))

    def read_upload(self, upload: Any) -> bytes:
        """The query component's file (only one Gradio recorded as uploaded here, see ``UploadRecords``) or a
        pasted ``data:`` URL, as bytes, read no further than the service needs to refuse an oversized one."""
        if not upload:
            raise QueryError(NO_IMAGE)
        if isinstance(upload, dict) and isinstance(upload.get("url"), str) and upload["url"].startswith("data:"):
            return decode_base64(upload["url"], self.service.max_upload_bytes)  # a pasted image sent inline
        path = upload.get("path") if isinstance(upload, dict) else upload  # a plain string: the same rule
        return self.uploads.read(path, self.service.max_upload_bytes)

    def check_k(self, k: Any) -> int:
        """K as the slider allows it: a whole number from 1 to ``max_k()`` (a call can send anything)."""
        top = self.max_k()
        if isinstance(k, float) and k.is_integer():  # JSON numbers: 5.0 is 5 (NaN and inf are not whole)
            k = int(k)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= top:
            raise QueryError(f"K must be a whole number from 1 to {top}, got {str(k)[:20]!r}")
        return int(k)

    @staticmethod
    def where(labels: Any, where: Any) -> str | None:
        """The filter of the picker (labels) and the where box, as one ``where`` expression (None: no filter)."""
        parts = []
        if labels:
            if not isinstance(labels, list) or not all(isinstance(v, str) for v in labels):
                raise QueryError("the label filter must be a list of labels", 422)
            if len(labels) > MAX_IN_VALUES:
                raise QueryError(f"pick at most {MAX_IN_VALUES} labels", 422)
            quoted = ", ".join('"' + label.replace('"', '""') + '"' for label in labels)
            parts.append(f"label in ({quoted})")
        if where is not None and not isinstance(where, str):
            raise QueryError("the filter must be text, e.g. split = \"test\"", 422)
        if where and where.strip():
            parts.append(f"({where})" if parts else where)
        return " and ".join(parts) or None

    @staticmethod
    def rerank(method: Any) -> RerankConfig | None:
        """The re-ranking picked (its default parameters), None for none; a call can send anything."""
        if method is None or method == NONE:
            return None
        if not isinstance(method, str) or method not in RERANKERS:
            raise QueryError(f"re-ranking must be one of {', '.join(method_names())}, got {str(method)[:20]!r}", 422)
        return RerankConfig(method=method)

    def search(self, upload: Any, k: float, labels: Any = None, where: Any = None, rerank: Any = None
               ) -> tuple[list[tuple[Image.Image, str]], str, Any]:
        """The results, the status line and the query box after a search.

        It searches with the uploaded file's bytes exactly as the API does: the same decoder and messages, and a
        query that is a gallery item (identical bytes) is left out of its own results (``exclude_self``);
        ``labels`` (the picker) and ``where`` (the filter box) restrict the results as the API's where does. A
        search that fails replaces the previous results and status with what went wrong, inline: the next search
        replaces it in turn (a pop-up would stay over later results). An upload that cannot be read leaves the
        query box, where the browser would show it as a broken image. ``rerank`` (the re-ranking picker) re-orders
        the shortlist as the API's ``rerank`` does.
        """
        keep = gr.skip()
        try:
            k = self.check_k(k)
            condition = self.where(labels, where)
            reranking = self.rerank(rerank)
        except QueryError as exc:
            return [], failure_markdown("Cannot search", exc), keep
        state = self.service.current()
        if not state.index.has_model:  # built from embeddings: nothing can embed an upload
            return [], failure_markdown("Cannot search with an image", no_model_refusal(state)), keep
        try:
            data = self.read_upload(upload)
        except QueryError as exc:
            return [], failure_markdown("Cannot search with this image", exc, upload_name(upload)), None
        try:
            response = self.service.search(data, k, exclude_self=True, where=condition, calibrate=True,
                                           rerank=reranking)
        except QueryError as exc:
            if exc.status in IMAGE_STATUSES:  # the upload itself: unreadable, too large, too many pixels
                return [], failure_markdown("Cannot search with this image", exc, upload_name(upload)), None
            title = "Cannot use this filter" if exc.status == 422 and condition else "Cannot search"
            return [], failure_markdown(title, exc), keep
        return self.results(response), self.status(response, condition), keep

    def results(self, response: SearchResponse) -> list[tuple[Image.Image, str]]:
        """The gallery's thumbnails and captions: score, label, and the path the API gives and filters compare."""
        known = response.query_item
        items = []
        for result in response.results:  # captions are shown as text; label_text and shown_text bound them
            caption = (f"{result.score:.3f} · {self.facts.label_text(result.label)} · "
                       f"{shown_text(result.path, MAX_PATH_CHARS)}")
            if known is not None and known.label is not None:
                caption = ("✓ " if result.label == known.label else "✗ ") + caption
            items.append((thumbnail(self.service.image_path(result.id)), caption))
        return items

    def status(self, response: SearchResponse, condition: str | None) -> str:
        """The status line of a search that ran: what it found (or why nothing), how long it took, what the query
        is, and whether anything in the gallery is much like it."""
        known, t, count = response.query_item, response.timing, len(response.results)
        filtered = f" matching {markdown_code(condition)}" if condition else ""  # its labels are anyone's text
        lines = []
        # e.g. an animated image's first frame; a filter that matches nothing, with how values are compared
        lines += [f"⚠️ {markdown_text(note, MAX_NOTE_CHARS)}" for note in response.notes]
        unmatched = any(note.startswith(NO_MATCH_NOTE) for note in response.notes)
        if not count and condition and response.excluded_self and not unmatched:  # it matched the query alone
            lines.append("⚠️ Only the query image itself matches the filter, and a query is left out of its own "
                         "results.")
        if response.unlike_gallery():
            lines.append(unlike_markdown(response, condition))
        if response.rerank is not None:
            method = RERANKERS[response.rerank.method]
            sizes = ", ".join(f"{name} = {value}" for name, value in response.rerank.params().items()
                              if name in PAPER_NEIGHBOURHOOD)
            chosen = (f" (sizes from the gallery: {markdown_text(response.rerank_defaults, MAX_NOTE_CHARS)})"
                      if response.rerank_defaults else "")
            lines.append(f"Re-ranked by **{method.title}** ({method.paper}) over up to "
                         f"{response.rerank.candidates} top candidates, {sizes}{chosen}; the scores shown are still "
                         "cosine similarities.")
        lines.append(
            f"**{count} results**{filtered} · embed {t.get('embed_ms', 0):.1f} ms "
            f"(batch of {int(t.get('batch_size', 1))}) · search {t['search_ms']:.1f} ms · "
            f"total {t['total_ms']:.1f} ms"
        )
        if known is not None:
            correct = sum(r.label == known.label for r in response.results)
            name = self.facts.label_name(known.label)
            label = markdown_text(known.label) if known.label is not None else "(no label)"
            lines.append(
                f"Query is gallery image #{known.id} ({markdown_code(known.path, MAX_PATH_CHARS)}, "
                f"label **{label}**{f' · {name}' if name else ''}), left out of its own results; "
                f"{correct}/{count} results share its label (✓ correct, ✗ wrong)."
            )
        return "\n\n".join(lines)

    @staticmethod
    def close_preview() -> Any:
        """Close the results' enlarged view (runs before each search, so the new results show as a grid)."""
        return gr.Gallery(selected_index=None)

    def build(self) -> None:
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=280):
                # the uploaded file itself (preprocess=False below): decoded by the API's decoder, not Gradio's
                query = gr.Image(
                    type="filepath",
                    image_mode=None,
                    sources=["upload", "clipboard"],
                    label="Query image",
                    elem_id="query-image",
                    height=280,
                )
                top_k = gr.Slider(
                    1,
                    self.max_k(),
                    value=min(10, len(self.service)),
                    step=1,
                    label="K (number of results)",
                    elem_id="top-k",
                )
                rerank_pick = gr.Dropdown(
                    choices=[("none (the index's order)", NONE)]
                    + [(f"{name}: {method.title}", name) for name, method in RERANKERS.items()],
                    value=NONE, label="Re-ranking", elem_id="rerank-method",
                    info="re-orders the top candidates, over neighbourhoods sized to the gallery's labels: helps "
                         "where it holds many images of a thing (kreciprocal, qe), seldom where it holds one or two "
                         "(docs/RESULTS.md, Re-ranking)",
                )
                with gr.Accordion("Filter the gallery", open=False, elem_id="filter"):
                    # a label longer than a filter may be is left out: the page's config would carry it whole
                    labels = sorted({label for _, label in self.service.current().catalogue.labelled()
                                     if len(label) <= MAX_PICKED_LABEL_CHARS})
                    label_pick = gr.Dropdown(
                        choices=[(self.facts.label_text(label), label) for label in labels[:MAX_IN_VALUES]],
                        multiselect=True, value=[], label="Only these labels", elem_id="label-filter",
                        visible=bool(labels),
                    )
                    where_box = gr.Textbox(
                        label=f"Only images where (columns: {self.column_names()})",
                        placeholder='e.g. path < "m" and id > 100', max_length=MAX_FILTER_CHARS,
                        elem_id="where-filter",
                    )
                button = gr.Button("Search", variant="primary", elem_id="search-button")
                timing = gr.Markdown(elem_id="search-timing", latex_delimiters=NO_LATEX)
            with gr.Column(scale=3, min_width=280):
                gallery = gr.Gallery(
                    label="Results (cosine similarity · label)",
                    columns=5,
                    height="auto",
                    object_fit="contain",
                    elem_id="results-gallery",
                    allow_preview=True,
                )
        # after the results, so that on a narrow screen (one column) the results come first
        if self.examples.files:
            examples = gr.Examples(
                [[file] for file in self.examples.files],
                inputs=[query],
                label="Examples from the gallery: click one to search with it (results are marked ✓/✗ by label)",
                examples_per_page=EXAMPLE_COUNT,
                elem_id="search-examples",
            )
            examples.load_input_event.then(
                self.close_preview, None, gallery, queue=False, show_progress="hidden", api_visibility="private",
                js=CLOSE_TOASTS,
            ).then(self.search, [query, top_k, label_pick, where_box, rerank_pick], [gallery, timing, query],
                   preprocess=False, api_name="example_search", api_visibility="private")
        # the enlarged view closes first: Gallery keeps it open on the same index when only its value changes; a
        # pop-up still open (Gradio's own, e.g. a file over the size limit) is closed: it was about an earlier try
        button.click(
            self.close_preview, None, gallery, queue=False, show_progress="hidden", api_visibility="private",
            js=CLOSE_TOASTS,
        ).then(self.search, [query, top_k, label_pick, where_box, rerank_pick], [gallery, timing, query],
               api_name="search", preprocess=False)
        # what the gallery is and how to read the results: after the search itself, so the upload box comes first
        gr.Markdown(self.facts.intro_markdown(self.service, self.tabs), elem_id="intro", latex_delimiters=NO_LATEX)

    def column_names(self) -> str:
        """The columns a where may name (a manifest's, so anyone's text): the first ``MAX_COLUMNS_SHOWN``, each
        cut, as plain text (a label is not Markdown)."""
        names = list(self.service.current().index.filter_table.names())
        shown = ", ".join(shown_text(name, MAX_COLUMN_CHARS) for name in names[:MAX_COLUMNS_SHOWN])
        return shown + (f", … ({len(names) - MAX_COLUMNS_SHOWN} more)" if len(names) > MAX_COLUMNS_SHOWN else "")


REPORT_REFUSED = (
    "**Cannot open the report:** this page opens run reports (.json files written by `retrieval train` or "
    "`retrieval evaluate`) in the server's working folder or in the run folder of its --report, and this is not "
    "one of them. Start the server with `--report PATH` for another one."
)  # one answer for every refusal: it tells neither whether a file exists nor where the server's folders are


@dataclass(frozen=True)
class ReportPicture:
    """One picture of a run report on the Evaluation tab: a tab of its own, shown only when the report has it."""

    key: str  # the tab's id
    title: str  # the tab's name
    draw: Callable[[RunReport], Image.Image | None]
    elem_id: str
    height: int  # on the page, in pixels: the picture fits inside (the full-screen button shows it whole)


# in their order on the page; the tabs keep the tab as tall as one picture, not the sum of seven
REPORT_PICTURES = (
    ReportPicture("recall", "Recall@K", recall_plot, "recall-plot", PICTURE_HEIGHT),
    ReportPicture("curves", "Training curves", curves_plot, "curves-plot", PICTURE_HEIGHT),
    ReportPicture("triplet", "Hard triplets", triplet_plot, "triplet-plot", PICTURE_HEIGHT),
    ReportPicture("domains", "In and out of domain", domains_plot, "domains-plot", PICTURE_HEIGHT),
    ReportPicture("wise", "WiSE-FT", wise_plot, "wise-plot", PICTURE_HEIGHT),
    ReportPicture("compatibility", "Compatibility", compatibility_plot, "compatibility-plot", PICTURE_HEIGHT),
    ReportPicture("retrieval", "Queries and their top 5", retrieval_plot, "retrieval-plot", TALL_PICTURE_HEIGHT),
    ReportPicture("map", "Embedding map", embedding_map_plot, "embedding-map-plot", TALL_PICTURE_HEIGHT),
)


def _mtime(path: Path) -> int | None:
    """``path``'s modification time, None when it is not there: a file the page shows beside another."""
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


class EvaluationTab:
    def __init__(self, service: SearchService, report: Path | None, facts: GalleryFacts | None = None) -> None:
        self.service, self.report, self.facts = service, report, facts or GalleryFacts.of(service)
        self._cache: dict[tuple[str, int, int | None], tuple] = {}
        self.curation = CurationView(service)

    def report_folders(self) -> list[Path]:
        """The folders whose reports the page may open: the server's working folder and the run folder of its
        ``--report``; never a filesystem root (a report or a server started there would open the whole disk)."""
        folders = [Path.cwd().resolve()] + ([Path(self.report).resolve().parent] if self.report else [])
        return [folder for folder in folders if folder != Path(folder.anchor)]

    def shown_path(self) -> str:
        """The ``--report`` as the page shows it: relative to the working folder, else its file name (which
        ``target`` finds in the run folder), never a server folder."""
        if not self.report:
            return ""
        resolved = Path(self.report).resolve()
        return str(resolved.relative_to(Path.cwd().resolve())) if resolved.is_relative_to(Path.cwd().resolve()) \
            else resolved.name

    def target(self, path: str) -> Path | None:
        """The file a typed path names if the page may open it, else None. A relative path is looked up in the
        working folder, then in the run folder; ``~`` is not expanded (it would name the server user's home)."""
        folders = self.report_folders()
        typed = Path(path)
        for candidate in [typed] if typed.is_absolute() else [folder / typed for folder in folders]:
            resolved = candidate.resolve()
            if resolved.suffix == ".json" and any(resolved.is_relative_to(f) for f in folders) and resolved.exists():
                return resolved
        return None

    def open_report(self, path: str) -> tuple[Any, ...]:
        """The report's summary, metrics table, pictures (each in its tab, the tabs of missing ones hidden) and
        the note on what the embedding map shows; drawn once per report file version."""
        if not path:
            return ("No run report is open: start the server with `--report RUN_DIR/report.json`, or enter a "
                    "report's path above, to see a run's metrics and curves here.", *self.nothing_shown())
        target = self.target(path)
        try:
            key = (str(target), target.stat().st_mtime_ns, _mtime(target.with_name(READINGS_FILE))) \
                if target is not None else None
        except OSError:
            key = None
        if key is None:
            return REPORT_REFUSED, *self.nothing_shown()
        if key not in self._cache:
            try:
                report = load_report(target)
            except (OSError, ValueError):
                return REPORT_REFUSED, *self.nothing_shown()
            headers, rows = report.metrics_table()  # shown as text (Dataframe's "str"), cut by metrics_table
            summary = summary_markdown(report, shown=path) + data_relation_markdown(
                report, self.service.current().index.info.get("gallery_root"), self.service.index_dir.name)
            if report.map_equals_recall():
                summary += f"\n\n{MAP_EQUALS_RECALL_NOTE}"
            pictures = [picture.draw(report) for picture in REPORT_PICTURES]
            self._cache = {key: (summary, headers, rows, pictures, embedding_map_note(report))}  # the latest only
        # the drawn pictures are cached; the updates are made afresh for each page (Gradio consumes them)
        summary, headers, rows, pictures, map_note = self._cache[key]
        first = next((p.key for p, image in zip(REPORT_PICTURES, pictures, strict=True) if image is not None), None)
        return (summary, gr.update(value=rows, headers=headers, visible=True),
                gr.Tabs(selected=first, visible=first is not None),
                *(gr.Tab(visible=image is not None) for image in pictures),
                *(gr.update(value=image) for image in pictures),
                gr.update(value=map_note or "", visible=map_note is not None))

    @staticmethod
    def nothing_shown() -> tuple[Any, ...]:
        """The report's table and pictures when no report is open: hidden, not empty."""
        return (gr.update(value=None, visible=False), gr.Tabs(visible=False),
                *(gr.Tab(visible=False) for _ in REPORT_PICTURES), *(gr.update(value=None) for _ in REPORT_PICTURES),
                gr.update(value="", visible=False))

    def worst_classes(self) -> tuple[str, Any, Any]:
        """Leave-one-out per class: the worst classes (Recall@1, then rank of the first correct) and failures, each
        image captioned with its path as the API and filters spell it; the table and the failures are hidden when
        there are none."""
        with self.service.acquire() as state:  # the analysis, the files and their paths of one state
            loo = state.leave_one_out()
            if not loo.classes:
                return (f"No per-class analysis: {loo.note}.", gr.Dataframe(value=None, visible=False),
                        gr.Gallery(value=None, visible=False))
            worst = loo.classes[:WORST_CLASSES]
            shown_failures = [failure for c in worst for failure in c.failures[:1]]
            rows_of = state.index.indexed_rows([i for f in shown_failures for i in (f.query_id, f.top1_id) if i >= 0])

            def path_of(image_id: int) -> str:
                row = rows_of.get(image_id)
                return shown_text(state.public_path(row["path"]), MAX_PATH_CHARS) if row else "(missing)"

            pairs = []
            for failure in shown_failures:
                pairs.append((thumbnail(self.service.image_path(failure.query_id, state)),
                              f"query: {self.facts.label_text(failure.query_label)} · {path_of(failure.query_id)}"))
                top1 = self.service.image_path(failure.top1_id, state) if failure.top1_id >= 0 else None
                pairs.append((thumbnail(top1), f"✗ {failure.score:.3f} · top-1: "
                              f"{self.facts.label_text(failure.top1_label)} · {path_of(failure.top1_id)}"))
        depth = loo.classes[0].depth
        summary = (
            f"Leave-one-out over the index ({loo.note}, {loo.queries} queries): each labelled image is searched "
            f"against all others; Recall@1 = **{percent(loo.recall_at_1)} {METRIC_UNIT}**. Worst classes first: "
            "lowest Recall@1, then the highest mean rank of the first result with the right label (1 = always "
            f"top-1; a query with none in the top {depth} counts as {depth + 1})."
        )
        rows = [[self.facts.label_text(c.label), c.queries, c.correct, percent(c.recall_at_1),
                 round(c.mean_first_rank, 1), ", ".join(map(str, c.first_ranks[:8]))] for c in worst]
        headers = ["class", "queries", "correct top-1", f"Recall@1 ({METRIC_UNIT})", "mean rank of first correct",
                   "first-correct rank per query"]
        if not pairs:
            summary += " No query's top-1 has another label, so there are no failures to show."
        return summary, gr.Dataframe(value=rows, headers=headers, visible=True), gr.Gallery(value=pairs,
                                                                                            visible=bool(pairs))

    def duplicates(self) -> tuple[str, Any, Any]:
        """The gallery files the index skipped as exact copies (same sha256) of an indexed one, with their twins,
        by the paths the API and filters use; the table folds away (there may be many)."""
        with self.service.acquire() as state:
            total, found = duplicates(state.catalogue, DUPLICATES_SHOWN)
            label = self.facts.label_text

            def where(path: str | None) -> str:
                return shown_text(state.public_path(path), MAX_PATH_CHARS) if path else "(missing)"

            rows = [[d.id, label(d.label), where(d.path), d.twin_id, label(d.twin_label), where(d.twin_path)]
                    for d in found]
        if not total:
            return ("No duplicates: every gallery file has distinct bytes.", gr.Accordion(visible=False),
                    gr.Dataframe(value=None))
        shown = f" (the first {len(found)} in the table)" if total > len(found) else ""
        text = (f"**Skipped as duplicates: {total}**{shown}. Their bytes equal those of an indexed file (the twin), "
                "or, left out by `retrieval index add --duplicates skip`, their picture nearly does, so only the "
                "twin is searched; where the two carry different labels, the twin stands for both.")
        headers = ["skipped id", "its label", "file", "twin id (indexed)", "twin's label", "twin's file"]
        return text, gr.Accordion(visible=True), gr.Dataframe(value=rows, headers=headers)

    def near_duplicates(self, threshold_text: str) -> tuple[str, Any, Any]:
        """The served index's near-duplicate groups at the typed threshold (auto: calibrated on planted copies):
        a sentence, a table (a row per image, its group's first image first) and the picture of the first groups."""
        try:
            summary, picture = self.curation.duplicates(parse_threshold(threshold_text))
        except ThresholdError as exc:
            return f"**{markdown_text(exc)}**", gr.Dataframe(value=None, visible=False), gr.Image(visible=False)
        except (ParameterError, QueryError) as exc:
            return (f"**No near-duplicate groups:** {markdown_text(exc, MAX_ERROR_CHARS)}",
                    gr.Dataframe(value=None, visible=False), gr.Image(visible=False))
        except Exception as exc:  # noqa: BLE001  (said on the page, not a bare "Error")
            return (unexpected_markdown("No near-duplicate groups", exc), gr.Dataframe(value=None, visible=False),
                    gr.Image(visible=False))
        calibration = summary["calibration"]
        how = (f"calibrated (auto) on {calibration['copies']} copies planted of {calibration['images']} gallery images "
               f"(resized, re-encoded, cropped, recoloured): {percent(calibration['copy_recall'])} {METRIC_UNIT} of "
               f"them reach it, and {percent(calibration['neighbour_share'])} {METRIC_UNIT} of those images' nearest "
               "other image" if calibration else "as typed")
        sampled = f" (a sample of {summary['images']} of {summary['indexed']})" if summary["sampled"] else ""
        text = (f"**{summary['groups_found']} groups of near-duplicates** ({summary['copies_in_groups']} copies) among "
                f"the indexed images{sampled}, linked where one is among the other's {summary['k']} nearest at cosine "
                f"≥ **{summary['threshold']:.3f}** ({how}). The first of each group is the one indexed first.")
        # the calibration's and the label-mixed groups' warnings, where people read before removing anything
        text += "".join(f"\n\n**Warning:** {markdown_text(warning, MAX_ERROR_CHARS)}"
                        for warning in summary.get("warnings", []))
        if not summary["groups_found"]:
            return text, gr.Dataframe(value=None, visible=False), gr.Image(visible=False)
        rows = [[number, ("kept" if position == 0 else "copy") + (" (labels differ)" if group.get("labels_mixed")
                                                                    else ""), image_id, self.facts.label_text(label),
                 shown_text(path or "(missing)", MAX_PATH_CHARS), "" if similarity is None else round(similarity, 4)]
                for number, group in enumerate(summary["groups"], 1)
                for position, (image_id, path, label, similarity) in enumerate(
                    zip(group["ids"], group["paths"], group["labels"], group["similarities"], strict=True))]
        headers = ["group", "role", "id", "label", "file", "cosine to the first"]
        return (text, gr.Dataframe(value=rows, headers=headers, visible=True),
                gr.Image(value=picture, visible=picture is not None))

    def label_suspects(self) -> tuple[str, Any, Any]:
        """The served index's label suspects (a kNN vote read by confident learning): a sentence, a table ranked
        by score and the picture of the first ones with their neighbours."""
        try:
            summary, picture, problem = self.curation.suspects()
        except QueryError as exc:
            summary, picture, problem = None, None, str(exc)
        except Exception as exc:  # noqa: BLE001  (said on the page, not a bare "Error")
            return (unexpected_markdown("The label audit failed", exc), gr.Dataframe(value=None, visible=False),
                    gr.Image(visible=False))
        if summary is None or problem is not None:
            return (f"**No label audit:** the index {markdown_text(problem, MAX_ERROR_CHARS)}.",
                    gr.Dataframe(value=None, visible=False), gr.Image(visible=False))
        sampled = f" (a sample of {summary['images']} of {summary['indexed']})" if summary["sampled"] else ""
        text = (f"**{summary['suspects_found']} label suspects** among {summary['voted']} labelled images{sampled}: "
                f"each image's {summary['k']} nearest others vote for their labels (weighted by cosine); as in "
                "confident learning, a class wins where its share reaches that class's average share for its own "
                "images, and an image is a suspect where the winner is not its label. Score = the winner's share "
                "minus its label's; highest first.")
        label = self.facts.label_text
        rows = [[rank, suspect["id"], label(suspect["label"]), label(suspect["suggested"]), suspect["score"],
                 suspect["self_confidence"], shown_text(suspect["path"] or "(missing)", MAX_PATH_CHARS)]
                for rank, suspect in enumerate(summary["suspects"], 1)]
        headers = ["rank", "id", "its label", "neighbours suggest", "score", "its label's share", "file"]
        return (text, gr.Dataframe(value=rows, headers=headers, visible=bool(rows)),
                gr.Image(value=picture, visible=picture is not None))

    def build(self, demo: gr.Blocks) -> None:
        gr.Markdown("## Run report (a training or evaluation run: its own data, not necessarily this index's)")
        # the report's fields and the gallery's labels are anyone's text: escaped where they are put in, no LaTeX
        with gr.Row():
            path = gr.Textbox(
                value=self.shown_path(),
                label="Run report (report.json of `retrieval train` or `retrieval evaluate`)",
                scale=4,
                elem_id="report-path",
            )
            button = gr.Button("Open report", scale=1)
        summary = gr.Markdown(elem_id="report-summary", latex_delimiters=NO_LATEX)
        visible = self.report is not None  # the page's first state; open_report hides what a report lacks
        metrics = gr.Dataframe(label=f"Metrics, in percent ({METRIC_UNIT})", interactive=False,
                               elem_id="metrics-table", visible=visible)
        # one picture at a time, each in a tab of its own: the tab is as tall as one picture, not the sum of seven
        with gr.Tabs(elem_id="report-pictures", visible=visible) as picture_tabs:
            tabs, images = [], []
            for picture in REPORT_PICTURES:
                with gr.Tab(picture.title, id=picture.key, elem_id=f"{picture.elem_id}-tab", visible=visible) as tab:
                    if picture.key == "map":  # what the map draws, above it: read before the picture
                        map_note = gr.Markdown(elem_id="embedding-map-note", latex_delimiters=NO_LATEX)
                    # plots carry their own titles: no label badge over them
                    images.append(gr.Image(label=picture.title, show_label=False, type="pil", interactive=False,
                                           height=picture.height, elem_id=picture.elem_id))
                tabs.append(tab)
        # what follows is measured on the index being served, whatever report is open above
        gr.Markdown(f"## The index being served ({markdown_text(self.service.index_dir.name)})\n"
                    "### Classes with the worst Recall@1 in this index", latex_delimiters=NO_LATEX)
        loo_summary = gr.Markdown(elem_id="worst-summary", latex_delimiters=NO_LATEX)
        worst = gr.Dataframe(interactive=False, elem_id="worst-classes")
        failures = gr.Gallery(
            label="Example failures: query, then its wrong top-1",
            columns=FAILURE_COLUMNS,  # even: a query and its wrong top-1 stay side by side
            height="auto",
            object_fit="contain",
            elem_id="failures-gallery",
        )
        gr.Markdown("### Duplicates skipped by the index")
        duplicates_text = gr.Markdown(elem_id="duplicates-summary", latex_delimiters=NO_LATEX)
        with gr.Accordion("The duplicates and their twins", open=False, visible=False,
                          elem_id="duplicates") as duplicates_fold:
            duplicates_table = gr.Dataframe(interactive=False, elem_id="duplicates-table")
        # computed when asked for (bounded, kept for the state served): copies that differ in bytes, wrong labels
        gr.Markdown("### Near-duplicate groups (copies resized, re-encoded, cropped or recoloured)")
        with gr.Row():
            near_threshold = gr.Textbox(value="auto", label="Threshold: a cosine, or auto (calibrated on copies the "
                                        "app plants of gallery images)", scale=3, elem_id="near-duplicates-threshold")
            near_button = gr.Button("Find near-duplicates", scale=1, elem_id="near-duplicates-button")
        near_text = gr.Markdown(elem_id="near-duplicates-summary", latex_delimiters=NO_LATEX)
        near_table = gr.Dataframe(interactive=False, visible=False, elem_id="near-duplicates-table")
        near_picture = gr.Image(show_label=False, type="pil", interactive=False, visible=False,
                                height=TALL_PICTURE_HEIGHT, elem_id="near-duplicates-picture")
        gr.Markdown("### Label suspects (labels their neighbours disagree with)")
        audit_button = gr.Button("Audit the labels", elem_id="label-audit-button")
        audit_text = gr.Markdown(elem_id="label-audit-summary", latex_delimiters=NO_LATEX)
        audit_table = gr.Dataframe(interactive=False, visible=False, elem_id="label-audit-table")
        audit_picture = gr.Image(show_label=False, type="pil", interactive=False, visible=False,
                                 height=TALL_PICTURE_HEIGHT, elem_id="label-audit-picture")
        near_button.click(self.near_duplicates, [near_threshold], [near_text, near_table, near_picture],
                          api_name=False)
        audit_button.click(self.label_suspects, None, [audit_text, audit_table, audit_picture], api_name=False)
        outputs = [summary, metrics, picture_tabs, *tabs, *images, map_note]
        button.click(self.open_report, [path], outputs, api_name="open_report")
        demo.load(self.open_report, [path], outputs, api_name=False)
        demo.load(self.worst_classes, None, [loo_summary, worst, failures], api_name=False)
        demo.load(self.duplicates, None, [duplicates_text, duplicates_fold, duplicates_table], api_name=False)


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
                SearchTab(service, examples, UploadRecords(demo), facts, tabs).build()
            with gr.Tab("Evaluation", id="evaluation"):
                EvaluationTab(service, Path(report) if report else None, facts).build(demo)
            if results is not None:  # a results grid belongs to the data it was measured on: only when given
                with gr.Tab("Results", id="results"):
                    ResultsTab(Path(results)).build(demo)
            with gr.Tab("Index", id="index"):
                IndexTab(service).build(demo)
    return demo, example_dir
