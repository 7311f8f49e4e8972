"""A labelled run measures the pretrained export (the backbone's pooled features, no head) on its own test split,
says whether the model it delivers beats it beyond noise (``keep_pretrained``), and can start its head at that
baseline (``--head-start``), whose start may then be best.pt."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from train_configs import digits_config

from retrieval.cli.main import main
from retrieval.compatibility import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED
from retrieval.train import train
from retrieval.train.evaluating import Evaluator
from retrieval.train.pretrained_export import MIN_GAIN, keep_pretrained
from retrieval.train.trainer import Trainer

FEATURE_DIM = 1280  # EfficientNet-Lite0's pooled features


@pytest.fixture(scope="module")
def feature_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("features"))


def test_the_pretrained_export_is_the_backbones_features_alone_on_the_runs_test_split(tmp_path, feature_cache):
    from retrieval.data import build_transforms
    from retrieval.inference import embed_samples
    from retrieval.metrics.evaluation import load_eval_sets, present_class_names
    from retrieval.metrics.ranking import evaluate
    from retrieval.models import create_pretrained_embedder

    report = train(digits_config(tmp_path / "run", feature_cache, epochs=1, val_fraction=0.2), progress=False)

    # independently: the pretrained backbone as `retrieval export --pretrained` makes it (FeatureHead), embedding the
    # same test images at the run's size and resize, each a query against the others
    model = create_pretrained_embedder("efficientnet_lite0", 32, "crop")
    sets = load_eval_sets("digits", None, "test", build_transforms(model.preprocessing, train=False), None, 0,
                          protocol="standard", limit_per_class=30)
    embedded = embed_samples(model, sets.query, 64, "cpu", 0, False, "pretrained", False)
    expected = evaluate(embedded.embeddings, embedded.labels, ks=(1,), metrics=["recall", "map@r"])
    measured = report["pretrained_export"]
    assert measured["recall@1"] == pytest.approx(expected["recall@1"], abs=1e-6)
    assert measured["map@r"] == pytest.approx(expected["map@r"], abs=1e-6)
    assert (measured["input_size"], measured["resize"], measured["images"]) == (32, "crop", len(sets.query))
    assert measured["command"] == "retrieval export --pretrained efficientnet_lite0 --resize crop --image-size 32 " \
                                  "--out model.onnx"
    assert len(present_class_names(sets.query)) == 10
    assert isinstance(report["keep_pretrained"], bool) and "the pretrained export" in report["keep_pretrained_reason"]
    assert report["pretrained_gain"]["queries"] == len(sets.query)
    assert json.loads((tmp_path / "run" / "report.json").read_text())["pretrained_export"] == measured


def test_an_identity_head_starts_exactly_at_the_pretrained_export(tmp_path, feature_cache):
    trainer = Trainer(digits_config(tmp_path / "run", feature_cache, head_start="identity",
                                    embedding_dim=FEATURE_DIM), progress=False)
    trainer.setup()
    start = trainer.evaluation.embed_eval()
    export = trainer.evaluation.pretrained.embeddings()
    assert np.array_equal(start[0], export[0]) and np.array_equal(start[1], export[1])
    assert start[2] is None and export[2] is None  # digits: each test image a query against the others


def test_an_identity_head_needs_the_backbones_size_and_says_so_before_any_work(tmp_path, feature_cache):
    result = CliRunner().invoke(main, [
        "train", "--dataset", "digits", "--dataset-param", "protocol=standard", "--freeze-backbone",
        "--image-size", "32", "--embedding-dim", "16", "--head-start", "identity", "--workers", "0", "--device",
        "cpu", "--feature-cache", feature_cache, "--out", str(tmp_path / "run")])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert ("--head-start identity starts the head as the pretrained export itself, so the embedding must have "
            "the backbone's 1280 dimensions, and --embedding-dim is 16: give --embedding-dim 1280, or --head-start "
            "principal") in " ".join(result.output.split())
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("head_start, best_epoch", [("principal", 0), ("random", 2)])
def test_the_start_is_best_pt_where_the_head_starts_at_the_baseline_and_no_epoch_beats_it(
        tmp_path, feature_cache, monkeypatch, head_start, best_epoch):
    validation = iter([0.9, 0.2, 0.5, 0.3])  # epochs 0 (the start), 1, 2, 3
    monkeypatch.setattr(Evaluator, "validate", lambda self: {"recall@1": (v := next(validation)), "map@r": v})
    run = tmp_path / "run"
    starts = []
    real_start = Trainer._start_head
    monkeypatch.setattr(Trainer, "_start_head", lambda self, how: (real_start(self, how), starts.append(
        {k: v.clone() for k, v in self.parts.model.head.state_dict().items()}))[0])
    report = train(digits_config(run, feature_cache, val_fraction=0.2, head_start=head_start), progress=False)
    best = torch.load(run / "best.pt", weights_only=False)
    assert best["epoch"] == report["best"]["epoch"] == best_epoch
    if best_epoch == 0:  # the start itself: its head as started, and the test metrics of the start
        assert all(torch.equal(best["state_dict"][f"head.{k}"], v) for k, v in starts[0].items())
        assert report["best"]["recall@1"] == report["baseline"]["recall@1"]
    else:
        assert not starts  # a random head is not started at anything


def slow_keep(delivered: np.ndarray, pretrained: np.ndarray) -> tuple[bool, float, float]:
    """The rule written out: resample the queries one draw at a time, the gain's 95 % percentile interval."""
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    gains = []
    for _ in range(BOOTSTRAP_RESAMPLES):
        drawn = rng.integers(0, len(delivered), size=len(delivered))
        gains.append(delivered[drawn].mean() - pretrained[drawn].mean())
    low, high = np.quantile(gains, [0.025, 0.975])
    gain = delivered.mean() - pretrained.mean()
    return not (gain >= MIN_GAIN and low > 0 and len(delivered) >= 20), float(low), float(high)


def hits(total: int, both: int, won: int, lost: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-query Recall@1 of (delivered, pretrained): ``both`` right under both, ``won`` by the delivered model
    alone, ``lost`` by it alone; the rest wrong under both."""
    delivered = np.zeros(total)
    pretrained = np.zeros(total)
    delivered[:both + won] = 1
    pretrained[:both] = 1
    pretrained[both + won:both + won + lost] = 1
    return delivered, pretrained


@pytest.mark.parametrize("case, keep", [
    (hits(2000, 1000, 20, 0), True),  # +0.01, however sure: less than is worth re-indexing for
    (hits(400, 200, 20, 0), False),  # +0.05 on 400 queries, every change a win: beyond noise
    (hits(40, 20, 4, 2), True),  # +0.05 on 40 queries, wins and losses: within noise
    (hits(10, 5, 1, 0), True),  # +0.10 on 10 queries: too few to tell
])
def test_the_keep_rule_reads_the_gain_through_a_paired_bootstrap(case, keep):
    delivered, pretrained = case
    verdict = keep_pretrained({"recall@1": delivered, "map@r": delivered},
                              {"recall@1": pretrained, "map@r": pretrained})
    expected_keep, low, high = slow_keep(delivered, pretrained)
    assert verdict["keep_pretrained"] is expected_keep is keep
    assert verdict["pretrained_gain"]["interval"] == pytest.approx([low, high])
    assert verdict["pretrained_gain"]["recall@1"] == pytest.approx(delivered.mean() - pretrained.mean())
    said = verdict["keep_pretrained_reason"]
    assert said.startswith("keep the pretrained export: " if keep else "best.pt beats the pretrained export: ")
    assert f"Recall@1 {delivered.mean():.3f} against the pretrained export's {pretrained.mean():.3f}" in said


def test_the_last_line_and_the_export_say_keep_the_pretrained_export(tmp_path, feature_cache):
    out = tmp_path / "run"
    args = ["train", "--dataset", "digits", "--dataset-param", "protocol=standard", "--dataset-param",
            "limit_per_class=30", "--image-size", "32", "--freeze-backbone", "--embedding-dim", str(FEATURE_DIM),
            "--head-start", "identity", "--lr", "1e-12", "--batch-size", "20", "--batches-per-epoch", "2",
            "--epochs", "1", "--workers", "0", "--device", "cpu", "--no-plots", "--no-tensorboard",
            "--feature-cache", feature_cache, "--val-fraction", "0.2", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["keep_pretrained"] is True  # the head barely moved from the export: no gain to speak of
    before = f"{report['pretrained_export']['recall@1']:.4f}"
    trained = next(line for line in result.stdout.splitlines() if line.startswith("trained "))
    assert f"the pretrained export {before}; keep the pretrained export; report" in trained
    assert report["keep_pretrained_reason"] in result.stdout
    assert result.stdout.rstrip().splitlines()[-1].startswith(
        "next: retrieval export --pretrained efficientnet_lite0 --resize crop --image-size 32 --out model.onnx")

    exported = CliRunner().invoke(main, ["export", "--checkpoint", str(out / "best.pt"), "--out",
                                         str(tmp_path / "model.onnx")])
    assert exported.exit_code == 0, exported.output
    said = [line for line in exported.stdout.splitlines() if line.startswith("keep the pretrained export")]
    assert len(said) == 1 and said[0].endswith(f"(its run's report {out / 'report.json'})")
    assert exported.stdout.rstrip().splitlines()[-1].startswith(  # what to serve instead, this model one step away
        "next: retrieval export --pretrained efficientnet_lite0 --resize crop --image-size 32 --out model.onnx   (the "
        "pretrained export; to use this model anyway: retrieval index build --model")

    report["keep_pretrained"] = False  # a run whose model beat it: nothing said, and --json says false
    (out / "report.json").write_text(json.dumps(report))
    exported = CliRunner().invoke(main, ["export", "--checkpoint", str(out / "best.pt"), "--out",
                                         str(tmp_path / "model2.onnx"), "--json"])
    assert exported.exit_code == 0, exported.output
    assert json.loads(exported.stdout[exported.stdout.index("{"):])["keep_pretrained"] is False


def test_the_train_summary_as_json_carries_the_pretrained_export(tmp_path, feature_cache):
    result = CliRunner().invoke(main, [
        "train", "--dataset", "digits", "--dataset-param", "protocol=standard", "--dataset-param",
        "limit_per_class=30", "--image-size", "32", "--freeze-backbone", "--embedding-dim", "16", "--batch-size",
        "20", "--batches-per-epoch", "2", "--epochs", "1", "--workers", "0", "--device", "cpu", "--no-plots",
        "--no-tensorboard", "--feature-cache", feature_cache, "--out", str(tmp_path / "run"), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert summary["pretrained_export"] == report["pretrained_export"]
    assert summary["keep_pretrained"] is report["keep_pretrained"]


def test_the_app_shows_the_pretrained_export_beside_the_model_and_whether_to_keep_it(tmp_path):
    from retrieval.serve.report_files import RunReport
    from retrieval.serve.report_summary import summary_markdown

    reason = ("keep the pretrained export: best.pt Recall@1 0.700 against the pretrained export's 0.686 on the "
              "same 120 test queries, a gain of +0.014 (95% interval -0.030 to +0.060): less than the 0.02 worth "
              "re-indexing for")
    data = {"format": "retrieval-report/1", "kind": "train", "config": {"train": {}},
            "best": {"epoch": 3, "recall@1": 0.7, "map@r": 0.45},
            "pretrained_export": {"recall@1": 0.686, "map@r": 0.403, "input_size": 224, "resize": "pad",
                                  "images": 120, "command": "retrieval export --pretrained efficientnet_lite0"},
            "keep_pretrained": True, "keep_pretrained_reason": reason}
    opened = RunReport(tmp_path / "report.json", data)
    headers, rows = opened.metrics_table()
    column = headers.index("pretrained export, 224 px pad")
    assert headers[column - 1] == "best (epoch 3)"  # beside the model's
    values = {row[0]: row for row in rows}
    assert set(values) == {"recall@1", "map@r"}  # its size and image count are no metrics
    assert values["recall@1"][column] == 68.6 and values["map@r"][column] == 40.3
    assert values["recall@1"][column - 1] == 70.0
    shown = summary_markdown(opened)
    assert "**Against the pretrained export:** keep the pretrained export: best.pt Recall\\@1 0.700" in shown
    assert "less than the 0.02 worth re-indexing for." in shown  # the whole sentence
    assert "To serve it: `retrieval export --pretrained efficientnet_lite0`" in shown
    beaten = summary_markdown(RunReport(tmp_path / "report.json", {**data, "keep_pretrained": False,
                                                                   "keep_pretrained_reason": "best.pt beats it"}))
    assert "**Against the pretrained export:** best.pt beats it." in beaten and "To serve it" not in beaten
    assert "pretrained export" not in summary_markdown(RunReport(tmp_path / "report.json", {
        "format": "retrieval-report/1", "kind": "train", "config": {"train": {}}}))  # a run before the verdict
