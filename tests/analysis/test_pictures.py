"""The pictures of an evaluation: the query grid (right and wrong marked) and the 2-D embedding map, in the
training report, in `retrieval evaluate`'s report and in the app's Evaluation tab."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from retrieval.analysis.pictures import (
    MAP_MAX_CLASSES,
    MAP_METADATA_KEY,
    grid_rows,
    map_method,
    map_sample,
    pick_queries,
    plot_embedding_map,
    plot_retrieval_grid,
)


def test_queries_are_half_right_half_wrong_where_both_exist():
    correct = np.array([True] * 10 + [False] * 10)
    rows = pick_queries(correct, 8)
    assert correct[rows].sum() == 4 and len(set(rows)) == 8
    few_wrong = np.array([True] * 10 + [False] * 2)
    rows = pick_queries(few_wrong, 8)
    assert (~few_wrong[rows]).sum() == 2 and len(rows) == 8  # topped up with right ones
    assert len(pick_queries(np.array([False] * 3), 8)) == 3


def test_grid_rows_are_the_nearest_neighbours_and_their_marks():
    rng = np.random.default_rng(0)
    x, labels = rng.normal(size=(30, 6)), rng.integers(0, 4, 30)
    rows, top1 = grid_rows(x, labels, k=3)
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    sims = unit @ unit.T
    np.fill_diagonal(sims, -np.inf)  # leave-one-out: never the query itself
    order = np.argsort(-sims, axis=1, kind="stable")
    for row, hits in rows:
        assert [h for h, _ in hits] == list(order[row, :3])
        assert [same for _, same in hits] == [labels[h] == labels[row] for h, _ in hits]
    assert top1 == pytest.approx(np.mean(labels[order[:, 0]] == labels))
    # a separate gallery: results come from it
    gallery, gallery_labels = rng.normal(size=(12, 6)), rng.integers(0, 4, 12)
    rows, _ = grid_rows(x, labels, gallery, gallery_labels, k=12)
    assert all(sorted(h for h, _ in hits) == list(range(12)) for _, hits in rows)


def test_the_grid_and_the_map_are_drawn(tmp_path):
    rng = np.random.default_rng(1)
    labels = np.repeat(np.arange(5), 6)
    x = np.eye(5)[labels] * 3 + rng.normal(size=(30, 5))
    colours = [(200, 0, 0), (0, 200, 0), (0, 0, 200), (200, 200, 0), (0, 200, 200)]

    def load(row):
        return Image.new("RGB", (20, 20), colours[labels[row]])

    grid = plot_retrieval_grid(x, labels, load, tmp_path / "grid.png", label_names=lambda c: f"class {c}")
    with Image.open(grid) as image:
        assert image.height > image.width  # 8 rows of 6 tiles
    drawn = plot_embedding_map(x, labels, tmp_path / "map.png", method="tsne")
    assert Image.open(drawn).size[0] > 300
    assert plot_embedding_map(x[:3], labels[:3], tmp_path / "none.png") is None  # too few points to map


def test_the_map_records_which_classes_it_draws_out_of_how_many(tmp_path):
    """A page showing the map says in words what it draws: the map records it in its PNG."""
    labels = np.repeat(np.arange(30), 3)
    x = np.random.default_rng(2).normal(size=(90, 4))
    with Image.open(plot_embedding_map(x, labels, tmp_path / "map.png", method="tsne", seed=3)) as image:
        facts = json.loads(image.text[MAP_METADATA_KEY])
    assert facts == {"classes_shown": MAP_MAX_CLASSES, "classes": 30, "images_shown": MAP_MAX_CLASSES * 3,
                     "images": 90, "method": "t-SNE", "seed": 3}


def test_the_map_is_bounded_in_classes_and_points():
    labels = np.repeat(np.arange(500), 8)
    rows = map_sample(labels, max_points=1000)
    assert len(np.unique(labels[rows])) == MAP_MAX_CLASSES and len(rows) == MAP_MAX_CLASSES * 8
    assert len(map_sample(np.zeros(5000, dtype=int), max_points=1000)) == 1000


def test_umap_asked_for_without_umap_learn_says_how_to_get_it():
    try:
        import umap  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="pip install umap-learn"):
            map_method("umap")
        assert map_method("auto") == "tsne"
    else:
        assert map_method("auto") == "umap"
    with pytest.raises(ValueError, match="auto, umap, tsne"):
        map_method("pca")


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    from retrieval.train import TrainConfig, train

    root = tmp_path_factory.mktemp("pictures")
    cfg = TrainConfig(dataset="digits", dataset_kwargs={"protocol": "standard", "limit_per_class": 30},
                      backbone="efficientnet_lite0", pretrained=True, image_size=32, freeze_backbone=True,
                      embedding_dim=16, loss="ms", batch_size=20, per_class=4, batches_per_epoch=3, epochs=1,
                      workers=0, device="cpu", out=str(root / "run"), feature_cache=str(root / "cache"),
                      tensorboard=False)
    return root / "run", train(cfg, progress=False)


def test_the_training_report_and_the_app_show_the_pictures(digits_run):
    from retrieval.serve.report_files import load_report
    from retrieval.serve.report_plots import embedding_map_plot, retrieval_plot

    run, report = digits_run
    assert report["plots"]["retrieval"] == "retrieval.png" and report["plots"]["embedding_map"] == "embedding_map.png"
    opened = load_report(run / "report.json")
    assert retrieval_plot(opened).size[1] > 600 and embedding_map_plot(opened).size[0] > 300


def test_evaluate_draws_them_next_to_its_report(digits_run, tmp_path):
    from retrieval.cli.main import main

    run, _ = digits_run
    out = tmp_path / "eval" / "report.json"
    result = CliRunner().invoke(main, ["evaluate", "--checkpoint", str(run / "last.pt"), "--workers", "0",
                                       "--device", "cpu", "--map", "tsne", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["plots"] == {"retrieval": "retrieval.png", "embedding_map": "embedding_map.png"}
    assert (out.parent / "retrieval.png").is_file() and (out.parent / "embedding_map.png").is_file()
    result = CliRunner().invoke(main, ["evaluate", "--checkpoint", str(run / "last.pt"), "--workers", "0",
                                       "--device", "cpu", "--no-pictures", "--out", str(tmp_path / "plain.json")])
    assert json.loads((tmp_path / "plain.json").read_text())["plots"] == {}
