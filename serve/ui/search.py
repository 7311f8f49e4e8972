"""The Search tab: a query image (upload, paste or gallery example) or a description in words (where the server has
a text model), K, filters and re-ranking -> the results."""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gradio as gr
from PIL import Image

from retrieval.index.display_columns import display_text
from retrieval.index.filters import MAX_FILTER_CHARS, MAX_IN_VALUES
from retrieval.rerank import NONE, PAPER_NEIGHBOURHOOD, RERANKERS, RerankConfig, method_names
from retrieval.serve.examples import example_ids
from retrieval.serve.images import QueryError, decode_base64
from retrieval.serve.page_text import markdown_code, markdown_text, shown_text
from retrieval.serve.service import SearchService
from retrieval.serve.service.answers import SearchResponse
from retrieval.serve.service.checks import no_model_refusal
from retrieval.serve.service.search import NO_MATCH_NOTE
from retrieval.serve.service.text import TextQuery, query_tokens
from retrieval.serve.ui.shared import MAX_ERROR_CHARS, MAX_PATH_CHARS, METRIC_TABS, NO_LATEX, GalleryFacts, thumbnail
from retrieval.serve.upload_cache import UploadRecords
from retrieval.text.tokens import MAX_TEXT_CHARS, check_query_text

MAX_SLIDER_K = 100  # the K slider's top: the app shows at most this many results (the API allows MAX_K)
EXAMPLE_COUNT = 12
NO_IMAGE = "Upload, paste or pick an image first."
NO_QUERY = "Upload, paste or pick an image, or describe what you look for in words, first."
MAX_NOTE_CHARS = 2000  # a note on the query, e.g. how a filter that matched nothing compares (it lists the columns)
IMAGE_STATUSES = (400, 413)  # the service's answers to an upload it cannot read (K and filter problems come first)
MAX_CAPTION_CHARS = 400  # a result's display columns in its caption (a title, a price)
SELECTED_ID = re.compile(r" · #(\d{1,18})$")  # the id a columns caption ends with (``results``)
MAX_COLUMNS_SHOWN = 20  # a manifest's filter columns named in the where box's label
MAX_COLUMN_CHARS = 40  # each of those names (the index allows 64)
MAX_PICKED_LABEL_CHARS = 1000  # the label picker offers labels up to this long (a where holds 4,000 characters)
MAX_TEXT_OFF_CHARS = 1500  # why a state has no text search and the commands that give it one
NO_TEXT_NOTE = ("Search by text is off: this server has no text model. Start it with one (`retrieval serve --index "
                "INDEX --text-model TEXT.onnx`), or record one in the index (`retrieval index text INDEX --text-model "
                "TEXT.onnx`).")
# Run in the page when a result is clicked: its caption, once the enlarged view shows it.
CLICKED_CAPTION = ("async () => { await new Promise((done) => setTimeout(done, 100)); const caption = "
                   "document.querySelector('#results-gallery .preview .caption'); "
                   "return caption ? caption.innerText.slice(-200) : ''; }")
# Run in the page before a search: closes the pop-ups still open (they were about an earlier try).
CLOSE_TOASTS = "() => { document.querySelectorAll('.toast-close').forEach((button) => button.click()); return []; }"


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


def upload_name(upload: Any) -> str | None:
    """The file name the visitor's browser gave an upload (None for a pasted image or an example)."""
    name = upload.get("orig_name") if isinstance(upload, dict) else None
    return name if isinstance(name, str) and name else None


def failure_markdown(title: str, exc: Exception, name: str | None = None) -> str:
    """A failed search's status line: what failed (and which file), then the API's message, escaped (it may echo
    the visitor's filter)."""
    named = f" {markdown_code(name)}" if name else ""
    return f"⚠️ **{title}{named}:** {markdown_text(exc, MAX_ERROR_CHARS)}"


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

    def search(self, upload: Any, k: float, labels: Any = None, where: Any = None, rerank: Any = None,
               text: Any = None) -> tuple[list[tuple[Image.Image, str]], str, Any]:
        """The results, the status line and the query box after a search: by ``text`` (the description box) where it
        is given, else by the image.

        It searches with the uploaded file's bytes exactly as the API does: the same decoder and messages, and a
        query that is a gallery item (identical bytes) is left out of its own results (``exclude_self``);
        ``labels`` (the picker) and ``where`` (the filter box) restrict the results as the API's where does. A
        search that fails replaces the previous results and status with what went wrong, inline: the next search
        replaces it in turn (a pop-up would stay over later results). An upload that cannot be read leaves the
        query box, where the browser would show it as a broken image. ``rerank`` (the re-ranking picker) re-orders
        the shortlist as the API's ``rerank`` does. A description is searched as the API's ``text`` is (the filters
        and the re-ranking apply), with the same inline errors.
        """
        keep = gr.skip()
        try:
            k = self.check_k(k)
            condition = self.where(labels, where)
            reranking = self.rerank(rerank)
            if text is not None and not isinstance(text, str):
                raise QueryError("the description must be text, e.g. \"a red apple\"", 422)
        except QueryError as exc:
            return [], failure_markdown("Cannot search", exc), keep
        if text and text.strip():
            return (*self.search_text(text, k, condition, reranking, used_image=bool(upload)), keep)
        state = self.service.current()
        if not state.index.has_model:  # built from embeddings: nothing can embed an upload
            return [], failure_markdown("Cannot search with an image", no_model_refusal(state)), keep
        try:
            data = self.read_upload(upload)
        except QueryError as exc:
            if str(exc) == NO_IMAGE and self.service.text_search():  # nothing given: both ways are open
                return [], failure_markdown("Cannot search", QueryError(NO_QUERY)), keep
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

    def search_text(self, text: str, k: int, condition: str | None, reranking: RerankConfig | None,
                    used_image: bool = False) -> tuple[list[tuple[Image.Image, str]], str]:
        """The results and the status line of a search by description, through the served state's text model."""
        try:
            query = TextQuery(check_query_text(text))
        except ValueError as exc:
            return [], failure_markdown("Cannot search by text", exc)
        state = self.service.current()
        if state.text.embedder is None and state.keywords is None:  # first: a filter's 422 is not mistaken for it
            return [], failure_markdown("Cannot search by text", state.text.refusal())
        try:  # a description with no word to search by: said so, never a list it did not choose
            if state.text.embedder is not None:
                query_tokens(state.text.embedder, [query.text])
        except QueryError as exc:
            return [], failure_markdown("Cannot search by text", exc)
        try:
            response = self.service.search(query, k, where=condition, rerank=reranking)
        except QueryError as exc:
            title = "Cannot use this filter" if exc.status == 422 and condition else "Cannot search by text"
            return [], failure_markdown(title, exc)
        image = " (the image was not used: clear the description to search with it)" if used_image else ""
        lead = f"Searched by the description {markdown_code(query.text, MAX_NOTE_CHARS)}{image}."
        return self.results(response), f"{lead}\n\n{self.status(response, condition)}"

    def results(self, response: SearchResponse) -> list[tuple[Image.Image, str]]:
        """The gallery's thumbnails and captions: the title and price where the index shows columns (then score,
        label and ``#id``, which a click on it shows the path of), else score, label, and the path the API gives and
        filters compare."""
        known = response.query_item
        items = []
        for result in response.results:  # captions are shown as text; label_text and shown_text bound them
            shown = display_text(result.columns, MAX_CAPTION_CHARS)
            caption = (f"{shown} · {result.score:.3f} · {self.facts.label_text(result.label)} · #{result.id}" if shown
                       else f"{result.score:.3f} · {self.facts.label_text(result.label)} · "
                            f"{shown_text(result.path, MAX_PATH_CHARS)}")
            if known is not None and known.label is not None:
                caption = ("✓ " if result.label == known.label else "✗ ") + caption
            if result.source is not None:  # a text query's hit: found by its words, its picture, or both
                caption = f"[{result.source}] {caption}"
            items.append((thumbnail(self.service.image_path(result.id)), caption))
        return items

    def selected(self, caption: Any) -> str:
        """What a click on a result shows under the gallery: its id, the path filters compare, its label and its
        display columns (``caption``: the clicked result's, whose ``#id`` names it; a caption without one shows its
        path already)."""
        found = SELECTED_ID.search(caption[-40:]) if isinstance(caption, str) else None
        item = self.service.item(int(found.group(1))) if found else None
        if item is None:
            return ""
        columns = display_text(item.get("columns"), MAX_CAPTION_CHARS)
        return (f"**Selected #{item['id']}:** {markdown_code(item['path'], MAX_PATH_CHARS)} · label "
                f"{markdown_code(self.facts.label_text(item['label']))}"
                + (f" · {markdown_text(columns, MAX_CAPTION_CHARS)}" if columns else ""))

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
        if response.no_match:  # a text query's: its best score is under the index's calibrated floor
            lines.append("⚠️ **Nothing here matches this description well**: the gallery seems not to hold it. "
                         "These are the nearest images, not matches.")
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

    def description_settings(self) -> dict[str, Any]:
        """The "or describe it" box as the served state allows it: enabled with a text model, else disabled with a
        note on why (an upgrade that turned it off, a recorded model that does not fit) or how to start the server
        with one."""
        text_on = self.service.text_search()
        problem = None if text_on else self.service.current().text.problem  # e.g. an upgrade turned it off
        return {"interactive": text_on, "placeholder": 'e.g. "a red apple", then Enter' if text_on else None,
                "info": "searched by the server's text model instead of the image while it holds words" if text_on
                else f"Search by text is off: {shown_text(problem, MAX_TEXT_OFF_CHARS)}" if problem
                else NO_TEXT_NOTE}

    def description_box(self) -> gr.Textbox:
        """The "or describe it" box (``description_settings``)."""
        return gr.Textbox(label="or describe it", max_length=MAX_TEXT_CHARS, lines=1, elem_id="query-text",
                          **self.description_settings())

    def description_update(self) -> Any:
        """The description box made again at a page load: a text model recorded since the server started (taken up
        at a reload) enables it, one that stopped fitting disables it."""
        return gr.Textbox(**self.description_settings())

    @staticmethod
    def close_preview() -> Any:
        """Close the results' enlarged view (runs before each search, so the new results show as a grid)."""
        return gr.Gallery(selected_index=None)

    def build(self, demo: gr.Blocks | None = None) -> None:
        """The tab's components and events (``demo``: the page, whose every load refreshes the description box)."""
        with gr.Row(equal_height=False, elem_id="search-row"):
            with gr.Column(scale=1, min_width=280, elem_id="query-column"):
                # the uploaded file itself (preprocess=False below): decoded by the API's decoder, not Gradio's
                query = gr.Image(
                    type="filepath",
                    image_mode=None,
                    sources=["upload", "clipboard"],
                    label="Query image",
                    elem_id="query-image",
                    height=280,
                )
                description = self.description_box()
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
            with gr.Column(scale=3, min_width=280, elem_id="results-column"):
                gallery = gr.Gallery(
                    label=("Results (title · cosine similarity · label; click one for its path)"
                           if self.service.current().index.display_columns else "Results (cosine similarity · label)"),
                    columns=5,
                    height="auto",
                    object_fit="contain",
                    elem_id="results-gallery",
                    allow_preview=True,
                )
                chosen = gr.Markdown(elem_id="selected-result", latex_delimiters=NO_LATEX)
                clicked = gr.Textbox(visible=False, max_length=2 * MAX_CAPTION_CHARS)
                # the page reads the clicked caption itself: a select event's own data names the thumbnail's file,
                # which the upload guard refuses (serve/upload_cache.py: events may name uploaded files only)
                gallery.select(None, None, clicked, js=CLICKED_CAPTION, queue=False, show_progress="hidden",
                               api_visibility="private").then(
                    self.selected, clicked, chosen, queue=False, show_progress="hidden", api_visibility="private")
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
        ).then(self.search, [query, top_k, label_pick, where_box, rerank_pick, description], [gallery, timing, query],
               api_name="search", preprocess=False)
        description.submit(  # Enter in the description searches, as the button does
            self.close_preview, None, gallery, queue=False, show_progress="hidden", api_visibility="private",
            js=CLOSE_TOASTS,
        ).then(self.search, [query, top_k, label_pick, where_box, rerank_pick, description], [gallery, timing, query],
               api_name="text_search", preprocess=False, api_visibility="private")
        if demo is not None:  # a text model recorded since the server started enables the box at the next visit
            demo.load(self.description_update, None, description, api_name=False)
        # what the gallery is and how to read the results: after the search itself, so the upload box comes first
        gr.Markdown(self.facts.intro_markdown(self.service, self.tabs), elem_id="intro", latex_delimiters=NO_LATEX)

    def column_names(self) -> str:
        """The columns a where may name (a manifest's, so anyone's text): the first ``MAX_COLUMNS_SHOWN``, each
        cut, as plain text (a label is not Markdown)."""
        names = list(self.service.current().index.filter_table.names())
        shown = ", ".join(shown_text(name, MAX_COLUMN_CHARS) for name in names[:MAX_COLUMNS_SHOWN])
        return shown + (f", … ({len(names) - MAX_COLUMNS_SHOWN} more)" if len(names) > MAX_COLUMNS_SHOWN else "")
