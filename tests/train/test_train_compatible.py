"""--compatible-with: the influence term trains beside the loss (equal under --chunks and --resume), the report
shows BCT's three blocks, and the export declares the old model so that its index accepts the new one."""

from __future__ import annotations

import json

import pytest
import torch
from run_files import metrics_rows
from train_configs import digits_config

from retrieval.models import load_embedder
from retrieval.onnx_runtime import embedder_model_hash
from retrieval.train import train


@pytest.fixture(scope="module")
def old_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("compatible")
    train(digits_config(root / "old", root / "cache", epochs=1, plots=False, tensorboard=False), progress=False)
    return root


def compatible(root, name, **overrides):
    values = dict(epochs=2, seed=1, optimizer="sgd", lr=0.05, plots=False, tensorboard=False, eval_before=False,
                  compatible_with=str(root / "old" / "last.pt"))
    values.update(overrides)
    return digits_config(root / name, root / "cache", **values)


def test_the_influence_is_logged_and_the_report_has_the_three_blocks_and_the_model_the_old_hash(old_run):
    train(compatible(old_run, "new", plots=True), progress=False)
    rows = metrics_rows(old_run / "new")
    assert all("compatible" in row for row in rows) and any(row["compatible"] != 0 for row in rows)
    report = json.loads((old_run / "new" / "report.json").read_text())
    blocks = report["last"]["compatibility"]
    assert set(blocks) == {"new", "old", "cross_model", "compatible"}
    assert blocks["old"]["recall@1"] == report["history"][-1]["compatibility"]["old"]["recall@1"]  # taken once
    assert report["plots"]["compatibility"] == "compatibility.png" and (old_run / "new" / "compatibility.png").is_file()
    declared = torch.load(old_run / "new" / "last.pt", weights_only=False)["model_config"]["compatible_with"]
    assert declared == [embedder_model_hash(load_embedder(old_run / "old" / "last.pt"))]
    from retrieval.serve.reports import compatibility_plot, load_report, summary_markdown

    shown = load_report(old_run / "new" / "report.json")  # the app's Evaluation tab
    assert "**Compatibility with the old model:** " in summary_markdown(shown)
    assert compatibility_plot(shown) is not None


def test_the_influence_moves_the_new_model_toward_the_old_space(old_run):
    """From another seed's head, the same steps with a strong influence end nearer the old model's embeddings."""
    train(compatible(old_run, "faint", epochs=6, compatible_weight=1e-6), progress=False)
    train(compatible(old_run, "strong", epochs=6, compatible_weight=5.0), progress=False)
    old = load_embedder(old_run / "old" / "last.pt")
    features = torch.randn(64, old.head.linear.in_features)
    with torch.no_grad():
        target = old.head(features)
        near = {name: torch.nn.functional.cosine_similarity(
            load_embedder(old_run / name / "last.pt").head(features), target).mean() for name in ("faint", "strong")}
    assert near["strong"] > near["faint"]
    cross = {name: json.loads((old_run / name / "report.json").read_text())["last"]["compatibility"]["cross_model"]
             for name in ("faint", "strong")}
    assert cross["strong"]["map@r"] > cross["faint"]["map@r"]


def test_chunked_steps_equal_whole_ones_with_the_influence(old_run):
    train(compatible(old_run, "whole"), progress=False)
    train(compatible(old_run, "chunked", chunks=3), progress=False)
    whole, chunked = metrics_rows(old_run / "whole"), metrics_rows(old_run / "chunked")
    for a, b in zip(whole, chunked, strict=True):
        for key in ("loss", "compatible"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    wa, wb = (torch.load(old_run / run / "last.pt", weights_only=False)["state_dict"] for run in ("whole", "chunked"))
    assert all(torch.allclose(wa[k].double(), wb[k].double(), rtol=1e-5, atol=1e-5) for k in wa)


def test_a_resumed_run_equals_an_uninterrupted_one_with_the_influence(old_run):
    from retrieval.train.checkpointing import atomic_save
    from retrieval.train.trainer import Trainer

    straight = train(compatible(old_run, "straight", epochs=2), progress=False)
    partial = Trainer(compatible(old_run, "resumed", epochs=2), progress=False)
    partial.setup()
    row = {"epoch": 1, **partial.train_epoch(0), **partial.evaluate()}
    partial.record.history.append(row)
    atomic_save(partial.checkpoint(1, row), old_run / "resumed" / "last.pt")
    resumed = train(compatible(old_run, "resumed", epochs=2, resume=True), progress=False)
    assert resumed["last"]["loss"] == pytest.approx(straight["last"]["loss"], rel=1e-6)
    assert resumed["last"]["compatibility"] == straight["last"]["compatibility"]


def test_an_old_model_of_another_embedding_size_is_refused_with_the_size_to_use(old_run):
    with pytest.raises(ValueError, match="give --embedding-dim 16"):
        train(compatible(old_run, "other-size", embedding_dim=8), progress=False)


def test_the_exported_model_is_accepted_by_the_old_model_index_and_upgrades_it_in_place(old_run, tmp_path):
    """old checkpoint -> ONNX -> index; a new one trained compatible -> ONNX: search takes it, the upgrade mixes."""

    from sample_images import noisy_png

    from retrieval.export.onnx_export import export_checkpoint
    from retrieval.index import Index, IngestOptions, build_index, load_model
    from retrieval.index.upgrade import upgrade_index

    train(compatible(old_run, "exported"), progress=False)
    old_onnx, new_onnx = tmp_path / "old.onnx", tmp_path / "new.onnx"
    export_checkpoint(old_run / "old" / "last.pt", old_onnx, verify=False, log=lambda message: None)
    export_checkpoint(old_run / "exported" / "last.pt", new_onnx, verify=False, log=lambda message: None)
    declared = json.loads(load_model(new_onnx).metadata["compatible_with"])
    assert declared == [load_model(old_onnx).source_model_hash]
    for label, colour in enumerate([(200, 40, 40), (40, 200, 40)]):
        (tmp_path / "g" / f"c{label}").mkdir(parents=True)
        for n in range(4):
            (tmp_path / "g" / f"c{label}" / f"{n}.png").write_bytes(noisy_png(colour, 10 * label + n, size=32))
    build_index(tmp_path / "g", tmp_path / "idx", model=old_onnx, options=IngestOptions(workers=0, progress=False))
    with Index.open(tmp_path / "idx", embedder=load_model(new_onnx)) as index:  # declared compatible: accepted
        assert len(index.search_images([tmp_path / "g" / "c0" / "0.png"], k=3)[0]) == 3
    summary = upgrade_index(tmp_path / "idx", new_onnx, options=IngestOptions(workers=0, progress=False))
    assert summary["mode"] == "mixed" and summary["reembedded"] == 8


def test_evaluate_with_a_gallery_model_reports_the_three_blocks_and_the_criterion(old_run):
    from click.testing import CliRunner

    from retrieval.cli.main import main

    train(compatible(old_run, "evaluated"), progress=False)
    result = CliRunner().invoke(main, ["evaluate", "--checkpoint", str(old_run / "evaluated" / "last.pt"),
                                       "--gallery-model", str(old_run / "old" / "last.pt"), "--no-pictures",
                                       "--device", "cpu", "--workers", "0"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert {"new", "old", "cross_model", "compatible", "criterion"} <= set(payload)
    assert payload["criterion"].startswith(("compatible: ", "not compatible: "))
    trained = json.loads((old_run / "evaluated" / "report.json").read_text())["last"]["compatibility"]
    assert payload["cross_model"]["recall@1"] == pytest.approx(trained["cross_model"]["recall@1"])
    saved = json.loads((old_run / "evaluated" / "eval_report.json").read_text())
    assert saved["compatibility"]["compatible"] == payload["compatible"]
