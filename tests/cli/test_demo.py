"""`retrieval demo`: each step runs once, is skipped when its output is up to date, and redone when not.

The heavy steps (rendering, training, export, indexing) are replaced by fakes that write the same files; the
real steps have their own tests.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

import retrieval.cli.demo as demo
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

    def prepare(self, out: Path) -> None:
        self.calls.append("prepare")
        out.mkdir(parents=True)
        (out / "manifest.csv").write_text("path,label,split\n")

    def train(self, cfg: TrainConfig) -> dict:
        self.calls.append("train")
        run = Path(cfg.out)
        run.mkdir(parents=True)
        torch.save({"config_hash": self.config_hash}, run / "best.pt")
        report = {"config": {"train": cfg.to_dict()}, "baseline": {"recall@1": 0.1}, "last": {"recall@1": 0.2}}
        (run / "report.json").write_text(json.dumps(report))
        return report

    def export(self, checkpoint, out, log=None):
        self.calls.append("export")
        Path(out).write_bytes(b"onnx")
        return type("Result", (), {"file_bytes": 4, "exporter": "fake", "opset": 0})()

    def embedder(self, path):
        return type("Embedder", (), {"config_hash": self.config_hash, "model_hash": self.model_hash})()

    def build_index(self, manifest, out, model, split):
        self.calls.append("index")
        assert split == "test" and Path(manifest).name == "manifest.csv"
        Path(out).mkdir(parents=True)
        (Path(out) / "index.json").write_text(json.dumps({"model_hash": self.model_hash}))
        return {"indexed": 0, "index_key": "Flat", "duplicates": 0, "errors": 0, "seconds": 0.0}


@pytest.fixture
def steps(monkeypatch) -> FakeSteps:
    return FakeSteps(monkeypatch)


def test_each_step_runs_once_then_is_skipped(tmp_path, steps):
    report = demo.run_demo(tmp_path)
    assert steps.calls == ["prepare", "train", "export", "index"]
    assert report["last"]["recall@1"] == 0.2
    saved = json.loads((tmp_path / "run" / "report.json").read_text())["config"]["train"]
    assert saved["dataset"] == "emoji" and saved["backbone"] == "efficientnet_lite0" and saved["pretrained"]
    assert saved["data"] == str(tmp_path / "data" / "emoji")

    steps.calls.clear()
    demo.run_demo(tmp_path)
    assert steps.calls == []


def test_a_changed_recipe_retrains_and_reexports_but_keeps_data(tmp_path, steps):
    demo.run_demo(tmp_path)
    steps.calls.clear()
    time.sleep(0.01)
    steps.config_hash, steps.model_hash = "config-2", "model-2"
    demo.run_demo(tmp_path, epochs=1)
    assert steps.calls == ["train", "export", "index"]
    assert json.loads((tmp_path / "run" / "report.json").read_text())["config"]["train"]["epochs"] == 1


def test_a_stale_onnx_file_is_exported_again(tmp_path, steps):
    demo.run_demo(tmp_path)
    steps.calls.clear()
    onnx_path = tmp_path / "model.onnx"
    best = tmp_path / "run" / "best.pt"
    os.utime(onnx_path, (best.stat().st_atime - 60, best.stat().st_mtime - 60))  # older than the checkpoint
    demo.run_demo(tmp_path)
    assert steps.calls == ["export"]  # same model hash: the index stays


def test_demo_recipe_is_a_valid_training_config():
    cfg = TrainConfig(**demo.DEMO_RECIPE)
    assert cfg.per_class == 2  # emoji: exactly one image per artist and class
    assert cfg.classes_per_batch >= 2


def test_demo_recipe_reports_an_out_of_domain_set_and_delivers_wise_ft():
    cfg = TrainConfig(**demo.DEMO_RECIPE)
    assert cfg.eval_extra == ["fashion-mnist"]  # shipped offline (Debian dataset-fashion-mnist)
    assert cfg.wise_alpha == "auto" and cfg.val_fraction > 0  # alpha chosen on held-out train classes
