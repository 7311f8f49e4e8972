"""retrieval.reports builds both kinds of report.json; the app's reader (serve.report_files) accepts both."""

import json

import numpy as np

from retrieval.records.model_config import ModelConfig
from retrieval.records.run_config import RunFolderConfig
from retrieval.reports import REPORT_FORMAT, evaluate_report, save_report, train_report
from retrieval.serve.report_files import load_report


def test_train_and_evaluate_reports_round_trip_through_the_reader(tmp_path):
    metrics = {"recall@1": np.float32(0.5), "recall@2": 0.75, "map@r": 0.25}
    config, model = RunFolderConfig.from_json({"train": {"loss": "ms"}}), ModelConfig.from_json({"backbone": "x"})
    train = train_report(config, [{"epoch": 0, **metrics}], metrics, None, None, {})
    save_report(train, tmp_path / "report.json")
    evaluation = evaluate_report(tmp_path / "best.pt", "digits", None, "test", {}, 12, model, metrics)
    save_report(evaluation, tmp_path / "eval_report.json")

    for name, kind in (("report.json", "train"), ("eval_report.json", "evaluate")):
        data = json.loads((tmp_path / name).read_text())
        assert data["format"] == REPORT_FORMAT == "retrieval-report/1" and data["kind"] == kind
        report = load_report(tmp_path / name)
        assert report.kind == kind and report.data["metrics"]["recall@1"] == 0.5  # numpy scalars saved as floats
    assert evaluation["checkpoint"] == str(tmp_path / "best.pt") and evaluation["num_queries"] == 12
    assert train["checkpoints"] == {"best": "best.pt", "last": "last.pt"} and train["bad_images"] == []
