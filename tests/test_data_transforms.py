"""Transforms: output shape/dtype/normalisation; eval is deterministic and equals preprocess_eval."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from retrieval.data import build_transforms, preprocess_eval

CONFIG = {"input_size": 32, "mean": (0.5, 0.4, 0.3), "std": (0.2, 0.25, 0.3)}


def test_eval_matches_a_manual_reference():
    image = Image.new("RGB", (40, 60), (255, 102, 0))
    out = preprocess_eval(image, CONFIG)
    assert out.shape == (3, 32, 32) and out.dtype == torch.float32
    expected = [(1.0 - 0.5) / 0.2, (0.4 - 0.4) / 0.25, (0.0 - 0.3) / 0.3]
    assert torch.allclose(out.mean(dim=(1, 2)), torch.tensor(expected), atol=1e-5)
    assert torch.equal(build_transforms(CONFIG, train=False)(image), out)


def test_eval_centre_crops_after_resize():
    array = np.zeros((40, 80, 3), np.uint8)
    array[:, 40:] = 255  # left half black, right half white
    out = preprocess_eval(
        Image.fromarray(array).convert("L"), {**CONFIG, "mean": (0, 0, 0), "std": (1, 1, 1)}
    )
    # Resize short side to 36 (72x36), centre crop 32: columns 20..51, the middle is the edge.
    assert out[:, :, :12].max() < 0.05 and out[:, :, 20:].min() > 0.95


def test_train_is_random_and_right_shape():
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (50, 70, 3), dtype=np.uint8))
    train = build_transforms(CONFIG, train=True)
    torch.manual_seed(0)
    a = train(image)
    b = train(image)
    assert a.shape == b.shape == (3, 32, 32) and not torch.equal(a, b)


def test_timm_style_size_and_errors():
    assert preprocess_eval(Image.new("RGB", (10, 10)), {**CONFIG, "input_size": (3, 16, 16)}).shape == (
        3,
        16,
        16,
    )
    with pytest.raises(ValueError, match="input_size"):
        build_transforms({**CONFIG, "input_size": None}, train=False)
    with pytest.raises(ValueError, match="mean"):
        build_transforms({"input_size": 8}, train=True)
