"""`retrieval demo`: each step runs once, is skipped when its output is up to date, and redone when not.

The heavy steps (rendering, training, export, indexing) are replaced by fakes that write the same files; the
real steps have their own tests.
"""

from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path

import pytest
import torch

import retrieval.cli.demo as demo
from retrieval.compatibility import KEPT
from retrieval.train.config import TrainConfig


class FakeSteps:
    def __init__(self, monkeypatch) -> None:
        self.calls: list[str] = []
        self.config_hash = "config-1"
        self.model_hash = "model-1"
        monkeypatch.setattr("retrieval.data.emoji.prepare_emoji", self.prepare)
        monkeypatch.setattr("retrieval.train.train", self.train)
        monkeypatch.setattr("retrieval.export.export_checkpoint", self.export)
        monkeypatch.setattr("retrieval.index.build_index", self.build_index)
        monkeypatch.setattr("retrieval.onnx_runtime.OnnxEmbedder", self.embedder)
        monkeypatch.setattr(demo, "measure_readings", self.readings)
        monkeypatch.setattr("retrieval.train.text_tower.train_text_tower", self.train_text)
        monkeypatch.setattr("retrieval.text.text_onnx.TextEmbedder", self.text_embedder)
        monkeypatch.setattr("retrieval.text.text_index.record_text_model", self.record_text)
        self.recorded: list[Path] = []

    def prepare(self, out: Path) -> None:
        self.calls.append("prepare")
        out.mkdir(parents=True)
        (out / "manifest.csv").write_text("path,label,split,group,subgroup\n"
                                          "test/1F600/noto.png,1F600,test,Smileys & Emotion,face-smiling\n"
                                          "train/1F42D/noto.png,1F42D,train,Animals & Nature,animal-mammal\n")

    def train(self, cfg: TrainConfig) -> dict:
        self.calls.append("train")
        run = Path(cfg.out)
        run.mkdir(parents=True)
        torch.save({"config_hash": self.config_hash}, run / "best.pt")
        report = {"config": {"train": cfg.to_dict()}, "baseline": {"recall@1": 0.1}, "last": {"recall@1": 0.2}}
        (run / "report.json").write_text(json.dumps(report))
        return report

    def readings(self, checkpoint, recipe, data_dir):
        self.calls.append("readings")
        metrics = {"subgroup recall@1": 0.5, "subgroup map@r": 0.2, "subgroup r_precision": 0.3,
                   "twin recall@1": 0.1, f"{demo.OUT_OF_DOMAIN} recall@1": 0.7}
        return {"labels": demo.reading_labels(), "pretrained": metrics, "delivered": metrics}

    def export(self, checkpoint, out, log=None):
        self.calls.append("export")
        Path(out).write_bytes(b"onnx")
        return type("Result", (), {"file_bytes": 4, "exporter": "fake", "opset": 0})()

    def embedder(self, path):
        return type("Embedder", (), {"config_hash": self.config_hash, "model_hash": self.model_hash})()

    def train_text(self, config, export, log_line=print):
        self.calls.append("text")
        assert set(config.caption_column) == {"name", "subgroup_text"} and Path(config.images).is_file()
        out = Path(config.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "text.onnx").write_text(json.dumps({"image_model_hash": self.model_hash}))
        report = {"held_out": {"recall@10": 0.3}}
        (out / "report.json").write_text(json.dumps(report))
        return report

    def text_embedder(self, path):
        return type("Text", (), json.loads(Path(path).read_text()))()

    def record_text(self, index_dir, text_path):
        self.recorded.append(Path(text_path))

    def build_index(self, manifest, out, model, split):
        self.calls.append("index")
        assert split == "test" and Path(manifest).name == demo.GALLERY_CSV
        Path(out).mkdir(parents=True)
        (Path(out) / "index.json").write_text(json.dumps({"model_hash": self.model_hash}))
        return {"indexed": 0, "index_key": "Flat", "duplicates": 0, "errors": 0, "seconds": 0.0}


@pytest.fixture
def steps(monkeypatch) -> FakeSteps:
    return FakeSteps(monkeypatch)


def test_each_step_runs_once_then_is_skipped(tmp_path, steps):
    report = demo.run_demo(tmp_path)
    assert steps.calls == ["prepare", "train", "readings", "export", "index", "text"]
    assert steps.recorded == [tmp_path / "text" / "text.onnx"]  # the index searches by text
    assert report["last"]["recall@1"] == 0.2
    saved = json.loads((tmp_path / "run" / "report.json").read_text())["config"]["train"]
    assert saved["dataset"] == "emoji" and saved["backbone"] == "efficientnet_lite0" and saved["pretrained"]
    assert saved["data"] == str(tmp_path / "data" / "emoji")

    steps.calls.clear()
    demo.run_demo(tmp_path)
    assert steps.calls == ["readings"]  # measure_readings keeps its own file while the checkpoint is unchanged


def test_a_changed_recipe_retrains_and_reexports_but_keeps_data(tmp_path, steps):
    demo.run_demo(tmp_path)
    steps.calls.clear()
    time.sleep(0.01)
    steps.config_hash, steps.model_hash = "config-2", "model-2"
    demo.run_demo(tmp_path, epochs=1)
    assert steps.calls == ["train", "readings", "export", "index", "text"]  # a new model: its own text tower
    assert json.loads((tmp_path / "run" / "report.json").read_text())["config"]["train"]["epochs"] == 1


def test_a_stale_onnx_file_is_exported_again(tmp_path, steps):
    demo.run_demo(tmp_path)
    steps.calls.clear()
    onnx_path = tmp_path / "model.onnx"
    best = tmp_path / "run" / "best.pt"
    os.utime(onnx_path, (best.stat().st_atime - 60, best.stat().st_mtime - 60))  # older than the checkpoint
    demo.run_demo(tmp_path)
    assert steps.calls == ["readings", "export"]  # same model hash: the index stays


def test_demo_recipe_is_a_valid_training_config():
    cfg = TrainConfig(**demo.DEMO_RECIPE)
    assert cfg.dataset_kwargs == {"reading": "subgroup"}  # a smiling face finds smiling faces
    assert cfg.classes_per_batch >= 2


def test_demo_recipe_keeps_the_backbone_and_reports_photos_out_of_its_domain():
    cfg = TrainConfig(**demo.DEMO_RECIPE)
    assert cfg.eval_extra == [demo.OUT_OF_DOMAIN]  # shipped offline (Debian dataset-fashion-mnist)
    assert cfg.freeze_backbone and cfg.val_fraction > 0  # best.pt chosen on held-out train subgroups


def test_the_gallery_holds_the_test_subgroups_labelled_by_subgroup(tmp_path):
    from retrieval.data.emoji_groups import split_subgroups

    rows = [("train/1F600/noto.png", "1F600", "train", "Smileys & Emotion", "face-smiling"),
            ("test/1F601/noto.png", "1F601", "test", "Smileys & Emotion", "face-smiling"),
            ("test/1F970/noto.png", "1F970", "test", "Smileys & Emotion", "face-affection"),
            ("train/1F42D/noto.png", "1F42D", "train", "Animals & Nature", "animal-mammal"),
            ("test/1F1E6/noto.png", "1F1E6", "test", "", "")]
    manifest = tmp_path / "manifest.csv"
    manifest.write_text("path,label,split,group,subgroup\n" + "".join(",".join(row) + "\n" for row in rows))
    test = set(split_subgroups((row[3], row[4]) for row in rows if row[4])["test"])
    with open(demo.gallery_manifest(manifest), newline="") as handle:
        written = list(csv.DictReader(handle))
    assert [(r["path"], r["label"], r["sequence"]) for r in written] == [
        (path, subgroup, sequence) for path, sequence, _, _, subgroup in rows if subgroup in test]
    assert all(r["split"] == "test" for r in written) and written  # every image of a test subgroup, any twin split


def test_reading_metrics_reads_the_test_subgroups_two_ways_and_the_photos(tmp_path):
    """On a small rendered tree: every key, each a share, and the twin reading measured on the same images."""
    from retrieval.data import load_dataset
    from retrieval.data.emoji import prepare_emoji
    from retrieval.models import create_pretrained_embedder

    prepare_emoji(tmp_path / "emoji", image_size=32, limit=120, progress=False)
    model = create_pretrained_embedder("efficientnet_lite0", 32, "pad")
    start = demo.photo_embeddings(model, photos_limit=40)
    metrics = demo.reading_metrics(model, tmp_path / "emoji", reference=start, photos=start)
    assert set(metrics) == set(demo.reading_labels())  # both photo sets, each with Recall@1 and neighbours kept
    assert all(0 <= value <= 1 for value in metrics.values())
    assert all(metrics[f"{name} {KEPT}"] == 1.0 for name in demo.PHOTO_SETS)  # the backbone keeps its own
    test = load_dataset("emoji", tmp_path / "emoji", "test", reading="subgroup")
    assert len({path.split("/")[-2] for path in map(str, test.samples)}) < len(test)  # twins among the images


def test_a_model_that_scrambles_the_photos_keeps_few_of_their_neighbours(tmp_path):
    """Neighbours kept is measured against the backbone's embeddings, not the model's own: a model whose photo
    embeddings are shuffled across images keeps about the chance share."""
    import numpy as np

    from retrieval.data.emoji import prepare_emoji
    from retrieval.models import create_pretrained_embedder

    prepare_emoji(tmp_path / "emoji", image_size=32, limit=60, progress=False)
    model = create_pretrained_embedder("efficientnet_lite0", 32, "pad")
    start = demo.photo_embeddings(model, photos_limit=200)
    scrambled = {name: type(e)(**{**vars(e), "embeddings": np.random.default_rng(0).permutation(e.embeddings)})
                 for name, e in start.items()}
    metrics = demo.reading_metrics(model, tmp_path / "emoji", reference=start, photos=scrambled)
    assert all(metrics[f"{name} {KEPT}"] < 0.3 for name in demo.PHOTO_SETS)


def test_step_three_prints_every_figure_the_readings_name(capsys):
    labels = demo.reading_labels()
    demo.show_evaluation({"labels": labels, "pretrained": dict.fromkeys(labels, 0.5),
                          "delivered": dict.fromkeys(labels, 0.75)}, Path("run/report.json"))
    out = capsys.readouterr().out
    assert all(f"{text}:" in out for text in labels.values()) and out.count("0.5000 -> 0.7500 (+0.2500)") == len(labels)
