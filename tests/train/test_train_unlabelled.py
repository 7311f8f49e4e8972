"""Training without labels (--labels none): any folder or an index's gallery, each image its own class, pseudo-labels
refreshed each epoch, the guard that chooses best.pt without labels, and the label-free report.

A tiny random-init timm ResNet trains on coloured noise images: six colours, so that the images have groups to find.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from run_files import read_jsonl
from run_resume import Crash, assert_same_run, crash_after
from sample_images import noisy_png
from sklearn.metrics import adjusted_rand_score

from retrieval.compatibility import KEPT
from retrieval.data.unlabelled import load_labelled_sample
from retrieval.index.formats.gallery_images import load_unlabelled
from retrieval.models import load_checkpoint
from retrieval.models.embedder import EmbeddingHead
from retrieval.train import TrainConfig, train
from retrieval.train.trainer import Trainer

COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30), (30, 200, 200), (200, 30, 200)]


def write_images(root: Path, per_colour: int, nested: bool, seed: int = 0) -> list[int]:
    """``per_colour`` images of each colour, half at the top of ``root`` and half in sub-folders when ``nested``;
    returns each file's colour in sorted-path order."""
    colours = {}
    for c in range(len(COLOURS)):
        for i in range(per_colour):
            folder = root / f"deep/er{i % 2}" if nested and i % 2 else root
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"c{c}-{i}.png"
            path.write_bytes(noisy_png(COLOURS[c], 1000 * seed + 10 * c + i))
            colours[str(path)] = c
    return [colours[p] for p in sorted(colours)]


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("unlabelled")
    write_images(root, per_colour=5, nested=True)
    return root


@pytest.fixture(scope="module")
def labelled(tmp_path_factory) -> Path:
    """A labelled sample for --eval-data: a class folder per colour."""
    root = tmp_path_factory.mktemp("labelled")
    for c in range(4):
        write_images(root / f"colour{c}", per_colour=1, nested=False, seed=c + 1)
    return root


def config(data: Path | None, out: Path, **overrides) -> TrainConfig:
    values = dict(dataset="folder", data=None if data is None else str(data), labels="none",
                  pseudo_labels="instance", backbone="timm:test_resnet", pretrained=False, image_size=32,
                  embedding_dim=16, loss="ntxent", batch_size=8, per_class=2, epochs=2, optimizer="sgd", lr=0.05,
                  workers=0, device="cpu", out=str(out), plots=False)
    values.update(overrides)
    return TrainConfig(**values)


def test_any_folder_flat_or_nested_is_read_without_its_folder_names(photos):
    dataset = load_unlabelled(photos)
    assert len(dataset) == 30  # top level and sub-folders alike
    assert dataset.labels.tolist() == list(range(30))  # each image its own class, whatever folder holds it
    assert any("/" in name for name in dataset.class_names)  # named by their path under the folder


def test_a_folder_with_one_image_is_refused_with_the_layout(tmp_path):
    (tmp_path / "one.png").write_bytes(noisy_png(COLOURS[0], 1))
    with pytest.raises(ValueError, match="at least 2"):
        load_unlabelled(tmp_path)


@pytest.mark.parametrize(("overrides", "problem"), [
    (dict(val_fraction=0.2), "--val-fraction"),
    (dict(label_noise="symmetric:0.1"), "--label-noise"),
    (dict(aux_ce=0.5), "--aux-ce"),
    (dict(linear_probe=True), "--linear-probe"),
    (dict(freeze_backbone=True, pseudo_labels="instance"), "the views would be the same"),
    (dict(labels="given", pseudo_labels="mutual"), "add --labels none"),
])
def test_options_that_need_labels_are_refused_without_them(photos, tmp_path, overrides, problem):
    with pytest.raises(ValueError, match=problem):
        config(photos, tmp_path / "run", **overrides)


def test_a_proxy_loss_is_refused_before_training(photos, tmp_path):
    with pytest.raises(ValueError, match="proxy per class"):
        train(config(photos, tmp_path / "run", loss="proxy_anchor"), progress=False)


def test_instance_discrimination_trains_and_reports_label_free_figures(photos, tmp_path):
    out = tmp_path / "run"
    report = train(config(photos, out, plots=True), progress=False)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    assert all(0.0 <= r[KEPT] <= 1.0 and "recall@1" not in r for r in rows)  # nothing labelled to measure
    assert rows[1]["loss_positive_pairs"] > 0  # each image's two views made positive pairs
    section = report["label_free"]
    assert [r["epoch"] for r in section["kept"]] == [0, 1, 2]
    moved = section["moved_most"]
    assert moved and all(Path(m["image"]).is_file() and Path(m["image"]).is_relative_to(photos) for m in moved)
    assert [m["kept"] for m in moved] == sorted(m["kept"] for m in moved)  # the most moved first
    assert (out / section["picture"]).is_file() and report["plots"]["moved"] == section["picture"]
    assert report["selected_on"] == "kept"
    split = json.loads((out / "config.json").read_text())["class_split"]
    assert split["labels"] == "none" and "class_names" not in split["train"]


def test_the_start_keeps_the_backbones_neighbours_better_than_a_random_head(photos, tmp_path):
    started = read_jsonl(Path(train(config(photos, tmp_path / "pca", epochs=1), progress=False)["config"]["train"]
                              ["out"]) / "metrics.jsonl")[0][KEPT]
    features = np.random.default_rng(0).standard_normal((30, 64))
    head = EmbeddingHead(64, 16)
    random_kept = head.linear.weight.detach().numpy()  # kaiming-initialised: a random map
    assert started > 0.5 and random_kept.shape == (16, 64)
    # the principal head keeps the features' geometry where it has the room: an isometry of the centred rows
    low_rank = features[:, :8] @ np.random.default_rng(1).standard_normal((8, 64))
    head.start_at_principal_axes(low_rank)
    projected = head.linear(torch.from_numpy(low_rank).float()).detach().numpy()
    centred = low_rank - low_rank.mean(axis=0)
    distances = np.linalg.norm(centred[:, None] - centred[None], axis=-1)
    assert np.allclose(np.linalg.norm(projected[:, None] - projected[None], axis=-1), distances, atol=1e-3)
    rows = head.linear.weight.detach().numpy().astype(np.float64)
    assert np.allclose(rows @ rows.T, np.eye(16), atol=1e-5)  # orthonormal axes, completed beyond the rank


@pytest.mark.parametrize(("floor", "best_epoch"), [(0.0, 2), (1.01, 0)])
def test_the_guard_keeps_the_latest_epoch_that_keeps_the_floor(photos, tmp_path, floor, best_epoch):
    out = tmp_path / "run"
    if floor > 1:
        with pytest.raises(ValueError, match="kept-floor"):
            config(photos, out, kept_floor=floor)
        floor, best_epoch = 1.0, 0  # no trained epoch keeps every neighbour: best.pt is the start
    report = train(config(photos, out, kept_floor=floor), progress=False)
    assert load_checkpoint(out / "best.pt").epoch == best_epoch == report["best"]["epoch"]


def test_pseudo_labels_group_the_images_and_the_sampler_follows(tmp_path):
    data = tmp_path / "photos"
    colours = write_images(data, per_colour=6, nested=False)
    trainer = Trainer(config(data, tmp_path / "run", pseudo_labels="mutual", freeze_backbone=True, loss="ms",
                             batch_size=12, per_class=4), progress=False)
    trainer.setup()
    before = len(trainer.parts.sampler)
    figures = trainer.pseudo.refresh(0)["pseudo_labels"]
    labels = trainer.data.train_labels
    assert figures["images"] == 36 and figures["clusters"] >= 2
    assert adjusted_rand_score(colours, labels) > 0.5  # the groups follow the colours (never read)
    sampler = trainer.parts.sampler
    assert len(sampler) == before  # the schedule was made for the first epoch's length
    for batch in sampler:
        blocks = [labels[batch[i : i + 4]] for i in range(0, 12, 4)]
        assert all(len(set(block.tolist())) == 1 for block in blocks)  # each block one pseudo-class
    again = trainer.pseudo.refresh(1)["pseudo_labels"]
    assert again["stability"] == pytest.approx(1.0)  # the same weights group the same way
    trainer.parts.features.close()


def test_clusters_refreshed_each_epoch_are_in_the_history(tmp_path):
    data = tmp_path / "photos"
    write_images(data, per_colour=6, nested=False)
    out = tmp_path / "run"
    report = train(config(data, out, pseudo_labels="clusters", freeze_backbone=True, loss="ms", batch_size=12,
                          per_class=4, epochs=3, loss_kwargs={}), progress=False)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [("pseudo_labels" in r) for r in rows] == [False, True, True, True]
    assert "stability" not in rows[1]["pseudo_labels"] and "stability" in rows[2]["pseudo_labels"]
    assert [g["epoch"] for g in report["label_free"]["groups"]] == [1, 2, 3]


def test_a_labelled_sample_gives_the_usual_metrics_beside_the_label_free_ones(photos, labelled, tmp_path):
    out = tmp_path / "run"
    report = train(config(photos, out, eval_data=str(labelled), epochs=1), progress=False)
    assert len(load_labelled_sample(labelled)) == 24
    last = report["last"]
    assert 0.0 <= last["recall@1"] <= 1.0 and "map@r" in last and 0.0 <= last[KEPT] <= 1.0
    assert report["best"]["epoch"] in (0, 1)  # chosen by the guard, not on the labelled sample


@pytest.mark.parametrize(("pseudo_labels", "freeze_backbone"), [("instance", None), ("mutual", False),
                                                              ("mutual", None)],
                         ids=["instance", "mutual-fine-tuned", "mutual-cpu-default-head"])
def test_a_run_without_labels_resumes_as_one_uninterrupted_run(photos, tmp_path, monkeypatch, pseudo_labels,
                                                                freeze_backbone):
    # 2 classes a batch: the colours' groups are enough of them
    settings = dict(pseudo_labels=pseudo_labels, epochs=3, checkpoint_every=1, loss="ms", per_class=4,
                    freeze_backbone=freeze_backbone, feature_cache=str(tmp_path / "cache"))
    train(config(photos, tmp_path / "straight", **settings), progress=False)
    crash_after(monkeypatch, epoch=1, batch=1)  # inside the second epoch, after its labels were grouped
    with pytest.raises(Crash):
        train(config(photos, tmp_path / "killed", **settings), progress=False)
    monkeypatch.undo()
    train(config(photos, tmp_path / "killed", resume=True, **settings), progress=False)
    assert_same_run(tmp_path / "straight", tmp_path / "killed")


def test_wise_ft_auto_takes_the_largest_mix_that_keeps_the_floor(photos, tmp_path):
    out = tmp_path / "run"
    report = train(config(photos, out, wise_alpha="auto", kept_floor=0.0), progress=False)
    wise = report["wise"]
    assert [p["alpha"] for p in wise["curve"]] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert all(0.0 <= p["kept"] <= 1.0 for p in wise["curve"])
    assert wise["alpha"] == 1.0 and wise["chosen"] == "kept-floor"  # every mix keeps a floor of 0
    strict = train(config(photos, tmp_path / "strict", wise_alpha="auto", kept_floor=1.0), progress=False)
    assert strict["wise"]["alpha"] == 0.0  # no mix keeps every neighbour: the start
    assert load_checkpoint(out / "wise.pt").class_names == []  # each image was its own class: no names kept


def test_the_app_says_what_a_run_without_labels_kept_and_how_it_grouped(tmp_path):
    from retrieval.serve.report_files import load_report
    from retrieval.serve.report_plots import moved_plot, pseudo_labels_plot
    from retrieval.serve.report_summary import summary_markdown

    data = tmp_path / "photos"
    write_images(data, per_colour=6, nested=False)
    out = tmp_path / "run"
    train(config(data, out, pseudo_labels="mutual", freeze_backbone=True, loss="ms", batch_size=8, per_class=4,
                 plots=True), progress=False)
    report = load_report(out / "report.json")
    summary = summary_markdown(report)
    assert "**best.pt chosen without labels:**" in summary and "50%" in summary  # the default floor
    assert "**Without labels:** the images keep" in summary and "pseudo-labels (mutual)" in summary
    assert moved_plot(report) is not None  # the Evaluation tab's picture of the images that moved most
    assert pseudo_labels_plot(report) is not None  # and the groups' sizes and stability


def test_clusters_past_the_dense_bound_cluster_a_sample_and_join_the_rest(monkeypatch):
    import retrieval.train.pseudo_labelling as pseudo_labelling

    rng = np.random.default_rng(0)
    centres = rng.standard_normal((4, 16)) * 10
    points = np.concatenate([centre + rng.standard_normal((80, 16)) for centre in centres]).astype(np.float32)
    truth = np.repeat(np.arange(4), 80)
    whole = pseudo_labelling.clusters(points)
    import retrieval.pseudo_labels

    for module in (pseudo_labelling, retrieval.pseudo_labels):  # half of them: as a gallery past the bound
        monkeypatch.setattr(module, "MAX_CLUSTER_IMAGES", 160)
    sampled = pseudo_labelling.clusters(points)
    assert adjusted_rand_score(truth, whole) > 0.95
    assert adjusted_rand_score(truth, sampled) > 0.95  # the images left out of the sample joined their blob's cluster


def test_a_frozen_backbone_reads_the_sampled_images_from_the_cached_features(tmp_path):
    data = tmp_path / "photos"
    write_images(data, per_colour=6, nested=False)
    trainer = Trainer(config(data, tmp_path / "run", pseudo_labels="mutual", freeze_backbone=True, loss="ms",
                             batch_size=12, per_class=4, feature_cache=str(tmp_path / "cache")), progress=False)
    trainer.setup()
    evaluation, sample = trainer.evaluation, trainer.data.unlabelled_sample
    features = trainer.parts.features
    for cached, model in ((features.embed_train_subset(evaluation.eval_model, sample), evaluation.eval_model),
                          (evaluation.start_embeddings(), evaluation.eval_model.backbone)):
        direct = evaluation._embed(model, sample, "images")  # the images through the model, as fine-tuning does
        assert cached.indices.tolist() == direct.indices.tolist()
        assert np.allclose(cached.embeddings, direct.embeddings, atol=1e-4)
    features.close()


def test_transductive_evaluation_reads_the_train_splits_labels_not_the_hidden_ones(tmp_path):
    """--eval-split train with --freeze-backbone: the train features cached without labels are another cache entry
    than the evaluation split's, whose labels the metrics need."""
    report = train(config(None, tmp_path / "run", dataset="digits", eval_split="train", pseudo_labels="clusters",
                          freeze_backbone=True, loss="ms", batch_size=20, per_class=4, epochs=1,
                          batches_per_epoch=2, feature_cache=str(tmp_path / "cache")), progress=False)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [0, 1]
    assert all(r["recall@1"] > 0.5 and 0.0 <= r[KEPT] <= 1.0 for r in rows)  # five digit classes, not 900 singletons
    assert report["best"]["epoch"] in (0, 1)


# --- on a CPU: the default that finishes in minutes, and the estimate of a run that trains the backbone --------------
def test_on_a_cpu_a_run_without_labels_trains_a_head_on_cached_features_unless_told_otherwise(photos, tmp_path,
                                                                                               capsys):
    cfg = config(photos, tmp_path / "run", pseudo_labels="clusters", loss="ms", per_class=4,
                 feature_cache=str(tmp_path / "cache"))
    assert cfg.freeze_backbone is None  # left unset: the trainer chooses
    report = train(cfg, progress=True)
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("--labels none on a CPU: training a head on the frozen backbone's cached features")
    assert "--no-freeze-backbone fine-tunes the whole backbone" in first  # how to get the whole-backbone run
    assert cfg.freeze_backbone is True and report["config"]["train"]["freeze_backbone"] is True  # recorded
    assert [r["epoch"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2]  # and it completes


@pytest.mark.parametrize(("overrides", "device", "frozen", "said"), [
    (dict(freeze_backbone=False), "cpu", False, None),  # the user's choice wins
    (dict(freeze_backbone=True), "cuda", True, None),
    (dict(labels="given", pseudo_labels="clusters"), "cpu", False, None),  # labelled runs: unchanged
    ({}, "cuda", False, "--labels none on cuda: fine-tuning the whole backbone; --freeze-backbone"),
    (dict(pseudo_labels="instance"), "cpu", False, "as --pseudo-labels instance needs it"),  # two augmented views
    (dict(augment="light"), "cpu", False, "as --augment light needs it"),
    (dict(l2sp=0.1, wise_alpha=0.5), "cpu", False, "as --l2sp, --wise-alpha need it"),
])
def test_an_explicit_choice_or_an_option_that_trains_the_backbone_wins(photos, tmp_path, overrides, device, frozen,
                                                                       said):
    from retrieval.train.console import backbone_choice_line

    values = dict(pseudo_labels="clusters", loss="ms", per_class=4) | overrides
    cfg = config(photos, tmp_path / "run", **values)
    sentence = backbone_choice_line(cfg, device) if cfg.settle_freeze_backbone(device) else None
    assert cfg.freeze_backbone is frozen
    assert (sentence is None) if said is None else (said in sentence)
    if said and device == "cpu":
        assert "--freeze-backbone" in sentence and "the estimate follows the first step" in sentence


def test_a_resumed_run_keeps_the_choice_it_started_with(photos, tmp_path):
    cfg = config(photos, tmp_path / "run", pseudo_labels="clusters", loss="ms", per_class=4)
    assert cfg.settle_freeze_backbone("cuda", recorded=True) is False and cfg.freeze_backbone is True


def test_a_config_file_that_says_false_fine_tunes_the_whole_backbone(photos, tmp_path):
    file = tmp_path / "run.toml"
    file.write_text(f'dataset = "folder"\ndata = "{photos}"\nlabels = "none"\nfreeze_backbone = false\n')
    cfg = TrainConfig.from_sources(file)
    assert cfg.settle_freeze_backbone("cpu") is False and cfg.freeze_backbone is False


def test_the_estimate_says_the_whole_run_and_the_faster_choice():
    from retrieval.train.console import RunEstimate, estimate_line

    estimate = RunEstimate(epochs=4, steps=9, evaluations=4, images=286, image_s=0.05, eval_s=10.0, regroup_s=20.0,
                           step_s=60.0)
    assert estimate.line("--freeze-backbone") == (
        "estimate: about 38 min on this CPU (4 epochs x 9 steps x ~60 s, + 4 pseudo-labellings x ~20 s, + 4 "
        "evaluations x ~10 s); --freeze-backbone: about 24 s")  # 286 images x 0.05 s once, and one evaluation
    assert estimate_line(RunEstimate(epochs=1, steps=2, evaluations=1, images=10, step_s=1.0), "x") is None  # short


def test_a_cpu_run_that_trains_the_backbone_says_its_estimate_after_its_first_step(photos, tmp_path, capsys,
                                                                                  monkeypatch):
    import retrieval.train.console as console

    monkeypatch.setattr(console, "LONG_RUN_S", 0.0)  # any run is long
    steps = []
    real = Trainer._say_estimate
    monkeypatch.setattr(Trainer, "_say_estimate", lambda self, seconds: (steps.append(seconds), real(self, seconds)))
    train(config(photos, tmp_path / "run", epochs=2), progress=True)  # instance: the whole backbone
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith(("embed", "epoch"))]
    assert lines[0].startswith("--labels none on a CPU: fine-tuning the whole backbone, as --pseudo-labels instance")
    estimates = [line for line in lines if line.startswith("estimate:")]
    assert len(steps) == 1 and len(estimates) == 1  # once, after the first step
    assert re.fullmatch(r"estimate: about [\d.]+ (s|min|h) on this CPU \(2 epochs x \d+ steps x ~[\d.]+ s, \+ 2 "
                        r"evaluations x ~[\d.]+ s\); --freeze-backbone --pseudo-labels clusters: about [\d.]+ "
                        r"(s|min|h)", estimates[0]), estimates[0]


def test_a_short_run_says_no_estimate(photos, tmp_path, capsys):
    train(config(photos, tmp_path / "run", epochs=1, freeze_backbone=False), progress=True)
    err = capsys.readouterr().err
    assert "estimate:" not in err and "--labels none" not in err  # the user chose: nothing to explain


def test_an_epoch_whose_groups_cannot_fill_a_batch_names_the_batch_size_that_would(photos, tmp_path):
    from retrieval.train.pseudo_labelling import too_few_groups

    cfg = config(photos, tmp_path / "run", pseudo_labels="clusters", loss="ms", per_class=4, freeze_backbone=True)
    line = too_few_groups(cfg, {"clusters": 4, "singletons": 8}, needed=16, formed=12, previous=False, alone=True)
    assert "this epoch trains on each image's own views, one cached feature each (nothing to learn from)" in line
    assert line.endswith("; --batch-size 48 or less would take the groups")  # 12 classes x 4 views
