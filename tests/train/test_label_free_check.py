"""The label-free check of a run without labels: its maths against a slow reference, the images it holds out, and a
run whose check cannot tell its trained model from the start delivers the start and says so."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from sample_images import noisy_png

import retrieval.models
from retrieval.cli.main import main
from retrieval.cli.train_summary import label_free_summary
from retrieval.compatibility import KEPT
from retrieval.data.sampler import ClassBalancedBatchSampler
from retrieval.models import load_checkpoint
from retrieval.train import TrainConfig, label_free_check, train
from retrieval.train.data import label_free_sample
from retrieval.train.distributed import DistContext
from retrieval.train.label_free_check import (
    CHECK_SHARE,
    MIN_CHECK_IMAGES,
    START_CHECKPOINT,
    compare_on_groups,
    held_out_positions,
    min_images,
)

COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30), (30, 200, 200), (200, 30, 200)]


def slow_scores(vectors: np.ndarray, labels: list) -> tuple[list[float], list[float]]:
    """AP@R and Recall@1 of every image whose label another image shares, by loops: the others ranked by cosine."""
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    aps, hits = [], []
    for i, label in enumerate(labels):
        others = [j for j in range(len(labels)) if j != i]
        relevant = sum(labels[j] == label for j in others)
        if not relevant:
            continue
        ranked = sorted(others, key=lambda j: (-float(unit[i] @ unit[j]), j))
        found, ap = 0, 0.0
        for rank, j in enumerate(ranked[:relevant], start=1):
            if labels[j] == label:
                found += 1
                ap += found / rank
        aps.append(ap / relevant)
        hits.append(float(labels[ranked[0]] == label))
    return aps, hits


def groups_of(rng: np.random.Generator, groups: int, per_group: int, spread: float, dim: int = 8) -> np.ndarray:
    centres = rng.normal(size=(groups, dim))
    return np.concatenate([c + spread * rng.normal(size=(per_group, dim)) for c in centres])


def test_the_checks_scores_are_the_slow_references_ap_at_r_and_recall_at_1():
    rng = np.random.default_rng(0)
    start, trained = rng.normal(size=(36, 5)), rng.normal(size=(36, 5))
    labels = [i % 5 if i % 7 else 100 + i for i in range(36)]  # some images alone in their group: distractors
    result = compare_on_groups(trained, start, labels)
    trained_ap, _ = slow_scores(trained, labels)
    start_ap, start_hits = slow_scores(start, labels)
    assert result["queries"] == len(trained_ap)
    assert result["trained_map@r"] == pytest.approx(np.mean(trained_ap))
    assert result["start_map@r"] == pytest.approx(np.mean(start_ap))
    assert result["gain"] == pytest.approx(np.mean(trained_ap) - np.mean(start_ap))
    assert result["recall@1_change"] == pytest.approx(np.mean(slow_scores(trained, labels)[1]) - np.mean(start_hits))
    low, high = result["interval"]
    assert low <= result["gain"] <= high


def test_a_model_that_tightens_the_groups_is_told_from_the_start():
    rng = np.random.default_rng(1)
    labels = [i // 10 for i in range(60)]
    start = groups_of(np.random.default_rng(2), 6, 10, spread=1.2)
    trained = start + 3 * np.repeat(rng.normal(size=(6, 8)), 10, axis=0)  # each group moved apart from the others
    result = compare_on_groups(trained, start, labels)
    assert result["told"] and result["gain"] > 0.1 and result["interval"][0] > 0


@pytest.mark.parametrize("moved", [0.0, 1e-4])
def test_a_model_no_better_than_its_start_is_not_told(moved):
    start = groups_of(np.random.default_rng(3), 6, 10, spread=1.2)
    trained = start + moved * np.random.default_rng(4).normal(size=start.shape)
    result = compare_on_groups(trained, start, [i // 10 for i in range(60)])
    assert not result["told"]
    assert abs(result["gain"]) < 0.01


def test_too_few_grouped_images_cannot_tell():
    start = np.random.default_rng(5).normal(size=(30, 4))
    labels = [i // 2 if i < 10 else 100 + i for i in range(30)]  # 10 queries, the others alone
    result = compare_on_groups(start * 2, start, labels)
    assert not result["told"] and "fewer than" in result["reason"]


def test_the_held_out_images_are_a_seeded_share_and_none_on_a_small_set():
    held = held_out_positions(1000, seed=3)
    assert len(held) == round(CHECK_SHARE * 1000) and len(set(held.tolist())) == len(held)
    assert np.array_equal(held, held_out_positions(1000, seed=3))
    assert not np.array_equal(held, held_out_positions(1000, seed=4))
    assert len(held_out_positions(round(MIN_CHECK_IMAGES / CHECK_SHARE) - 10, seed=0)) == 0


def test_the_sampler_never_draws_a_held_out_image():
    labels = np.array([0, 0, -1, 1, 1, -1, 2, 2, 3, 3])
    sampler = ClassBalancedBatchSampler(labels, 2, 2, seed=0, batches_per_epoch=20)
    drawn = {i for batch in sampler for i in batch}
    assert drawn == {0, 1, 3, 4, 6, 7, 8, 9}


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("check")
    for c, colour in enumerate(COLOURS):
        for i in range(4):
            (root / f"c{c}-{i}.png").write_bytes(noisy_png(colour, 10 * c + i))
    return root


def config(data, out, **overrides) -> TrainConfig:
    values = dict(dataset="folder", data=str(data), labels="none", pseudo_labels="mutual",
                  backbone="timm:test_resnet", pretrained=False, freeze_backbone=True, image_size=32,
                  embedding_dim=16, batch_size=8, per_class=2, epochs=2, lr=0.05, workers=0, device="cpu",
                  out=str(out), plots=False, tensorboard=False, feature_cache=str(out.parent / "cache"))
    values.update(overrides)
    return TrainConfig(**values)


def same_weights(first: dict, second: dict) -> bool:
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_a_run_whose_check_cannot_tell_delivers_the_start_and_says_so(photos, tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["train", "--dataset", "folder", "--data", str(photos), "--labels", "none",
                                      "--pseudo-labels", "mutual", "--backbone", "timm:test_resnet",
                                      "--no-pretrained", "--freeze-backbone",  # at the backbone's own 160 px
                                      "--embedding-dim", "16", "--batch-size", "8", "--per-class", "2",
                                      "--epochs", "2", "--lr", "0.05", "--workers", "0", "--device", "cpu",
                                      "--kept-floor", "0", "--no-plots", "--no-tensorboard", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["keep_pretrained"] is True
    assert "keep the pretrained export" in report["keep_pretrained_reason"]
    # 24 images: none to hold out, the exact threshold and the way out named
    assert f"24 images, fewer than the {min_images()}" in report["keep_pretrained_reason"]
    assert "--no-label-free-check" in report["keep_pretrained_reason"]
    best, start, last = (load_checkpoint(out / name) for name in ("best.pt", START_CHECKPOINT, "last.pt"))
    assert same_weights(best.state_dict, start.state_dict)  # the start, delivered
    assert not same_weights(best.state_dict, last.state_dict)  # not what trained
    assert report["best"]["epoch"] == 0 and report["label_free_check"]["trained"]["epoch"] == 2
    assert report["label_free_check"]["start_delivered"] is True
    command = "retrieval export --pretrained timm:test_resnet --resize crop --image-size 160 --out model.onnx"
    assert report["pretrained_export"] == {"command": command, "input_size": 160, "resize": "crop"}
    lines = result.output.strip().splitlines()
    assert lines[-1] == f"next: {command}   (keep the pretrained export)"
    summary = next(line for line in lines if line.startswith(f"trained {out} without labels"))
    assert "epoch 2 was the latest that keeps 0% (--kept-floor), and the label-free check rejected best.pt: " \
        "best.pt is the start" in summary
    assert lines[-2].startswith("keep the pretrained export") and lines[-2].endswith("; best.pt is the start")


def test_without_the_check_best_pt_is_the_trained_epoch(photos, tmp_path):
    report = train(config(photos, tmp_path / "run", label_free_check=False, kept_floor=0.0), progress=False)
    assert "keep_pretrained" not in report and report["best"]["epoch"] == 2
    assert not (tmp_path / "run" / START_CHECKPOINT).exists()


def test_the_check_holds_its_images_out_of_training_and_scores_them(tmp_path):
    data = tmp_path / "photos"
    data.mkdir()
    for c, colour in enumerate(COLOURS):
        for i in range(40):
            (data / f"c{c}-{i:02d}.png").write_bytes(noisy_png(colour, 100 * c + i))
    out = tmp_path / "run"
    report = train(config(data, out, lr=1e-9, epochs=1, kept_floor=0.0), progress=False)
    held = round(CHECK_SHARE * 240)
    assert report["history"][1]["pseudo_labels"]["images"] == 240 - held  # grouped and trained: the others only
    assert report["history"][0]["unlabelled_images"] == 240 - held  # the guard's figures: the others only
    check = report["label_free_check"]
    assert check["images"] == held and check["queries"] >= 20
    assert abs(check["gain"]) < 0.01 and report["keep_pretrained"] is True  # a model that did not move: the start
    assert same_weights(load_checkpoint(out / "best.pt").state_dict,
                        load_checkpoint(out / START_CHECKPOINT).state_dict)


def test_the_small_set_threshold_is_the_fewest_images_the_check_holds_enough_of(photos):
    slow = next(n for n in range(1000) if len(held_out_positions(n, seed=0)) >= MIN_CHECK_IMAGES)
    assert min_images() == slow


def test_the_label_free_sample_never_holds_a_checked_image():
    images = list(range(300))
    held = held_out_positions(300, seed=2)
    sample = label_free_sample(images, held, limit=100, seed=2)
    assert len(sample) == 100 and not set(sample.indices) & set(held.tolist())
    assert sample.indices == label_free_sample(images, held, limit=100, seed=2).indices
    everything = label_free_sample(images, held, limit=1000, seed=2)
    assert sorted(everything.indices) == sorted(set(range(300)) - set(held.tolist()))


def test_a_random_head_start_is_refused_without_labels(photos, tmp_path):
    with pytest.raises(ValueError, match="--head-start principal"):
        config(photos, tmp_path / "run", head_start="random")


def test_without_a_start_row_the_delivered_start_is_epoch_0(photos, tmp_path):
    report = train(config(photos, tmp_path / "run", eval_before=False, kept_floor=0.0), progress=False)
    assert report["keep_pretrained"] is True and report["best"] == {"epoch": 0}
    assert report["label_free_check"]["trained"]["epoch"] == 2


@pytest.mark.parametrize("swapped", [True, False])
def test_the_summary_says_best_pt_is_the_start_only_where_the_check_made_it_so(tmp_path, capsys, swapped):
    cfg = config(tmp_path, tmp_path / "run", kept_floor=0.0)
    check = {"start_delivered": swapped, "model": "best.pt", **({"trained": {"epoch": 2}} if swapped else {})}
    report = {"best": {"epoch": 0 if swapped else 2}, "keep_pretrained": True, "label_free_check": check,
              "keep_pretrained_reason": "keep the pretrained export: the start's weights (start.pt) are missing",
              "pretrained_export": {"command": "retrieval export --pretrained x"}}
    label_free_summary(cfg, report, {KEPT: 0.8}, "report.json", None)
    summary, reason, command = capsys.readouterr().out.strip().splitlines()
    assert ("best.pt is the start" in summary) is swapped and ("best.pt is the start" in reason) is swapped
    assert ("best.pt is epoch 2" in summary) is not swapped
    assert command == "next: retrieval export --pretrained x   (keep the pretrained export)"


def many_photos(root, per_colour: int = 40):
    root.mkdir()
    for c, colour in enumerate(COLOURS):
        for i in range(per_colour):
            (root / f"c{c}-{i:02d}.png").write_bytes(noisy_png(colour, 100 * c + i))
    return root


def test_the_check_judges_wise_pt_and_the_start_replaces_it(tmp_path, monkeypatch):
    loaded, load = [], retrieval.models.load_checkpoint

    def spy(path, *args, **kwargs):
        loaded.append(Path(path).name)
        return load(path, *args, **kwargs)

    monkeypatch.setattr(retrieval.models, "load_checkpoint", spy)
    monkeypatch.setattr(DistContext, "barrier", lambda self: loaded.append("barrier"))
    out = tmp_path / "run"
    report = train(config(many_photos(tmp_path / "photos"), out, freeze_backbone=False, wise_alpha=1.0, lr=1e-9,
                          epochs=1, kept_floor=0.0), progress=False)
    # the delivered model against the start, read once rank 0 has written them
    assert loaded[-3:] == ["barrier", "wise.pt", START_CHECKPOINT]
    assert report["keep_pretrained"] is True and report["label_free_check"]["model"] == "wise.pt"
    assert "wise" not in report["checkpoints"]  # export and upgrade read best.pt: the start
    monkeypatch.undo()
    start = load_checkpoint(out / START_CHECKPOINT).state_dict
    assert same_weights(load_checkpoint(out / "wise.pt").state_dict, start)
    assert same_weights(load_checkpoint(out / "best.pt").state_dict, start)


def test_a_check_that_tells_the_trained_model_apart_delivers_it(tmp_path, monkeypatch):
    compare = label_free_check.compare_on_groups
    monkeypatch.setattr(label_free_check, "compare_on_groups",
                        lambda *args, **kwargs: {**compare(*args, **kwargs), "told": True})
    out = tmp_path / "run"
    report = train(config(many_photos(tmp_path / "photos"), out, lr=0.05, epochs=1, kept_floor=0.0),
                   progress=False)
    assert report["keep_pretrained"] is False and report["best"]["epoch"] == 1
    assert report["keep_pretrained_reason"].startswith("the trained model is delivered")
    assert report["label_free_check"]["start_delivered"] is False and "trained" not in report["label_free_check"]
    assert not same_weights(load_checkpoint(out / "best.pt").state_dict,
                            load_checkpoint(out / START_CHECKPOINT).state_dict)
