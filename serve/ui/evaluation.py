"""The Evaluation tab: a run report's metrics and pictures, and the served index's own analyses (worst classes,
duplicates, near-duplicates, label suspects)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr
from PIL import Image

from retrieval.errors import ParameterError
from retrieval.reports import READINGS_FILE
from retrieval.serve.curation_view import CurationView, ThresholdError, VerificationRunning, parse_threshold
from retrieval.serve.diagnostics import duplicates
from retrieval.serve.images import QueryError
from retrieval.serve.page_text import METRIC_UNIT, markdown_text, percent, shown_text
from retrieval.serve.report_files import RunReport, load_report
from retrieval.serve.report_plots import (
    compatibility_plot,
    curves_plot,
    domains_plot,
    embedding_map_plot,
    moved_plot,
    pseudo_labels_plot,
    recall_plot,
    retrieval_plot,
    triplet_plot,
    wise_plot,
)
from retrieval.serve.report_summary import (
    MAP_EQUALS_RECALL_NOTE,
    data_relation_markdown,
    embedding_map_note,
    summary_markdown,
)
from retrieval.serve.service import SearchService
from retrieval.serve.ui.shared import MAX_ERROR_CHARS, MAX_PATH_CHARS, NO_LATEX, GalleryFacts, thumbnail

log = logging.getLogger(__name__)

WORST_CLASSES = 10
DUPLICATES_SHOWN = 50
PICTURE_HEIGHT = 420  # a run report's plot on the Evaluation tab, in pixels
TALL_PICTURE_HEIGHT = 560  # the query grid (a row per query) and the embedding map with its legend
FAILURE_COLUMNS = 10  # failure thumbnails per row
SIMILAR_HEADING = "#### Similar, not copies — for a person to look at"


def unexpected_markdown(title: str, exc: Exception) -> str:
    """A curation button's unexpected failure, named on the page (its kind and message; an OS error without its
    file name, which is the server's) and logged whole: the page would otherwise show a bare "Error"."""
    log.error("%s", title, exc_info=exc)
    message = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"⚠️ **{title}:** {markdown_text(f'{type(exc).__name__}: {message}', MAX_ERROR_CHARS)}"


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
    ReportPicture("moved", "Moved most", moved_plot, "moved-plot", TALL_PICTURE_HEIGHT),
    ReportPicture("pseudo_labels", "Pseudo-labels", pseudo_labels_plot, "pseudo-labels-plot", PICTURE_HEIGHT),
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
                report, self.service.current().index.info.catalogue.gallery_root, self.service.index_dir.name)
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

    def near_duplicates(self, threshold_text: str) -> tuple[Any, ...]:
        """The served index's near-duplicate groups at the typed threshold: for auto, copies verified pair by pair
        (a sentence, a table of the groups, their picture, and the similar pairs that are not copies in a table and
        a picture of their own); for a cosine, the groups at it, unverified (the similar pairs hidden)."""
        try:
            summary, picture, pairs_picture = self.curation.duplicates(parse_threshold(threshold_text))
        except ThresholdError as exc:
            return f"**{markdown_text(exc)}**", *self.no_groups()
        except VerificationRunning as exc:  # answered at once: a click never waits behind another's verification
            return f"**No groups yet:** {markdown_text(exc, MAX_ERROR_CHARS)}", *self.no_groups()
        except (ParameterError, QueryError) as exc:
            return f"**No near-duplicate groups:** {markdown_text(exc, MAX_ERROR_CHARS)}", *self.no_groups()
        except Exception as exc:  # noqa: BLE001  (said on the page, not a bare "Error")
            return unexpected_markdown("No near-duplicate groups", exc), *self.no_groups()
        verified = summary.get("mode") == "verified"
        text = self.verified_text(summary) if verified else self.cosine_text(summary)
        # the calibration's, the unfinished verification's and the label-mixed groups' warnings, where people read
        # before removing anything
        text += "".join(f"\n\n**Warning:** {markdown_text(warning, MAX_ERROR_CHARS)}"
                        for warning in summary.get("warnings", []))
        similar = self.similar_shown(summary, pairs_picture) if verified else self.no_groups()[2:]
        if not summary["groups_found"]:
            return text, gr.Dataframe(value=None, visible=False), gr.Image(visible=False), *similar
        label = self.facts.label_text
        rows, headers = [], ["group", "role", "id", "label", "file", "cosine to the first"]
        for number, group in enumerate(summary["groups"], 1):
            checks = [None, *group.get("checks", [])]  # the kept image is not compared with itself
            for position, (image_id, path, image_label, similarity) in enumerate(
                    zip(group["ids"], group["paths"], group["labels"], group["similarities"], strict=True)):
                role = ("kept" if position == 0 else "copy") + (" (labels differ)" if group.get("labels_mixed")
                                                                else "")
                row = [number, role, image_id, label(image_label), shown_text(path or "(missing)", MAX_PATH_CHARS),
                       "" if similarity is None else round(similarity, 4)]
                if verified:
                    check = checks[position] if position < len(checks) else None
                    row += ["" if check is None else check["inliers"],
                            "" if check is None else round(check["correlation"], 3),
                            group["estimated_precision"] if position == 0 else ""]  # the group's, on its first row
                rows.append(row)
        if verified:
            headers += ["features agreeing (inliers)", "aligned correlation", "estimated precision (group)"]
        return (text, gr.Dataframe(value=rows, headers=headers, visible=True),
                gr.Image(value=picture, visible=picture is not None), *similar)

    @staticmethod
    def no_groups() -> tuple[Any, ...]:
        """The groups' table and picture and the similar pairs' text, table and picture, hidden."""
        return (gr.Dataframe(value=None, visible=False), gr.Image(visible=False), gr.update(value="", visible=False),
                gr.Dataframe(value=None, visible=False), gr.Image(visible=False))

    @staticmethod
    def verified_text(summary: dict[str, Any]) -> str:
        """What the verified groups are, how many candidate pairs were checked at which cosine, and how the
        verification did on the copies it planted."""
        checked, calibration = summary["verification"], summary["calibration"]
        rules = calibration["rules"]
        sampled = f" (a sample of {summary['images']} of {summary['indexed']})" if summary["sampled"] else ""
        of = f" of {checked['candidates']}" if checked["checked"] != checked["candidates"] else ""
        distinct = calibration["distinct_pairs"] + calibration["colour_variants"]
        # a precision of nothing verified says nothing: only said where some pairs were verified
        trust = f" (estimated precision {checked['estimated_precision']:.2f})" \
            if checked.get("estimated_precision") is not None and checked["verified"] else ""
        return (f"**{summary['groups_found']} groups of verified copies** ({summary['copies_in_groups']} copies) "
                f"among the indexed images{sampled}. {checked['checked']}{of} candidate pairs (one among the other's "
                f"{summary['k']} nearest at cosine ≥ **{summary['threshold']:.3f}**) were checked in "
                f"{checked['seconds']:.1f} s and {checked['verified']} verified as copies{trust}: at least "
                f"{rules['min_inliers']} local features agreeing under one transform, the aligned content correlating "
                f"at {rules['correlation']:.2f} or more, colours within {rules['colour_mismatch']:.0f}° of hue and "
                f"their strength within {rules['shade']:.2f} (a darker shade of one hue is another product). "
                f"The verification was calibrated (auto) on {calibration['copies']} copies planted of "
                f"{calibration['images']} gallery images: {percent(calibration['copy_recall'])} {METRIC_UNIT} of them "
                f"found and verified, and {calibration['false_verified']} of {distinct} distinct pairs (nearest "
                "distinct images, colour variants) wrongly verified. The first of each group is the one kept: "
                "the one holding the picture at the most pixels (an original, not its downscaled, cropped or "
                "re-encoded copies); the estimated precision is the chance that every copy "
                "of the group is one.")

    @staticmethod
    def cosine_text(summary: dict[str, Any]) -> str:
        """The groups at a typed cosine, said to be unverified."""
        sampled = f" (a sample of {summary['images']} of {summary['indexed']})" if summary["sampled"] else ""
        return (f"**{summary['groups_found']} groups of near-duplicates** ({summary['copies_in_groups']} copies) among "
                f"the indexed images{sampled}, linked where one is among the other's {summary['k']} nearest at cosine "
                f"≥ **{summary['threshold']:.3f}** (as typed). The first of each group is the one indexed first. "
                "These groups are **not verified** as copies: alike images (colour variants, other products) group "
                "too; type auto to have each pair verified.")

    def similar_shown(self, summary: dict[str, Any], picture: Image.Image | None) -> tuple[Any, Any, Any]:
        """The candidate pairs not verified as copies: a sentence, a table (ids, labels, files, cosine, why not a
        copy, what was measured) and their picture; hidden when there are none."""
        found, pairs = summary.get("similar_found", 0), summary.get("similar", [])
        if not found:
            return self.no_groups()[2:]
        shown = f" (the {len(pairs)} of highest cosine in the table)" if found > len(pairs) else ""
        text = (f"{SIMILAR_HEADING}\n\n**{found} candidate pairs are similar but not copies**{shown}: alike to the "
                "model, yet the verification found no copy between them (another product, a colour variant, or an "
                "image too plain for local features to match). Never proposed for removal.")
        label = self.facts.label_text

        def measured(check: dict[str, Any] | None, key: str) -> Any:
            if check is None or (key == "correlation" and check["scale"] is None):
                return ""  # an unreadable image, or nothing aligned: no correlation was measured
            return check[key] if key == "inliers" else round(check[key], 3)

        rows = [[pair["ids"][0], label(pair["labels"][0]), shown_text(pair["paths"][0] or "(missing)", MAX_PATH_CHARS),
                 pair["ids"][1], label(pair["labels"][1]), shown_text(pair["paths"][1] or "(missing)", MAX_PATH_CHARS),
                 pair["cosine"], pair["reason"] or "", measured(pair["check"], "inliers"),
                 measured(pair["check"], "correlation")] for pair in pairs]
        headers = ["id", "label", "file", "other id", "its label", "its file", "cosine", "why not a copy",
                   "features agreeing (inliers)", "aligned correlation"]
        return (gr.update(value=text, visible=True), gr.Dataframe(value=rows, headers=headers, visible=True),
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
        gr.Markdown("### Near-duplicate groups: verified copies (the same picture cropped, scaled, re-encoded, "
                    "brightened or slightly turned; colour variants are not copies)")
        with gr.Row():
            near_threshold = gr.Textbox(value="auto", label="Threshold: auto (each pair verified as a copy, calibrated "
                                        "on copies the app plants of gallery images), or a cosine (groups by cosine "
                                        "alone, unverified)", scale=3, elem_id="near-duplicates-threshold")
            near_button = gr.Button("Find near-duplicates", scale=1, elem_id="near-duplicates-button")
        near_text = gr.Markdown(elem_id="near-duplicates-summary", latex_delimiters=NO_LATEX)
        near_table = gr.Dataframe(interactive=False, visible=False, elem_id="near-duplicates-table")
        near_picture = gr.Image(show_label=False, type="pil", interactive=False, visible=False,
                                height=TALL_PICTURE_HEIGHT, elem_id="near-duplicates-picture")
        # the candidates that failed the verification: alike, not copies; people judge them, nothing removes them
        similar_text = gr.Markdown(visible=False, elem_id="near-similar-summary", latex_delimiters=NO_LATEX)
        similar_table = gr.Dataframe(interactive=False, visible=False, elem_id="near-similar-table")
        similar_picture = gr.Image(show_label=False, type="pil", interactive=False, visible=False,
                                   height=TALL_PICTURE_HEIGHT, elem_id="near-similar-picture")
        gr.Markdown("### Label suspects (labels their neighbours disagree with)")
        audit_button = gr.Button("Audit the labels", elem_id="label-audit-button")
        audit_text = gr.Markdown(elem_id="label-audit-summary", latex_delimiters=NO_LATEX)
        audit_table = gr.Dataframe(interactive=False, visible=False, elem_id="label-audit-table")
        audit_picture = gr.Image(show_label=False, type="pil", interactive=False, visible=False,
                                 height=TALL_PICTURE_HEIGHT, elem_id="label-audit-picture")
        near_button.click(self.near_duplicates, [near_threshold],
                          [near_text, near_table, near_picture, similar_text, similar_table, similar_picture],
                          api_name=False)
        audit_button.click(self.label_suspects, None, [audit_text, audit_table, audit_picture], api_name=False)
        outputs = [summary, metrics, picture_tabs, *tabs, *images, map_note]
        button.click(self.open_report, [path], outputs, api_name="open_report")
        demo.load(self.open_report, [path], outputs, api_name=False)
        demo.load(self.worst_classes, None, [loo_summary, worst, failures], api_name=False)
        demo.load(self.duplicates, None, [duplicates_text, duplicates_fold, duplicates_table], api_name=False)
