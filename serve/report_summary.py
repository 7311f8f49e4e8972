"""A run report in words for the Evaluation tab: its setup, how best.pt was chosen, the out-of-domain sets, the
readings, compatibility with an old model, the embedding map's sample and what was left out, as Markdown with every
field of the report escaped (a report is anyone's file).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from PIL import Image

from retrieval.compatibility import KEPT, KEPT_K
from retrieval.reports import READINGS_FILE, VALIDATION_HOLDS
from retrieval.serve.page_text import METRIC_UNIT, markdown_code, markdown_text, percent
from retrieval.serve.report_files import MAX_FIELD_CHARS, RunReport, is_number, known, number_at

MAX_REASON_CHARS = 600  # the keep-pretrained sentence: both numbers, the interval and why
KEPT_EPOCHS_SHOWN = 12  # a run without labels: the epochs whose neighbours kept the summary lists
MAP_EQUALS_RECALL_NOTE = (
    "**Why MAP@R equals Recall@1 here:** every query has exactly one relevant item (R = 1; in the emoji test "
    "split the only other image of an emoji is its drawing in the other style), so MAP@R averages the precision "
    "at rank 1 alone, 1 when the top result is right and 0 otherwise, which is Recall@1 (and R-precision)."
)


def readings_markdown(report: RunReport) -> str:
    """The model's figures measured outside training (``READINGS_FILE``: the demo's test subgroups read by
    subgroup and by twin, and real photos), the pretrained backbone beside the delivered model, as a table."""
    readings = report.readings
    if not readings:
        return ""
    rows = [f"| {markdown_text(text)} | {percent(readings['pretrained'][key])} | "
            f"{percent(readings['delivered'][key])} | "
            f"{percent(readings['delivered'][key]) - percent(readings['pretrained'][key]):+.1f} |"
            for key, text in readings["labels"].items()]
    return (f"\n\n**Read two ways and on real photos** ({markdown_code(READINGS_FILE)}, {METRIC_UNIT}):\n\n"
            "| figure | pretrained backbone | this model | change |\n|---|---:|---:|---:|\n" + "\n".join(rows))


def problems_markdown(report: RunReport) -> str:
    """The values left out of the report or its readings, named, as Markdown (their keys escaped); empty if none."""
    if not report.problems:
        return ""
    return "\n\n**Left out of this report:**\n" + "\n".join(
        f"- {markdown_text(problem, 2 * MAX_FIELD_CHARS + 200)}" for problem in report.problems)


def embedding_map_note(report: RunReport) -> str | None:
    """Which classes and images the embedding map draws out of how many, and how they were chosen, as Markdown
    (None when the report has no map): from what the map recorded in its PNG, else from the report's class count."""
    from retrieval.analysis.pictures import MAP_MAX_CLASSES, MAP_MAX_POINTS, MAP_METADATA_KEY

    path = report.plot_file("embedding_map")
    if path is None:
        return None
    try:
        with Image.open(path) as image:
            facts = json.loads(getattr(image, "text", {}).get(MAP_METADATA_KEY, "null"))
    except (OSError, ValueError):
        facts = None
    if not isinstance(facts, dict) or not all(isinstance(facts.get(key), int) for key in
                                              ("classes_shown", "classes", "images_shown", "images")):
        classes = ((report.data.get("class_split") or {}).get("test") or {}).get("classes")
        if isinstance(classes, int) and classes > MAP_MAX_CLASSES:  # drawn before maps recorded their sample
            return (f"**The map shows {MAP_MAX_CLASSES} of the {classes} classes evaluated** (a random sample of "
                    f"them: more colours could not be told apart) and at most {MAP_MAX_POINTS} of their images; "
                    "each point is one image, coloured by class.")
        return "Each point is one image evaluated, coloured by class." + (
            f" All {classes} classes evaluated are shown." if isinstance(classes, int) else "")
    shown, total = facts["classes_shown"], facts["classes"]
    method = markdown_text(facts.get("method", "a 2-D projection"))
    seed = facts.get("seed")
    how = f" (a random sample, seed {seed}: more colours could not be told apart)" if isinstance(seed, int) else \
        " (a random sample: more colours could not be told apart)"
    classes_text = (f"**The map shows {shown} of the {total} classes evaluated**{how}" if shown < total
                    else f"**The map shows all {total} classes evaluated**")
    images_text = f"{facts['images_shown']:,} of the {facts['images']:,} images"
    return (f"{classes_text}, {images_text}; {method} of their embeddings, each point one image coloured by class "
            "(nearby points: embeddings the model finds alike).")


def summary_markdown(report: RunReport, shown: str | None = None) -> str:
    """The report's kind, where it is (``shown``: as the reader named it; default its file name) and its setup,
    as Markdown with every field of the report escaped (a report is anyone's file)."""
    train = run_settings(report)
    facts = [f"**{markdown_text(report.kind)}** report {markdown_code(shown or report.path.name)}"]
    for key in ("dataset", "backbone", "loss", "epochs", "embedding_dim"):
        value = train.get(key)
        value = value if value is not None else report.data.get(key)
        if value is not None:
            facts.append(f"{key}: {markdown_code(value)}")
    if report.kind == "evaluate":
        facts.append(f"split: {markdown_code(report.data.get('split'))}, "
                     f"queries: {markdown_text(report.data.get('num_queries'))}")
    return " · ".join(facts) + selection_markdown(report) + keep_pretrained_markdown(report) + \
        label_free_markdown(report) + \
        out_of_domain_markdown(report) + readings_markdown(report) + compatibility_markdown(report) + \
        problems_markdown(report)


def selection_markdown(report: RunReport) -> str:
    """A training run's choice of best.pt: on the validation split, or on the test split (its numbers optimistic,
    with the report's reason); empty for a report that does not say (an evaluation, or a run before it was
    recorded)."""
    selected_on = report.data.get("selected_on") if report.kind == "train" else None
    if selected_on == "validation":
        held = VALIDATION_HOLDS.get(report.data.get("validation_by") or "classes", VALIDATION_HOLDS["classes"])
        return f"\n\n**best.pt chosen on:** the validation split ({held}), not the test split."
    if selected_on == "last":
        note = report.data.get("selection_note") or "no validation split"
        return f"\n\n**best.pt is the last epoch:** {markdown_text(note)}."
    if selected_on == "test":  # a report written before the test split stopped choosing
        note = report.data.get("selection_note") or "chosen on the test split: its numbers are optimistic"
        return f"\n\n**best.pt chosen on the test split:** {markdown_text(note)}."
    if selected_on == "kept":
        floor = run_settings(report).get("kept_floor")
        floor_text = f"{percent(floor):g}%" if is_number(floor) else "the --kept-floor share"
        return ("\n\n**best.pt chosen without labels:** the latest epoch whose images keep at least "
                f"{floor_text} of their {KEPT_K} nearest neighbours from the pretrained backbone (--kept-floor); the "
                "start where none does.")
    return ""


def keep_pretrained_markdown(report: RunReport) -> str:
    """A training run against the pretrained export it would replace: whether to keep that export (the run's
    verdict, in its words) and the command that exports it; empty for a report without a verdict."""
    keep = report.data.get("keep_pretrained") if report.kind == "train" else None
    if not isinstance(keep, bool):
        return ""
    reason = report.data.get("keep_pretrained_reason")
    said = markdown_text(reason, MAX_REASON_CHARS) if isinstance(reason, str) else \
        "keep the pretrained export" if keep else "the model beats the pretrained export"
    if not keep:
        return f"\n\n**Against the pretrained export:** {said}."
    section = report.data.get("pretrained_export")
    command = section.get("command") if isinstance(section, dict) else None
    serve = f" To serve it: {markdown_code(command)}." if isinstance(command, str) else ""
    return f"\n\n**Against the pretrained export:** {said}.{serve}"


def label_free_markdown(report: RunReport) -> str:
    """A run without labels: the neighbours its images keep from the pretrained backbone, epoch by epoch, and the
    pseudo-labels' groups and their stability; empty for any other report."""
    section = report.data.get("label_free") if report.kind == "train" else None
    if not isinstance(section, dict):
        return ""
    kept = [row for row in section.get("kept") or [] if isinstance(row, dict) and number_at(row, KEPT)]
    lines = []
    if kept:
        shown = kept[:KEPT_EPOCHS_SHOWN]
        steps = " → ".join(f"{percent(row[KEPT]):.0f}%" for row in shown)
        lines.append(f"the images keep {steps} of their {KEPT_K} nearest pretrained neighbours (epoch "
                     f"{markdown_text(known(shown[0].get('epoch')))} to "
                     f"{markdown_text(known(shown[-1].get('epoch')))})")
    groups = [row for row in section.get("groups") or [] if isinstance(row, dict)]
    if groups:
        last = groups[-1]
        stability = f", stability {last['stability']:.2f} (adjusted Rand index with the epoch before)" \
            if number_at(last, "stability") else ""
        lines.append(f"pseudo-labels ({markdown_text(known(section.get('pseudo_labels')))}): "
                     f"{markdown_text(known(last.get('clusters')))} groups holding "
                     f"{markdown_text(known(last.get('clustered_images')))} of "
                     f"{markdown_text(known(last.get('images')))} images, "
                     f"the largest {markdown_text(known(last.get('largest_cluster')))}{stability}")
    return "\n\n**Without labels:** " + "; ".join(lines) + "." if lines else ""


def compatibility_markdown(report: RunReport) -> str:
    """A run trained --compatible-with an old model (or evaluated against its gallery): BCT's verdict, said plainly
    with the numbers it compares and their interval (``compatibility_sentence``); empty otherwise."""
    from retrieval.compatibility import compatibility_sentence

    blocks = (report.data.get("last") or {}).get("compatibility") or report.data.get("compatibility")
    try:
        sentence = compatibility_sentence(blocks) if isinstance(blocks, dict) else None
    except (KeyError, TypeError, ValueError, IndexError):  # a report is anyone's file: a block it lacks is no sentence
        sentence = None
    return f"\n\n**Compatibility with the old model:** {markdown_text(sentence)}." if sentence else ""


def run_settings(report: RunReport) -> dict[str, Any]:
    """The run's settings: a training run's config, or an evaluation's model with its data set and data."""
    if report.kind == "evaluate":
        return {**(report.data.get("model") or {}), "dataset": report.data.get("dataset"),
                "data": report.data.get("data")}
    config = report.data.get("config") or {}
    train = config.get("train", config) if isinstance(config, dict) else {}
    return train if isinstance(train, dict) else {}


def report_data(report: RunReport) -> tuple[str | None, str | None]:
    """The data set name and the data folder (or manifest) the run was measured on, as the report records them."""
    settings = run_settings(report)
    dataset, data = settings.get("dataset"), settings.get("data")
    return (str(dataset) if dataset is not None else None), (str(data) if data else None)


def same_data(data: str | None, gallery_root: str | None) -> bool:
    """Whether a run's data folder and an index's gallery folder are the same files (one holds the other)."""
    if not data or not gallery_root:
        return False
    run, gallery = Path(data).expanduser().resolve(), Path(gallery_root).expanduser().resolve()
    run = run.parent if run.suffix else run  # a manifest file: its folder
    return run == gallery or gallery.is_relative_to(run) or run.is_relative_to(gallery)


def data_relation_markdown(report: RunReport, gallery_root: str | None, index_name: str) -> str:
    """One line saying whether the report measured the images of the index being served, so that a run on
    another data set is not read as this index's quality."""
    dataset, data = report_data(report)
    named = markdown_code(dataset) + (f" ({markdown_code(Path(data).name)})" if data else "") if dataset \
        else "its own data"
    index = markdown_code(index_name)
    if same_data(data, gallery_root):
        return f"\n\n**Data:** this run measured {named}, the images of the index being served ({index})."
    return (f"\n\n**Another data set:** this run measured {named}, not the images of the index being served "
            f"({index}, below). Its metrics and pictures describe that run only.")


def out_of_domain_markdown(report: RunReport) -> str:
    """One line per --eval-extra set: Recall@1 of the pretrained backbone at its own resolution, before training,
    after it and of the WiSE-FT mix, so the in-domain gain is read beside what the other domain lost; then the share
    of each image's neighbours the fine-tuned models kept from the backbone's (label-free: the same measure works on
    a folder of unlabelled images, `retrieval compare`)."""
    reference = report.data.get("reference") or {}
    columns = [(name, values) for name, values in report.metric_columns().items() if values.get("extra")]
    lines = []
    for name in (reference.get("sets") or {}):
        shown = [f"{markdown_text(column)} {percent(values['extra'][name]['recall@1'])} {METRIC_UNIT}"
                 for column, values in columns if is_number((values["extra"].get(name) or {}).get("recall@1"))]
        kept = [f"{markdown_text(column)} {percent(values['extra'][name][KEPT])} {METRIC_UNIT}"
                for column, values in columns if isinstance((values["extra"].get(name) or {}).get(KEPT), float)]
        if shown:
            lines.append(f"- **{markdown_text(name)}**: " + " · ".join(shown) +
                         (f"; top-{KEPT_K} neighbours kept from the pretrained backbone's: " + " · ".join(kept)
                          if kept else ""))
    return ("\n\n**Out of domain (--eval-extra), Recall@1:**\n" + "\n".join(lines)) if lines else ""
