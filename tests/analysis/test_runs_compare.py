"""`retrieval runs compare`: the differing configuration, the final metrics and the curves of real runs."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from PIL import Image

from retrieval.cli.main import main
from retrieval.train import TrainConfig, train


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    base = dict(dataset="digits", dataset_kwargs={"protocol": "standard", "limit_per_class": 30},
                backbone="efficientnet_lite0", pretrained=True, image_size=32, freeze_backbone=True,
                embedding_dim=16, batch_size=20, per_class=4, batches_per_epoch=3, epochs=2, workers=0,
                device="cpu", feature_cache=str(root / "cache"), plots=False, tensorboard=False)
    reports = [train(TrainConfig(**base, loss="ms", lr=1e-3, out=str(root / "ms")), progress=False),
               train(TrainConfig(**base, loss="proxy_anchor", lr=3e-3, out=str(root / "pa")), progress=False)]
    return root, reports


def test_the_table_shows_what_differs_and_the_final_metrics(two_runs, tmp_path):
    root, reports = two_runs
    png = tmp_path / "curves.png"
    result = CliRunner().invoke(main, ["runs", "compare", str(root / "ms"), str(root / "pa"), "--out", str(png)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["run", "ms", "pa"]
    rows = {line.split()[0]: line.split()[1:] for line in lines if line and not line.startswith("-")}
    assert rows["loss"] == ["ms", "proxy_anchor"] and rows["lr"] == ["0.001", "0.003"]
    assert "batch_size" not in rows and "out" not in rows  # the same in both / says nothing about the method
    assert rows["recall@1"] == [f"{r['last']['recall@1']:.4f}" for r in reports]
    assert all(cell.endswith("%") for cell in rows["waiting"][-2:])  # "waiting for batches  1%  2%"
    assert f"learning curves: {png}" in result.output
    with Image.open(png) as image:
        assert image.width > 2 * image.height  # two panels side by side


def test_json_for_programs(two_runs, tmp_path):
    root, reports = two_runs
    result = CliRunner().invoke(main, ["runs", "compare", str(root / "ms"), str(root / "pa"), "--json",
                                       "--out", str(tmp_path / "c.png")])
    data = json.loads(result.output)
    assert data["config"]["train/loss"] == ["ms", "proxy_anchor"]
    assert data["metrics"]["pa"]["recall@1"] == pytest.approx(reports[1]["last"]["recall@1"])
    assert data["metrics"]["ms"]["train time s"] > 0 and data["plot"] == str(tmp_path / "c.png")
    history = reports[0]["history"]
    waited = sum(row["data_wait_s"] for row in history if "data_wait_s" in row)
    assert data["metrics"]["ms"]["waiting for batches"] == pytest.approx(waited / data["metrics"]["ms"]["train time s"])
    assert 0 <= data["metrics"]["ms"]["waiting for batches"] < 1


def test_a_folder_that_is_not_a_run_is_named(tmp_path):
    result = CliRunner().invoke(main, ["runs", "compare", str(tmp_path), "--out", str(tmp_path / "c.png")])
    assert result.exit_code != 0
    assert "not a run folder" in result.output and "Traceback" not in result.output
