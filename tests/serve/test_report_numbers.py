"""A run report's numbers are anyone's: an integer too large for a float (401 digits, or past Python's 4300-digit
limit), NaN or infinity in report.json, readings.json beside it or metrics.jsonl never makes the Evaluation tab or
`retrieval serve --report` fail; a value left out is named by its file and key, and the rest of the report shows."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from retrieval.records.index_info import IndexInfo
from retrieval.reports import READINGS_FILE, REPORT_FORMAT
from retrieval.serve.report_files import load_report
from retrieval.serve.report_plots import curves_plot, recall_plot
from retrieval.serve.report_summary import embedding_map_note, summary_markdown
from retrieval.serve.ui.evaluation import REPORT_PICTURES, EvaluationTab
from retrieval.serve.ui.shared import GalleryFacts

pytestmark = pytest.mark.timeout(300)

HUGE_INT = "9" * 401  # float() of it overflows
LONGER_THAN_PYTHON_READS = "9" * 5000  # past int()'s 4300-digit limit: json.loads itself refuses it
HOSTILE_NUMBERS = [HUGE_INT, "-" + HUGE_INT, LONGER_THAN_PYTHON_READS, "NaN", "Infinity", "-Infinity", "1e999", "null"]


def write_report(folder: Path, value: str) -> Path:
    """A training report, its readings and its metrics log with ``value`` (JSON text) in every numeric field."""
    metrics = (f'{{"recall@1": {value}, "recall@2": 0.6, "recall@x": 0.1, "map@r": {value}, "nmi": {value}, '
               f'"extra": {{"photos": {{"recall@1": {value}, "neighbours_kept@10": {value}}}}}}}')
    report = (
        f'{{"format": "{REPORT_FORMAT}", "kind": "train", "selected_on": "kept", '
        f'"config": {{"train": {{"epochs": {value}, "kept_floor": {value}, "embedding_dim": {value}}}}}, '
        f'"baseline": {metrics}, "best": {{"epoch": {value}, "recall@1": {value}, "recall@4": 0.7}}, '
        f'"last": {metrics}, "wise": {{"alpha": {value}, "metrics": {metrics}}}, '
        f'"reference": {{"input_size": {value}, "sets": {{"photos": {{"test": {{"recall@1": {value}}}}}}}}}, '
        f'"label_free": {{"kept": [{{"epoch": {value}, "neighbours_kept@10": {value}}}], '
        f'"groups": [{{"clusters": {value}, "stability": {value}, "images": {value}}}]}}}}'
    )
    (folder / "report.json").write_text(report)
    (folder / READINGS_FILE).write_text(
        f'{{"labels": {{"bad": "hostile reading", "good": "photos, Recall@1"}}, '
        f'"pretrained": {{"bad": {value}, "good": 0.9}}, "delivered": {{"bad": 0.5, "good": 0.85}}}}')
    (folder / "metrics.jsonl").write_text(
        f'{{"epoch": 0, "recall@1": {value}}}\n{{"epoch": 1, "loss": {value}, "recall@1": 0.5}}\n'
        f'{{"epoch": {value}, "loss": 1.0, "recall@1": 0.5}}\n{{"epoch": 2, "loss": 0.5, "recall@1": 0.6}}\n')
    return folder / "report.json"


@pytest.mark.parametrize("value", [HUGE_INT, LONGER_THAN_PYTHON_READS])
def test_a_huge_integer_in_readings_json_is_left_out_and_named(tmp_path, value):
    """The reading that holds it is left out, named by file and key with the fix; the other reading shows."""
    (tmp_path / "report.json").write_text(json.dumps({"format": REPORT_FORMAT, "kind": "train",
                                                      "best": {"epoch": 3, "recall@1": 0.5}}))
    (tmp_path / READINGS_FILE).write_text(
        f'{{"labels": {{"bad": "hostile reading", "good": "photos, Recall@1"}}, '
        f'"pretrained": {{"bad": {value}, "good": 0.9}}, "delivered": {{"bad": 0.5, "good": 0.85}}}}')
    report = load_report(tmp_path / "report.json")
    assert report.readings == {"labels": {"good": "photos, Recall@1"}, "pretrained": {"good": 0.9},
                               "delivered": {"good": 0.85}}
    (problem,) = report.problems
    assert problem.startswith(f"{READINGS_FILE}, pretrained.bad: an integer of {len(value)} digits")
    assert "left out" in problem and "set_int_max_str_digits" not in problem
    summary = summary_markdown(report)
    assert "| photos, Recall\\@1 | 90.0 | 85.0 | -5.0 |" in summary  # the rest of the readings still shows
    assert "pretrained.bad" in summary and "hostile reading" not in summary


def test_a_huge_integer_in_report_json_is_left_out_and_named(tmp_path):
    report = load_report(write_report(tmp_path, HUGE_INT))
    named = "\n".join(report.problems)
    for field in ("report.json, config.train.epochs", "report.json, baseline.recall@1",  # in the file's order
                  "report.json: 23 more integers too large", f"{READINGS_FILE}, pretrained.bad"):
        assert field in named, named
    assert len(report.problems) == 7  # five named and the rest counted, per file: a page, not a flood
    assert report.data["best"] == {"epoch": None, "recall@1": None, "recall@4": 0.7}  # the rest is kept
    headers, rows = report.metrics_table()
    assert ["recall@4", None, 70.0, None, None, None] in rows


@pytest.mark.parametrize("value", HOSTILE_NUMBERS)
def test_the_evaluation_tabs_render_functions_do_not_raise_on_hostile_numbers(tmp_path, monkeypatch, value):
    """Everything the Evaluation tab draws from a report, its readings and its metrics log: the summary, the
    metrics table and every picture; opened on the page, the summary is shown, not the refusal."""
    report = load_report(write_report(tmp_path, value))
    assert "photos, Recall" in summary_markdown(report)  # the good reading is still there
    report.metrics_table()
    report.map_equals_recall()
    embedding_map_note(report)
    assert recall_plot(report) is not None and curves_plot(report) is not None  # drawn from the good values
    for picture in REPORT_PICTURES:
        picture.draw(report)
    service = SimpleNamespace(index_dir=Path("/srv/index"),
                              current=lambda: SimpleNamespace(index=SimpleNamespace(info=IndexInfo())))
    facts = GalleryFacts(images=4, labelled=4, classes=2, example_labels=["a"], folder=Path("/srv/photos"),
                         dataset={}, unicode_labels=False)
    monkeypatch.chdir(tmp_path)  # the page opens reports under the server's working folder
    summary, *_ = EvaluationTab(service, None, facts).open_report("report.json")
    assert summary.startswith("**train** report"), summary[:500]


def test_serve_report_warns_naming_the_field_instead_of_failing(tmp_path, caplog):
    """`retrieval serve --report` checks the report before serving: a value left out is a warning naming it."""
    from retrieval.serve.server import check_report

    report = write_report(tmp_path, HUGE_INT)
    with caplog.at_level(logging.WARNING, logger="retrieval.serve"):
        check_report(report)
    warned = caplog.text
    assert "report.json, baseline.recall@1: an integer of 401 digits" in warned
    assert f"{READINGS_FILE}, pretrained.bad" in warned
