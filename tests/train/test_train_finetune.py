"""Robust fine-tuning in real training runs: LP-FT, L2-SP, distillation, layer-wise decay, EMA, WiSE-FT, and the
out-of-domain evaluation (--eval-extra) beside the test split.

The maths of each method is tested against float64 references in test_robust_finetune.py; here a tiny random-init
timm ResNet fine-tunes on a folder of images, and every option must survive a crash and --resume with the same
weights and metrics as one uninterrupted run (the 2-process equality is in test_train_ddp.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from run_files import read_jsonl
from run_resume import Crash, assert_same_run, checkpoint, crash_after
from sample_images import noisy_png

from retrieval.metrics.evaluation import load_extra_set
from retrieval.models import load_embedder
from retrieval.train import TrainConfig, train
from retrieval.train.robust import WISE_ALPHAS, choose_alpha

COLORS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30), (30, 200, 200), (200, 30, 200)]
# each option alone, as a user turns it on (values big enough to move the weights in a few steps)
METHODS = {
    "lp-ft": dict(lp_epochs=1),
    "l2sp": dict(l2sp=0.5),
    "distill": dict(distill=1.0),
    "layer-decay": dict(layer_decay=0.5),
    "ema": dict(ema=0.5),
    "wise": dict(wise_alpha="auto", val_fraction=0.34),
}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """6 train classes of 6 images, 4 test classes, and an out-of-domain folder (3 classes of 16: its test half has
    more images than the neighbours counted in KEPT)."""
    root = tmp_path_factory.mktemp("finetune-images")
    for split, classes, count in (("data/train", 6, 6), ("data/test", 4, 4), ("other", 3, 16)):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                seed = 1000 * c + 10 * i + 7 * len(split)
                (folder / f"{i}.png").write_bytes(noisy_png(COLORS[(c + len(split)) % len(COLORS)], seed))
    return root


def config(images: Path, out: Path, **overrides) -> TrainConfig:
    values = dict(dataset="folder", data=str(images / "data"), backbone="timm:test_resnet", pretrained=False,
                  image_size=32, embedding_dim=16, loss="ms", batch_size=8, per_class=2, batches_per_epoch=2,
                  epochs=3, optimizer="sgd", lr=0.05, eval_every=1, workers=0, device="cpu", out=str(out),
                  plots=False, eval_extra=[str(images / "other")], val_fraction=0)
    values.update(overrides)
    return TrainConfig(**values)




@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_resumes_as_one_uninterrupted_run(images, tmp_path, monkeypatch, method):
    straight = config(images, tmp_path / "straight", **METHODS[method])
    train(straight, progress=False)
    assert any(r.get("loss", 0) > 0 for r in read_jsonl(tmp_path / "straight" / "metrics.jsonl"))

    killed = config(images, tmp_path / "killed", checkpoint_every=1, **METHODS[method])
    crash_after(monkeypatch, epoch=1, batch=1)  # inside epoch 2: after LP-FT's head phase, mid fine-tuning
    with pytest.raises(Crash):
        train(killed, progress=False)
    monkeypatch.undo()
    train(config(images, tmp_path / "killed", checkpoint_every=1, resume=True, **METHODS[method]), progress=False)
    assert_same_run(tmp_path / "straight", tmp_path / "killed")


def test_lp_ft_first_phase_changes_only_the_head(images, tmp_path, monkeypatch):
    import retrieval.train.building as building
    import retrieval.train.checkpointing as checkpointing

    saved = {}
    save = checkpointing.atomic_save

    def keep(state, path):
        save(state, path)
        if Path(path).name == "last.pt" and not state.get("in_epoch"):
            saved[state["epoch"]] = {k: v.clone() for k, v in state["state_dict"].items()}

    monkeypatch.setattr(checkpointing, "atomic_save", keep)
    train(config(images, tmp_path / "run", lp_epochs=1, epochs=2, eval_every=100, wise_alpha=1.0), progress=False)
    start = checkpoint(tmp_path / "run")["robust"]["start"]  # after the head phase: the head LP-FT trained
    building.seed_everything(0)  # as the run seeds itself before it builds the model
    init = building.create_embedder("timm:test_resnet", 16, pretrained=False).state_dict()
    after_lp, after_ft = saved[1], saved[2]
    backbone = [k for k in after_lp if k.startswith("backbone.")]
    assert backbone and all(torch.equal(after_lp[k], start[k]) for k in backbone)  # untouched by the head phase
    assert all(torch.equal(after_lp[k], init[k]) for k in backbone if "num_batches" not in k)
    assert not torch.equal(after_lp["head.linear.weight"], init["head.linear.weight"])  # the head learned
    assert any(not torch.equal(after_ft[k], after_lp[k]) for k in backbone)  # then everything fine-tunes


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_wise_ft_ends_are_the_start_and_the_fine_tuned_weights(images, tmp_path, alpha):
    run = tmp_path / "run"
    train(config(images, run, wise_alpha=alpha, lp_epochs=1, eval_every=100), progress=False)
    wise, last = checkpoint(run, "wise.pt"), checkpoint(run, "last.pt")
    expected = last["robust"]["start"] if alpha == 0 else last["state_dict"]
    assert wise["state_dict"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(wise["state_dict"][key], value), key
    assert wise["model_config"]["wise_alpha"] == alpha
    model = load_embedder(run / "wise.pt")  # an ordinary model: export and serving read it as any other
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 16)
    report = json.loads((run / "report.json").read_text())
    assert report["wise"]["alpha"] == alpha and report["wise"]["chosen"] == "given"
    assert report["checkpoints"]["wise"] == "wise.pt"


def test_wise_ft_keeps_a_random_head_fine_tuned(images, tmp_path):
    """Without LP-FT the start's head is random: mixing toward it means nothing, so the head stays fine-tuned."""
    run = tmp_path / "run"
    train(config(images, run, wise_alpha=0.0, eval_every=100), progress=False)
    wise, last = checkpoint(run, "wise.pt"), checkpoint(run, "last.pt")
    start = last["robust"]["start"]
    for key, value in wise["state_dict"].items():
        assert torch.equal(value, last["state_dict"][key] if key.startswith("head.") else start[key]), key


def test_wise_ft_auto_draws_the_curve_and_chooses_on_validation(images, tmp_path):
    run = tmp_path / "run"
    report = train(config(images, run, wise_alpha="auto", val_fraction=0.34, plots=True), progress=False)
    wise = report["wise"]
    assert [p["alpha"] for p in wise["curve"]] == list(WISE_ALPHAS) and wise["chosen"] == "validation"
    assert wise["alpha"] == choose_alpha(wise["curve"], 0.02)
    for point in wise["curve"]:
        assert 0 <= point["in_domain"] <= 1 and 0 <= point["out_of_domain"] <= 1 and "other" in point["extra"]
    assert {"domains", "wise"} <= set(report["plots"]) and (run / "wise.png").is_file()
    from retrieval.serve.report_files import load_report
    from retrieval.serve.report_plots import domains_plot, wise_plot
    from retrieval.serve.report_summary import summary_markdown

    opened = load_report(run / "report.json")  # what the app's Evaluation tab shows
    assert domains_plot(opened).size[0] > 300 and wise_plot(opened).size[0] > 300
    assert "**other**: start \\(epoch 0\\)" in summary_markdown(opened) and "pretrained backbone, 160 px" in \
        summary_markdown(opened)
    headers, _ = opened.metrics_table()
    assert f"WiSE-FT (alpha {wise['alpha']:g})" in headers


def test_eval_extra_is_reported_before_and_after_training_beside_the_reference(images, tmp_path):
    run = tmp_path / "run"
    report = train(config(images, run), progress=False)
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3]
    for row in rows:
        assert set(row["extra"]) == {"other"} and 0 <= row["extra"]["other"]["recall@1"] <= 1
    assert report["baseline"]["extra"] == rows[0]["extra"] and report["last"]["extra"] == rows[-1]["extra"]
    reference = report["reference"]
    assert reference["input_size"] == 160  # timm test_resnet's own resolution, not the --image-size 32
    assert set(reference["sets"]["other"]) == {"test"}
    from retrieval.serve.report_files import load_report

    headers, table = load_report(run / "report.json").metrics_table()
    names = [r[0] for r in table]
    assert "other: recall@1" in names and names.index("other: recall@1") > names.index("recall@1")
    from retrieval.serve.report_plots import domains_plot, wise_plot

    assert wise_plot(load_report(run / "report.json")) is None  # no --wise-alpha, no picture (the tab hides it)
    assert domains_plot(load_report(run / "report.json")) is None  # --no-plots
    row = table[names.index("other: recall@1")]
    assert row[headers.index("pretrained backbone, 160 px")] == pytest.approx(
        100 * reference["sets"]["other"]["test"]["recall@1"], abs=0.051)


def test_ema_is_what_is_evaluated_and_saved(images, tmp_path):
    run = tmp_path / "run"
    train(config(images, run, ema=0.5, eval_every=100), progress=False)
    last = checkpoint(run)
    trained, averaged = last["training_weights"], last["state_dict"]
    assert trained.keys() == averaged.keys()
    assert any(not torch.equal(trained[k], averaged[k]) for k in trained if k.endswith("weight"))
    assert last["robust"]["ema"] is not None


def test_l2sp_and_distill_terms_are_logged(images, tmp_path):
    run = tmp_path / "run"
    train(config(images, run, l2sp=0.5, distill=1.0, eval_every=100), progress=False)
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r["epoch"] > 0]
    assert all(r["l2sp"] >= 0 and r["distill"] >= 0 for r in rows)
    assert rows[-1]["l2sp"] > 0 and rows[-1]["distill"] > 0  # the backbone left its start


def test_load_extra_set_splits_each_class_into_val_and_test(images):
    extra = load_extra_set(str(images / "other"), None)
    assert extra.name == "other" and len(extra.val) == len(extra.test) == 24
    assert not set(extra.val.samples) & set(extra.test.samples)
    assert sorted(np.bincount(extra.val.labels)) == [8, 8, 8]
    assert load_extra_set(str(images / "other"), None).val.samples == extra.val.samples  # the same every run
    limited = load_extra_set(str(images / "other"), None, limit=12)
    assert len(limited.val) + len(limited.test) == 12


def test_eval_extra_reports_the_neighbours_the_model_keeps_from_the_pretrained_backbone(images, tmp_path):
    from retrieval.compatibility import KEPT, neighbour_overlap
    from retrieval.data import build_transforms
    from retrieval.inference import embed_samples

    run = tmp_path / "run"
    report = train(config(images, run, feature_cache=str(tmp_path / "cache")), progress=False)
    kept = report["last"]["extra"]["other"][KEPT]
    # the same measure from its parts: the last model and the pretrained backbone (at its own 160 px) embed the
    # extra set's test half, and each image's top-10 under one is compared with its top-10 under the other
    model = load_embedder(run / "last.pt").eval()
    test = load_extra_set(str(images / "other"), build_transforms(model.preprocessing, train=False)).test
    by_model = embed_samples(model, test, 64, torch.device("cpu"), 0, False, "", False).embeddings
    import retrieval.train.building as building

    building.seed_everything(0)  # the backbone as the run began: random-init here, pretrained for a user
    start = building.create_embedder("timm:test_resnet", 16, pretrained=False).backbone.eval()
    test.transform = build_transforms(replace(model.preprocessing, input_size=160), train=False)
    by_backbone = embed_samples(start, test, 64, torch.device("cpu"), 0, False, "", False).embeddings
    unit = lambda rows: rows / np.linalg.norm(rows, axis=1, keepdims=True)  # noqa: E731
    assert kept == pytest.approx(neighbour_overlap(unit(by_backbone), unit(by_model), 10).mean(), abs=1e-9)
    assert 0 < kept < 1  # fine-tuning moved some neighbours, not all
    assert report["baseline"]["extra"]["other"][KEPT] != kept


def test_wise_ft_curve_counts_the_neighbours_each_mix_keeps_from_the_start(images, tmp_path):
    report = train(config(images, tmp_path / "run", wise_alpha="auto", val_fraction=0.34, plots=True),
                   progress=False)
    curve = report["wise"]["curve"]
    assert curve[0]["alpha"] == 0 and curve[0]["kept"] == 1.0 and curve[0]["extra_kept"] == {"other": 1.0}
    assert all(0 <= p["kept"] <= 1 and p["extra_kept"]["other"] == p["kept"] for p in curve)
    assert curve[-1]["kept"] < 1  # the fine-tuned end moved neighbours
    assert "_rows" not in json.dumps(report["wise"])  # the embeddings stay out of the report
    from retrieval.serve.report_files import load_report
    from retrieval.serve.report_summary import summary_markdown

    assert "top-10 neighbours kept from the pretrained backbone's: " in summary_markdown(load_report(
        tmp_path / "run" / "report.json"))


def test_eval_extra_names_what_it_accepts(tmp_path):
    with pytest.raises(ValueError, match="no such folder and no registered data set 'nope'"):
        load_extra_set("nope", None)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.png").write_bytes(noisy_png((1, 2, 3), 0))
    with pytest.raises(ValueError, match="at least 2 classes with 4 or more images"):
        load_extra_set(str(tmp_path), None)


@pytest.mark.parametrize("overrides, message", [
    (dict(lp_epochs=3), "--lp-epochs must be >= 0 and below --epochs"),
    (dict(l2sp=-1), "--l2sp must be >= 0"),
    (dict(layer_decay=0), r"--layer-decay must be in \(0, 1\]"),
    (dict(ema=1.0), r"--ema must be in \[0, 1\)"),
    (dict(wise_alpha=1.5), "--wise-alpha must be a number in"),
    (dict(wise_alpha="sometimes"), "--wise-alpha must be a number in"),
    (dict(wise_alpha="auto", eval_extra=[], val_fraction=0), "--wise-alpha auto chooses on validation data"),
    (dict(freeze_backbone=True, l2sp=0.1), "--l2sp act.* leave out --freeze-backbone"),
])
def test_bad_options_are_refused_with_the_fix(images, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        config(images, tmp_path / "run", **overrides)


def test_choose_alpha_keeps_out_of_domain_within_the_tolerance():
    def curve(ins, outs):
        return [{"alpha": a, "in_domain": i, "out_of_domain": o} for a, i, o in zip(WISE_ALPHAS, ins, outs,
                                                                                    strict=True)]

    # in-domain rises with alpha, out-of-domain falls: the largest alpha still within 0.02 of alpha 0
    assert choose_alpha(curve([.1, .2, .3, .4, .5], [.60, .61, .59, .57, .50]), 0.02) == 0.5
    assert choose_alpha(curve([.1, .2, .3, .4, .5], [.60, .61, .575, .57, .50]), 0.02) == 0.25
    assert choose_alpha(curve([.1, .2, .3, .4, .5], [.60, .50, .50, .50, .50]), 0.02) == 0.0
    # without out-of-domain data: the best in-domain, the smaller alpha on a tie
    assert choose_alpha([{**p, "out_of_domain": None} for p in curve([.1, .3, .3, .2, .1], [0] * 5)], 0.02) == 0.25
