"""The batched crop-resize-flip (two matrix products over zero-padded crops) gives each image what the antialiased
bilinear resize of that image alone gives, in any grouping."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torch.nn import functional as F

from retrieval.data import batched_resize
from retrieval.data.batched_resize import resize_crops, resize_weights

# (height, width): shrunk, enlarged, both at once, unchanged, extreme aspects, a few pixels
SHAPES = [(300, 400), (100, 150), (37, 500), (64, 64), (640, 48), (7, 9), (65, 63), (1, 1)]


def crops_and_flips(seed: int = 0) -> tuple[list[torch.Tensor], list[bool]]:
    g = torch.Generator().manual_seed(seed)
    crops = [torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8) for h, w in SHAPES]
    return crops, [i % 3 == 1 for i in range(len(crops))]


def reference(crop: torch.Tensor, flip: bool, size: int) -> torch.Tensor:
    """One image alone, in float64: what the per-image path and the CPU pipeline's resampling compute."""
    out = F.interpolate(crop[None].double(), size=(size, size), mode="bilinear", antialias=True,
                        align_corners=False)[0]
    return out.flip(-1) if flip else out


def loop_weights(length: int, size: int) -> np.ndarray:
    """PIL's and torch's antialiased bilinear weights written out: for each output pixel, the triangle filter widened
    by the scale when shrinking, over the window torch sums, normalised to 1."""
    scale = length / size
    support = max(scale, 1.0)
    weights = np.zeros((size, length))
    for o in range(size):
        centre = scale * (o + 0.5)
        low = max(int(centre - support + 0.5), 0)
        high = min(int(centre + support + 0.5), length)
        for j in range(low, high):
            weights[o, j] = max(0.0, 1.0 - abs((j - centre + 0.5) / support))
        weights[o] /= weights[o].sum()
    return weights


@pytest.mark.parametrize("size", [64, 224])
def test_each_resized_crop_equals_the_antialiased_resize_of_that_crop_alone(size):
    crops, flips = crops_and_flips()
    out = resize_crops(crops, flips, size)
    assert out.shape == (len(crops), 3, size, size) and out.dtype == torch.float32
    for row, (crop, flip) in enumerate(zip(crops, flips, strict=True)):
        assert (out[row].double() - reference(crop, flip, size)).abs().max() < 1e-3, SHAPES[row]


@pytest.mark.parametrize("length, size", [(300, 64), (64, 64), (7, 64), (65, 64), (1, 5), (1000, 3)])
def test_the_weights_are_the_filter_written_out(length, size):
    weights = resize_weights(torch.tensor([length, 3]), length + 4, size)
    assert weights.shape == (2, size, length + 4)
    np.testing.assert_allclose(weights[0, :, :length].numpy(), loop_weights(length, size), atol=1e-6)
    assert (weights[0, :, length:] == 0).all()  # nothing from the padding
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, size))


def test_the_resize_shows_what_pil_shows():
    """The CPU pipeline resizes with PIL: the same resampling up to PIL's 8-bit rounding."""
    crop = torch.randint(0, 256, (3, 180, 250), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    pil = Image.fromarray(crop.permute(1, 2, 0).numpy()).resize((64, 64), Image.BILINEAR)
    out = resize_crops([crop], [False], 64)[0].permute(1, 2, 0).numpy()
    assert np.abs(out - np.asarray(pil, dtype=np.float32)).max() <= 1.0


def test_groups_of_bounded_bytes_give_the_same_images(monkeypatch):
    crops, flips = crops_and_flips(1)
    whole = resize_crops(crops, flips, 32)
    calls = []
    real = batched_resize._resize_group

    def counting(group, *args):
        calls.append(len(group))
        return real(group, *args)

    monkeypatch.setattr(batched_resize, "_resize_group", counting)
    monkeypatch.setattr(batched_resize, "RESIZE_GROUP_BYTES", 3 * 300 * 400 * 4)  # the largest crop fits alone
    grouped = resize_crops(crops, flips, 32)
    assert len(calls) > 1 and sum(calls) == len(crops)
    torch.testing.assert_close(grouped, whole, rtol=0, atol=1e-4)
    calls.clear()
    monkeypatch.setattr(batched_resize, "RESIZE_GROUP_BYTES", 1)  # smaller than any crop: one crop a group
    torch.testing.assert_close(resize_crops(crops, flips, 32), whole, rtol=0, atol=1e-4)
    assert calls == [1] * len(crops)


def test_mismatched_or_empty_input_is_refused():
    crops, flips = crops_and_flips()
    with pytest.raises(ValueError, match="8 crops but 7 flips"):
        resize_crops(crops, flips[:-1], 32)
    with pytest.raises(ValueError, match="no crops"):
        resize_crops([], [], 32)
