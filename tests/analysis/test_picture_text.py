"""Labels, file names, data set and run names are anyone's text: every picture the toolkit draws (the curation
pictures, the evaluation's grid and map, the training report's and the app's plots, the results grid's and the run
comparison's curves) draws them as written, never as matplotlib mathtext, which fails on a bad formula, recurses
too deep on deep braces and turns a good one into mathematics."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from PIL import Image

DEEP_BRACES = "$" + "{" * 500 + "x" + "}" * 500 + "$"
DOLLAR_LABELS = {"unknown-command": r"$\badcommand$", "unfinished-superscript": "$x^$", "deep-braces": DEEP_BRACES,
                 "valid-maths": "$x$"}
VALID_MATHS = "$x$"


def _load(_key) -> Image.Image:
    return Image.new("RGB", (16, 16), (90, 140, 200))


def suspects(label: str, tmp_path: Path):
    from retrieval.analysis.neighbour_pictures import suspects_picture  # the app's label audit draws it too

    summary = {"suspects_found": 1, "suspects": [{"id": 1, "label": label, "suggested": "b", "score": 0.5,
                                                  "neighbours": [{"id": 2, "label": label, "similarity": 0.9}]}]}
    return suspects_picture(summary, _load)


def duplicates(label: str, tmp_path: Path):
    from retrieval.analysis.neighbour_pictures import duplicates_picture  # the app's near-duplicates draw it too

    summary = {"threshold": 0.95, "groups_found": 1,
               "groups": [{"paths": [f"a/{label}.png", f"b/{label}"], "similarities": [None, 0.99]}]}
    return duplicates_picture(summary, _load, key="paths")


def query_grid(label: str, tmp_path: Path):
    from retrieval.analysis.pictures import plot_retrieval_grid

    labels = np.repeat(np.arange(3), 4)
    x = np.eye(3)[labels] + np.random.default_rng(0).normal(scale=0.3, size=(12, 3))
    return plot_retrieval_grid(x, labels, _load, tmp_path / "grid.png", label_names=lambda c: label, queries=2, k=2)


def embedding_map(label: str, tmp_path: Path):
    from retrieval.analysis.pictures import plot_embedding_map

    labels = np.repeat(np.arange(2), 6)
    x = np.eye(2)[labels] + np.random.default_rng(0).normal(scale=0.3, size=(12, 2))
    return plot_embedding_map(x, labels, tmp_path / "map.png", label_names=lambda c: f"{label}{c}", method="tsne")


def results_curves(label: str, tmp_path: Path):
    from retrieval.analysis.results import plot_curves

    return plot_curves({"title": label, "ylabel": label, "series": {label: {label: [0.1, 0.2]}}}, tmp_path / "c.png")


def runs_compared(label: str, tmp_path: Path):
    from retrieval.analysis.runs import Run, plot_curves
    from retrieval.records.run_config import RunFolderConfig

    history = [{"epoch": 0, "recall@1": 0.1}, {"epoch": 1, "loss": 1.0, "recall@1": 0.2,
                                                "extra": {label: {"recall@1": 0.3}}}]
    return plot_curves([Run(tmp_path / "run", label, RunFolderConfig(), history, {}, None)], tmp_path / "runs.png")


def triplet_diagram_titled(label: str, tmp_path: Path):
    from retrieval.analysis.plots import plot_triplet_diagram
    from retrieval.analysis.triplet_diagram import triplet_diagram

    z, y = torch.randn(12, 4, generator=torch.Generator().manual_seed(0)), torch.arange(4).repeat_interleave(3)
    return plot_triplet_diagram(triplet_diagram(z, y), tmp_path / "triplet.png", title=label)


def pair_weights_titled(label: str, tmp_path: Path):
    from retrieval.analysis.plots import plot_pair_weights

    y = np.repeat(np.arange(2), 3)
    return plot_pair_weights(np.eye(6), np.ones((6, 6)), y, tmp_path / "weights.png", title=label)


def training_domains(label: str, tmp_path: Path):
    from retrieval.train.report import plot_domains

    history = [{"epoch": e, "recall@1": 0.5, "extra": {label: {"recall@1": 0.4}}} for e in (0, 1)]
    return plot_domains(history, {"input_size": 32, "sets": {label: {"test": {"recall@1": 0.3}}}},
                        tmp_path / "domains.png")


def training_recall(label: str, tmp_path: Path):
    from retrieval.train.report import plot_recall_at_k

    return plot_recall_at_k({label: {"recall@1": 0.5, "recall@2": 0.7}}, tmp_path / "recall.png")


def training_wise(label: str, tmp_path: Path):
    from retrieval.train.report import plot_wise

    curve = [{"alpha": 0.0, "in_domain": 0.5}, {"alpha": 1.0, "in_domain": 0.6}]
    return plot_wise({"alpha": 0.5, "chosen": label, "curve": curve}, tmp_path / "wise.png")


def app_recall(label: str, tmp_path: Path):
    from retrieval.serve.report_files import RunReport
    from retrieval.serve.report_plots import recall_plot

    best = {"epoch": label, "recall@1": 0.5, "recall@2": 0.7}
    return recall_plot(RunReport(tmp_path / "report.json", {"kind": "train", "best": best}))


def app_curves(label: str, tmp_path: Path):
    from retrieval.serve.report_files import RunReport
    from retrieval.serve.report_plots import curves_plot

    history = [{"epoch": 1, "loss": 1.0, "recall@1": 0.5, "extra": {label: {"recall@1": 0.4}}}]
    return curves_plot(RunReport(tmp_path / "report.json", {"kind": "train", "history": history}))


def app_results(label: str, tmp_path: Path):
    from retrieval.serve.report_plots import results_curve_image

    curve = {"id": "t", "title": label, "ylabel": label, "series": {label: {label: [0.1, 0.2]}}}
    return results_curve_image({"curves": [curve]}, "t")


PICTURES = {f.__name__: f for f in (suspects, duplicates, query_grid, embedding_map, results_curves, runs_compared,
                                    triplet_diagram_titled, pair_weights_titled, training_domains, training_recall,
                                    training_wise, app_recall, app_curves, app_results)}


@pytest.fixture
def drawn_texts(monkeypatch) -> list:
    """Every Text artist of each figure saved while the test runs, taken after saving (tick labels are made then)."""
    from matplotlib.figure import Figure
    from matplotlib.text import Text

    texts: list[Text] = []
    save = Figure.savefig

    def saved(figure, *args, **kwargs):
        result = save(figure, *args, **kwargs)
        texts.extend(figure.findobj(Text))
        return result

    monkeypatch.setattr(Figure, "savefig", saved)
    return texts


def _opened(drawn) -> Image.Image:
    assert drawn is not None
    if isinstance(drawn, Image.Image):
        return drawn
    with Image.open(drawn) as image:
        return image.convert("RGB")


@pytest.mark.parametrize("label", DOLLAR_LABELS.values(), ids=DOLLAR_LABELS.keys())
@pytest.mark.parametrize("picture", PICTURES.values(), ids=PICTURES.keys())
def test_every_picture_draws_labels_holding_dollar_signs(picture, label, tmp_path):
    size = _opened(picture(label, tmp_path)).size
    assert min(size) > 50
    assert max(size) < 4000  # the thousand-character label is cut, not a picture 20,000 pixels wide


@pytest.mark.parametrize("picture", PICTURES.values(), ids=PICTURES.keys())
def test_every_picture_shows_dollar_signs_as_written_not_as_maths(picture, drawn_texts, tmp_path):
    _opened(picture(VALID_MATHS, tmp_path))
    shown = [text for text in drawn_texts if VALID_MATHS in text.get_text()]
    assert shown, "the label is drawn"
    assert not any(text.get_parse_math() for text in shown)


def test_a_literal_dollar_label_is_drawn_wider_than_its_formula():
    """Drawn as text, "$x$" is three glyphs; as mathtext it would be a single italic x."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from retrieval.analysis.plain_text import plain_text

    with plain_text():
        figure = Figure()
        literal = figure.text(0.1, 0.5, VALID_MATHS)
    formula = figure.text(0.1, 0.2, VALID_MATHS)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    assert literal.get_text() == VALID_MATHS and not literal.get_parse_math()
    assert literal.get_window_extent(renderer).width > 2 * formula.get_window_extent(renderer).width


def test_the_triplet_diagrams_own_formulas_stay_maths(drawn_texts, tmp_path):
    triplet_diagram_titled(VALID_MATHS, tmp_path)
    title = next(text for text in drawn_texts if VALID_MATHS in text.get_text())
    formulas = [text for text in drawn_texts if "$S_{" in text.get_text()]
    assert not title.get_parse_math()
    assert len(formulas) == 3 and all(text.get_parse_math() for text in formulas)  # the axes and the legend's hard


def test_drawing_a_picture_leaves_matplotlibs_settings_as_they_were(tmp_path):
    assert matplotlib.rcParams["text.parse_math"]
    results_curves(VALID_MATHS, tmp_path)
    suspects(VALID_MATHS, tmp_path)
    assert matplotlib.rcParams["text.parse_math"]


def test_long_texts_are_cut_to_a_few_bounded_lines():
    from matplotlib.figure import Figure

    from retrieval.analysis.plain_text import MAX_LINE_CHARS, MAX_LINES, cut_long_texts

    figure = Figure()
    long, tall, short = (figure.text(0, 0, "w" * 1000), figure.text(0, 0, "\n".join("abcdefgh")),
                         figure.text(0, 0, "$x$\nscore 0.50"))
    cut_long_texts(figure)
    assert long.get_text() == "w" * (MAX_LINE_CHARS - 1) + "…"
    assert tall.get_text().split("\n") == [*"abc", "d…"] and MAX_LINES == 4
    assert short.get_text() == "$x$\nscore 0.50"


class _FailingCuration:
    """The app's curation view failing as a picture did before labels were drawn as text."""

    def suspects(self):
        raise ValueError(r"Unknown symbol: \badcommand, found '\' (at char 0), (line:1, col:1)")

    def duplicates(self, _threshold):
        raise OSError(13, "Permission denied", "/srv/private/gallery/a.png")


def test_the_apps_curation_buttons_name_an_unexpected_failure():
    """Not Gradio's bare "Error": the page says what failed, an OS error without the server's file name."""
    pytest.importorskip("gradio")
    from retrieval.serve.ui import EvaluationTab

    tab = EvaluationTab.__new__(EvaluationTab)  # no service: only the handlers' failure path runs
    tab.curation = _FailingCuration()
    text, table, picture = tab.label_suspects()
    assert "The label audit failed" in text and "ValueError" in text and "badcommand" in text
    assert table.constructor_args["visible"] is False and picture.constructor_args["visible"] is False
    text, table, picture, *similar = tab.near_duplicates("0.9")
    assert "No near-duplicate groups" in text and "Permission denied" in text and "/srv/private" not in text
    assert table.constructor_args["visible"] is False and picture.constructor_args["visible"] is False
    assert len(similar) == 3 and all(part.constructor_args["visible"] is False for part in similar[1:])


@pytest.mark.parametrize("picture, score", [(suspects, "score 0.50"), (duplicates, "copy 0.990")],
                         ids=["suspects", "duplicates"])
def test_a_label_of_many_lines_keeps_each_tile_to_its_caption(picture, score, drawn_texts, tmp_path):
    """A label of 200 newlines made a caption of 200 lines in a tile's fixed height: its score drawn out of sight."""
    _opened(picture("a\n" * 200 + "b", tmp_path))
    captions = [text.get_text() for text in drawn_texts if score in text.get_text()]
    assert captions and all(caption.count("\n") <= 2 for caption in captions), captions
