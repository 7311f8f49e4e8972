"""--compatible-with: the influence term trains beside the loss (equal under --chunks and --resume), the report
shows BCT's three blocks, and the export declares the old model so that its index accepts the new one. A new
embedding size trains a projection into the old space, which the cross-model block, the export's second output and
the old index use."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from run_files import metrics_rows
from train_configs import digits_config

from retrieval.compatibility import NOT_COMPATIBLE, VERDICTS, compatibility_sentence, recorded_compatibility
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
    assert set(blocks) == {"new", "old", "cross_model", "verdict", "interval"} and blocks["verdict"] in VERDICTS
    assert blocks["interval"]["queries"] > 0 and set(blocks["interval"]["difference"]) == {"recall@1", "map@r"}
    assert blocks["old"]["recall@1"] == report["history"][-1]["compatibility"]["old"]["recall@1"]  # taken once
    assert report["plots"]["compatibility"] == "compatibility.png" and (old_run / "new" / "compatibility.png").is_file()
    declared = torch.load(old_run / "new" / "last.pt", weights_only=False)["model_config"]["compatible_with"]
    assert declared == [embedder_model_hash(load_embedder(old_run / "old" / "last.pt"))]
    from retrieval.serve.page_text import markdown_text
    from retrieval.serve.report_files import load_report
    from retrieval.serve.report_plots import compatibility_plot
    from retrieval.serve.report_summary import summary_markdown

    shown = load_report(old_run / "new" / "report.json")  # the app's Evaluation tab
    assert f"**Compatibility with the old model:** {markdown_text(compatibility_sentence(blocks))}." in \
        summary_markdown(shown)  # the verdict of report.json, in the same words
    assert compatibility_plot(shown) is not None


def test_the_influence_moves_the_new_model_toward_the_old_space(old_run):
    """From another seed's random head, the same steps with a strong influence end nearer the old model's
    embeddings (a head started at the baseline would start near the old one: nothing left to show)."""
    train(compatible(old_run, "faint", epochs=6, compatible_weight=1e-6, head_start="random"), progress=False)
    train(compatible(old_run, "strong", epochs=6, compatible_weight=5.0, head_start="random"), progress=False)
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


def last_weights(run) -> dict[str, torch.Tensor]:
    return torch.load(run / "last.pt", weights_only=False)["state_dict"]


# the old model embeds in 16 dimensions: 32 trains a projection into its space
SIZES = pytest.mark.parametrize("dim", [16, 32], ids=["same-size", "projected"])


@SIZES
def test_chunked_steps_equal_whole_ones_with_the_influence(old_run, dim):
    train(compatible(old_run, f"whole{dim}", embedding_dim=dim), progress=False)
    train(compatible(old_run, f"chunked{dim}", embedding_dim=dim, chunks=3), progress=False)
    whole, chunked = metrics_rows(old_run / f"whole{dim}"), metrics_rows(old_run / f"chunked{dim}")
    for a, b in zip(whole, chunked, strict=True):
        for key in ("loss", "compatible"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    wa, wb = last_weights(old_run / f"whole{dim}"), last_weights(old_run / f"chunked{dim}")
    assert wa.keys() == wb.keys() and ("compatible.linear.weight" in wa) == (dim != 16)
    assert all(torch.allclose(wa[k].double(), wb[k].double(), rtol=1e-5, atol=1e-5) for k in wa)


@SIZES
def test_a_resumed_run_equals_an_uninterrupted_one_with_the_influence(old_run, dim):
    from retrieval.train.checkpointing import atomic_save
    from retrieval.train.trainer import Trainer

    straight = train(compatible(old_run, f"straight{dim}", epochs=2, embedding_dim=dim), progress=False)
    partial = Trainer(compatible(old_run, f"resumed{dim}", epochs=2, embedding_dim=dim), progress=False)
    partial.setup()
    row = {"epoch": 1, **partial.train_epoch(0), **partial.evaluate()}
    partial.record.history.append(row)
    atomic_save(partial.checkpoint(1, row), old_run / f"resumed{dim}" / "last.pt")
    resumed = train(compatible(old_run, f"resumed{dim}", epochs=2, embedding_dim=dim, resume=True), progress=False)
    for a, b in zip(metrics_rows(old_run / f"straight{dim}"), metrics_rows(old_run / f"resumed{dim}"), strict=True):
        for key in ("loss", "compatible"):
            assert b[key] == pytest.approx(a[key], rel=1e-6), key
    assert resumed["last"]["compatibility"] == straight["last"]["compatibility"]
    wa, wb = last_weights(old_run / f"straight{dim}"), last_weights(old_run / f"resumed{dim}")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_new_embedding_size_trains_a_projection_into_the_old_space(old_run, capsys):
    """--embedding-dim 32 against an old model of 16: one line says so, the model gets P (32 -> 16) that trains
    (its gradient flows: it leaves its initial weights), the loss stays on the 32-d embedding, and the cross-model
    block compares the projected queries with the old gallery."""
    from retrieval.compatibility import compatibility_metrics
    from retrieval.models import CompatibleProjection
    from retrieval.train.trainer import Trainer

    report = train(compatible(old_run, "wider", embedding_dim=32, compatible_weight=5.0), progress=False)
    assert "a projection 32 -> 16 into the old space is trained with the model" in capsys.readouterr().err
    checkpoint = torch.load(old_run / "wider" / "last.pt", weights_only=False)
    assert checkpoint["model_config"]["compatible_dim"] == 16
    assert checkpoint["state_dict"]["head.linear.weight"].shape[0] == 32  # the native embedding: 32-d
    trained = checkpoint["state_dict"]["compatible.linear.weight"]
    assert trained.shape == (16, 32)
    initial = CompatibleProjection(32, 16, seed=1).linear.weight.detach()
    assert not torch.allclose(trained, initial, atol=1e-4)  # the influence's gradient reached P
    model = load_embedder(old_run / "wider" / "last.pt")  # rebuilt with its projection
    assert model.compatible is not None and torch.equal(model.compatible.linear.weight, trained)

    probe = Trainer(compatible(old_run, "wider-probe", embedding_dim=32), progress=False)
    probe.setup()  # the run's evaluation features (cached), to embed the split again by hand
    q, ql, g, gl = probe.parts.features.embed_eval(model)
    old_q, _, _, _ = probe.parts.features.embed_eval(load_embedder(old_run / "old" / "last.pt"))
    assert q.shape[1] == 32 and old_q.shape[1] == 16
    projected = q @ trained.numpy().T
    projected /= np.linalg.norm(projected, axis=1, keepdims=True)
    expected = compatibility_metrics(q, old_q, ql, cross_query=projected)
    blocks = report["last"]["compatibility"]
    for block in ("new", "old", "cross_model"):
        for metric, value in expected[block].items():
            assert blocks[block][metric] == pytest.approx(value, abs=1e-6), (block, metric)

    from click.testing import CliRunner

    from retrieval.cli.main import main

    result = CliRunner().invoke(main, ["evaluate", "--checkpoint", str(old_run / "wider" / "last.pt"),
                                       "--gallery-model", str(old_run / "old" / "last.pt"), "--no-pictures",
                                       "--device", "cpu", "--workers", "0"])
    assert result.exit_code == 0, result.output
    saved = json.loads((old_run / "wider" / "eval_report.json").read_text())["compatibility"]
    assert saved["cross_model"]["recall@1"] == pytest.approx(blocks["cross_model"]["recall@1"])
    lines = result.stdout.splitlines()  # for people: a line a block, then BCT's criterion in words
    new, old = old_run / "wider" / "last.pt", old_run / "old" / "last.pt"
    assert lines[0].startswith(f"{new} (new) against {old} (old) on ") and "{" not in result.stdout
    for line, (name, block) in zip(lines[1:4], (("new", "new"), ("old", "old"), ("cross-model", "cross_model")),
                                   strict=True):
        assert line.split()[0] == f"{name}:" and f"recall@1 {saved[block]['recall@1']:.4f}," in line, line
    assert lines[4] == compatibility_sentence(saved) and lines[5].startswith("report ")
    assert lines[6].startswith(f"next: retrieval export --checkpoint {new} ")


def test_the_projection_trains_in_an_ema_and_wise_ft_keeps_it_fine_tuned(old_run):
    from retrieval.train.robust import RobustFineTuning

    train(compatible(old_run, "wider-ema", embedding_dim=32, ema=0.5), progress=False)
    checkpoint = torch.load(old_run / "wider-ema" / "last.pt", weights_only=False)
    ema, trained = checkpoint["state_dict"], checkpoint["training_weights"]
    assert "compatible.linear.weight" in ema and not torch.equal(ema["compatible.linear.weight"],
                                                                 trained["compatible.linear.weight"])
    start = {key: torch.zeros_like(value) for key, value in trained.items()}
    mixed = RobustFineTuning(start, False, True).mix(trained, 0.5)
    assert torch.equal(mixed["compatible.linear.weight"], trained["compatible.linear.weight"])


def test_the_exported_model_is_accepted_by_the_old_model_index_and_upgrades_it_in_place(old_run, tmp_path):
    """old checkpoint -> ONNX -> index; a new one trained compatible -> ONNX: search takes it, the upgrade mixes."""

    from sample_images import noisy_png

    from retrieval.export.onnx_export import export_checkpoint
    from retrieval.index import Index, IngestOptions, build_index, load_model
    from retrieval.index.writing.upgrade import upgrade_index

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
    # a run this short may be measured not compatible, which the upgrade refuses unless forced
    summary = upgrade_index(tmp_path / "idx", new_onnx, options=IngestOptions(workers=0, progress=False), force=True)
    assert summary["mode"] == "mixed" and summary["reembedded"] == 8


def test_evaluate_the_report_the_export_and_the_upgrade_say_the_same_verdict(old_run, tmp_path):
    """One measurement, one verdict: `retrieval evaluate --gallery-model` (JSON and words), report.json (and the
    app's words for it), the model's export and `retrieval index upgrade`'s message."""
    from click.testing import CliRunner
    from sample_images import noisy_png

    from retrieval.cli.main import main
    from retrieval.export.onnx_export import export_checkpoint
    from retrieval.index import IngestOptions, build_index, load_model

    train(compatible(old_run, "said"), progress=False)
    trained = json.loads((old_run / "said" / "report.json").read_text())["last"]["compatibility"]
    evaluated = CliRunner().invoke(main, ["evaluate", "--checkpoint", str(old_run / "said" / "last.pt"),
                                          "--gallery-model", str(old_run / "old" / "last.pt"), "--no-pictures",
                                          "--device", "cpu", "--workers", "0", "--json"])
    assert evaluated.exit_code == 0, evaluated.output
    payload = json.loads(evaluated.stdout)
    assert payload["verdict"] == trained["verdict"] and payload["criterion"] == compatibility_sentence(payload)
    assert payload["interval"]["queries"] == trained["interval"]["queries"]
    for name, bounds in trained["interval"]["difference"].items():
        assert payload["interval"]["difference"][name] == pytest.approx(bounds, abs=1e-6)

    old_onnx, new_onnx = tmp_path / "old.onnx", tmp_path / "new.onnx"
    export_checkpoint(old_run / "old" / "last.pt", old_onnx, verify=False, log=lambda message: None)
    export_checkpoint(old_run / "said" / "last.pt", new_onnx, verify=False, log=lambda message: None)
    recorded = recorded_compatibility(load_model(new_onnx).metadata)
    assert recorded == {key: trained[key] for key in ("old", "cross_model", "verdict", "interval")}
    for label, colour in enumerate([(200, 40, 40), (40, 200, 40)]):
        (tmp_path / "g" / f"c{label}").mkdir(parents=True)
        for n in range(3):
            (tmp_path / "g" / f"c{label}" / f"{n}.png").write_bytes(noisy_png(colour, 10 * label + n, size=32))
    build_index(tmp_path / "g", tmp_path / "idx", model=old_onnx, options=IngestOptions(workers=0, progress=False))
    args = ["index", "upgrade", str(tmp_path / "idx"), "--model", str(new_onnx), "--workers", "0"]
    if trained["verdict"] == NOT_COMPATIBLE:  # refused, quoting the same verdict, unless forced
        refused = CliRunner().invoke(main, args)
        assert refused.exit_code == 1 and compatibility_sentence(trained) in refused.output, refused.output
        assert "--force" in refused.output
    upgraded = CliRunner().invoke(main, [*args, "--force"])
    assert upgraded.exit_code == 0, upgraded.output
    assert f"\nmeasured when the model was trained: {compatibility_sentence(trained)}\n" in upgraded.stdout


def test_the_export_of_a_new_size_has_two_outputs_equal_to_torch_and_serves_the_old_index_through_the_second(
        old_run, tmp_path):
    """NEW (32-d, P into OLD's 16-d space) -> ONNX with `embeddings` [n, 32] and `compatible_embedding` [n, 16],
    each equal to torch's; OLD's index is searched and upgraded through the second, and index.json records it."""
    from sample_images import noisy_png

    from retrieval.export.onnx_export import export_checkpoint
    from retrieval.index import Index, IngestOptions, build_index, load_model
    from retrieval.index.writing.upgrade import upgrade_index
    from retrieval.onnx_runtime import OnnxEmbedder

    train(compatible(old_run, "wider-exported", embedding_dim=32), progress=False)
    old_onnx, new_onnx = tmp_path / "old.onnx", tmp_path / "new.onnx"
    export_checkpoint(old_run / "old" / "last.pt", old_onnx, verify=False, log=lambda message: None)
    result = export_checkpoint(old_run / "wider-exported" / "last.pt", new_onnx, log=lambda message: None)
    assert {check.output for check in result.verification.checks} == {"embeddings", "compatible_embedding"}
    assert result.metadata["compatible_output"] == "compatible_embedding" and result.metadata["compatible_dim"] == "16"
    runtime, model = OnnxEmbedder(new_onnx, providers="cpu"), load_embedder(old_run / "wider-exported" / "last.pt")
    assert [o.name for o in runtime.session.get_outputs()] == ["embeddings", "compatible_embedding"]
    batch = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        native, projected = model.embed_both(batch)
    assert np.allclose(runtime.embed_batch(batch.numpy()), native.numpy(), atol=1e-5)
    onnx_projected = runtime.with_output("compatible_embedding").embed_batch(batch.numpy())
    assert onnx_projected.shape == (5, 16) and np.allclose(onnx_projected, projected.numpy(), atol=1e-5)
    assert np.allclose(np.linalg.norm(onnx_projected, axis=1), 1, atol=1e-5)

    for label, colour in enumerate([(200, 40, 40), (40, 200, 40)]):
        (tmp_path / "g" / f"c{label}").mkdir(parents=True)
        for n in range(4):
            (tmp_path / "g" / f"c{label}" / f"{n}.png").write_bytes(noisy_png(colour, 10 * label + n, size=32))
    quick = IngestOptions(workers=0, progress=False)
    build_index(tmp_path / "g", tmp_path / "idx", model=old_onnx, options=quick)
    with Index.open(tmp_path / "idx", embedder=load_model(new_onnx)) as index:  # declared compatible, 16-d output
        assert index.embedder.output_name == "compatible_embedding"
        assert len(index.search_images([tmp_path / "g" / "c0" / "0.png"], k=3)[0]) == 3
    summary = upgrade_index(tmp_path / "idx", new_onnx, options=quick, force=True)  # a short run: maybe refuted
    assert summary["mode"] == "mixed" and summary["reembedded"] == 8
    info = json.loads((tmp_path / "idx" / "index.json").read_text())
    assert (info["embedding_dim"], info["model_output"]) == (16, "compatible_embedding")
    assert info["model_output_space"] == [load_model(old_onnx).source_model_hash]


def test_evaluate_with_a_gallery_model_reports_the_three_blocks_and_the_criterion(old_run):
    from click.testing import CliRunner

    from retrieval.cli.main import main

    train(compatible(old_run, "evaluated"), progress=False)
    result = CliRunner().invoke(main, ["evaluate", "--checkpoint", str(old_run / "evaluated" / "last.pt"),
                                       "--gallery-model", str(old_run / "old" / "last.pt"), "--no-pictures",
                                       "--device", "cpu", "--workers", "0", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert {"new", "old", "cross_model", "verdict", "interval", "criterion"} <= set(payload)
    assert payload["criterion"].startswith(tuple(f"{verdict}: " for verdict in VERDICTS))
    trained = json.loads((old_run / "evaluated" / "report.json").read_text())["last"]["compatibility"]
    assert payload["cross_model"]["recall@1"] == pytest.approx(trained["cross_model"]["recall@1"])
    saved = json.loads((old_run / "evaluated" / "eval_report.json").read_text())
    assert saved["compatibility"]["verdict"] == payload["verdict"]
    assert saved["compatibility"]["interval"] == payload["interval"]
