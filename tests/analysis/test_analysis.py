"""Triplet diagram (SCT paper, section 3), the weight plot (unified paper, Fig. 1) and `retrieval analyze`."""

from __future__ import annotations

import json
import math

import matplotlib.image
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from retrieval import losses
from retrieval.analysis.plots import plot_pair_weights, plot_triplet_diagram
from retrieval.analysis.triplet_diagram import triplet_diagram
from retrieval.cli.analyze import analyze_group, class_balanced_indices
from retrieval.losses.weights import pair_weights


def clustered(classes: int, per_class: int, dim: int = 8, spread: float = 1.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(classes).repeat_interleave(per_class)
    points = torch.randn(classes, dim, generator=g)[labels] + spread * torch.randn(
        len(labels), dim, generator=g
    )
    return points, labels


def diagram_reference(z: np.ndarray, y: np.ndarray, positive: str):
    """Per anchor, by explicit loops: cosine to the easiest/hardest positive and to the hardest negative."""
    rows = []
    for a in range(len(z)):
        cos = [
            float(np.dot(z[a], z[j]) / (np.linalg.norm(z[a]) * np.linalg.norm(z[j]))) for j in range(len(z))
        ]
        pos = [cos[j] for j in range(len(z)) if y[j] == y[a] and j != a]
        neg = [cos[j] for j in range(len(z)) if y[j] != y[a]]
        if pos and neg:
            rows.append((a, max(pos) if positive == "easiest" else min(pos), max(neg)))
    return rows


@pytest.mark.parametrize("positive", ["easiest", "hardest"])
@pytest.mark.parametrize("block_size", [3, 1024])
def test_triplet_diagram_matches_loop_reference(positive, block_size):
    z, y = clustered(5, 4, spread=0.8 if positive == "hardest" else 1.5)
    y = torch.cat([y, torch.tensor([9])])  # a class with one sample has no positive: no triplet
    z = torch.cat([z, torch.randn(1, 8)])
    diagram = triplet_diagram(z, y, positive=positive, block_size=block_size)
    expected = diagram_reference(z.double().numpy(), y.numpy(), positive)
    assert diagram.anchors.tolist() == [a for a, _, _ in expected]
    np.testing.assert_allclose(diagram.s_ap, [p for _, p, _ in expected], atol=1e-5)
    np.testing.assert_allclose(diagram.s_an, [n for _, _, n in expected], atol=1e-5)
    hard = sum(n > p for _, p, n in expected) / len(expected)
    assert diagram.hard_fraction == pytest.approx(hard)
    assert 0 < sum(n > p for _, p, n in expected) < len(expected)  # both kinds: the check above can fail


def test_triplet_diagram_indices_are_consistent_and_random_positive_is_a_positive():
    z, y = clustered(4, 5, spread=2.0, seed=1)
    zn = torch.nn.functional.normalize(z, dim=1)
    diagram = triplet_diagram(z.numpy(), y.numpy(), positive="random", seed=3)
    for a, p, n, s_ap, s_an in zip(
        diagram.anchors, diagram.positives, diagram.negatives, diagram.s_ap, diagram.s_an, strict=True
    ):
        assert y[a] == y[p] and a != p and y[a] != y[n]
        assert s_ap == pytest.approx(float(zn[a] @ zn[p]), abs=1e-5)
        assert s_an == pytest.approx(float(zn[a] @ zn[n]), abs=1e-5)
    again = triplet_diagram(z, y, positive="random", seed=3)
    np.testing.assert_array_equal(diagram.positives, again.positives)
    # over several seeds every positive of anchor 0 gets drawn (uniform choice, not always the same one)
    drawn = {int(triplet_diagram(z, y, positive="random", seed=s).positives[0]) for s in range(40)}
    assert drawn == {1, 2, 3, 4}


def test_triplet_diagram_degenerate_inputs():
    empty = triplet_diagram(torch.randn(4, 3), torch.zeros(4, dtype=torch.long))  # one class: no negatives
    assert len(empty) == 0 and empty.hard_fraction == 0.0
    assert len(triplet_diagram(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))) == 0
    with pytest.raises(ValueError, match="positive"):
        triplet_diagram(torch.randn(4, 3), torch.zeros(4), positive="semi-hard")
    with pytest.raises(ValueError, match="labels"):
        triplet_diagram(torch.randn(4, 3), torch.zeros(5))


def test_triplet_diagram_scales_to_ten_thousand_embeddings():
    z, y = clustered(400, 25, dim=8, spread=1.0, seed=2)  # 10,000 embeddings, blocks of 4096 x 10,000
    diagram = triplet_diagram(z, y, block_size=4096)
    assert len(diagram) == 10_000
    assert np.isfinite(diagram.s_ap).all() and np.isfinite(diagram.s_an).all()


def red_and_blue_pixels(path) -> tuple[int, int]:
    """Counts of clearly red and clearly blue pixels (dots are semi-transparent over white)."""
    r, g, b = np.moveaxis((matplotlib.image.imread(str(path))[..., :3] * 255).astype(int), -1, 0)
    return int(((r > g + 60) & (r > b + 60)).sum()), int(((b > r + 60) & (b > g + 20)).sum())


def test_plot_triplet_diagram_draws_hard_triplets_in_red(tmp_path):
    z, y = clustered(6, 4, spread=1.5)
    diagram = triplet_diagram(z, y)
    path = plot_triplet_diagram(diagram, tmp_path / "diagram.png", "test")
    red, blue = red_and_blue_pixels(path)
    assert red > 0 and blue > 0
    # all easy: no red dots (only the legend marker, a few pixels)
    easy = triplet_diagram(*clustered(6, 4, spread=0.05))
    assert easy.hard_fraction == 0.0
    red_easy, _ = red_and_blue_pixels(plot_triplet_diagram(easy, tmp_path / "easy.png"))
    assert red_easy < red / 2


def test_plot_pair_weights_writes_png_and_checks_shapes(tmp_path):
    z, y = clustered(4, 3)
    s, w = pair_weights(losses.build("binomial"), z, y)
    path = plot_pair_weights(s, w, y, tmp_path / "sub" / "weights.png", "binomial")
    image = matplotlib.image.imread(str(path))
    assert image.shape[0] > 100 and image.shape[1] > 100
    with pytest.raises(ValueError, match="labels"):
        plot_pair_weights(s, w, y[:-1], tmp_path / "bad.png")


def test_class_balanced_indices_takes_pairs_only():
    labels = np.array([0, 0, 0, 0, 0, 1, 2, 2, 3, 3, 3])
    chosen = class_balanced_indices(labels, per_class=3, max_samples=100, seed=0)
    counts = np.bincount(labels[chosen], minlength=4)
    assert counts.tolist() == [3, 0, 2, 3]  # class 1 has a single sample
    assert len(class_balanced_indices(labels, per_class=3, max_samples=5, seed=0)) <= 5


def test_cli_weights_and_triplets_on_a_random_batch(tmp_path):
    runner = CliRunner()
    out = tmp_path / "ms.png"
    result = runner.invoke(
        analyze_group,
        [
            "weights",
            "--loss",
            "ms",
            "--loss-kwargs",
            '{"alpha": 2.0}',
            "--classes",
            "6",
            "--per-class",
            "4",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["samples"] == 24 and 0 < report["nonzero_fraction"] <= 1 and out.is_file()

    result = runner.invoke(analyze_group, ["triplets", "--classes", "5", "--out", str(tmp_path / "t.png")])
    assert result.exit_code == 0, result.output
    assert 0 <= json.loads(result.output)["hard_fraction"] <= 1

    bad = runner.invoke(
        analyze_group, ["weights", "--loss", "ms", "--loss-kwargs", "{alpha", "--out", str(out)]
    )
    assert bad.exit_code != 0 and "--loss-kwargs" in bad.output
    not_pair = runner.invoke(analyze_group, ["weights", "--loss", "dcdl", "--out", str(tmp_path / "d.png")])
    assert not_pair.exit_code != 0 and "pair-based" in not_pair.output


def test_cli_weights_from_a_checkpoint(tmp_path):
    from retrieval.models import CHECKPOINT_FORMAT, create_embedder

    torch.manual_seed(0)
    model = create_embedder("resnet18", embedding_dim=16, pretrained=False)
    # small images keep the test fast; load_embedder restores it
    model.config = model.config.with_fields({"input_size": 32})
    ckpt = tmp_path / "tiny.pt"
    torch.save(
        {
            "format": CHECKPOINT_FORMAT,
            "model_config": model.config.to_json(),
            "state_dict": model.state_dict(),
            "train_config": {"dataset": "digits"},
            "epoch": 0,
            "metrics": {},
        },
        ckpt,
    )
    out = tmp_path / "weights.png"
    result = CliRunner().invoke(
        analyze_group,
        [
            "weights",
            "--loss",
            "contrastive",
            "--checkpoint",
            str(ckpt),
            "--max-samples",
            "12",
            "--per-class",
            "3",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["samples"] == 12 and out.is_file()
    assert math.isfinite(json.loads(result.output)["nonzero_fraction"])
