"""Crop, resize and flip a batch of images of different sizes in a few kernels: the antialiased bilinear resize as two
matrix products.

``F.interpolate(mode="bilinear", antialias=True)`` (torch's and PIL's resampling) is separable and linear: each
output row is a weighted sum of input rows, each output column of input columns, with weights that depend only on
the input and output lengths. Written as matrices, the crop of image b resized to S x S is ``Wy[b] @ crop @ Wx[b].T``,
and a horizontal flip reverses the rows of ``Wx[b]``. Zero-padding the crops to the batch's largest makes it one
batched product for the whole batch, where ``F.interpolate`` needs a call (and 3 kernel launches from Python) per
image because every crop has its own size. Dense weights cost ~100x the arithmetic of the direct filter, which a GPU
does in about a millisecond for a batch of 128 photo-sized crops; on a CPU the per-image form is cheaper.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# padded crops resized in one product: bounds its float32 input (4 bytes a value) whatever the batch holds
RESIZE_GROUP_BYTES = 1 << 28


def resize_weights(lengths: torch.Tensor, padded: int, size: int) -> torch.Tensor:
    """float32 [B, size, padded]: row o of image b holds the weights of the antialiased bilinear resize of its first
    ``lengths[b]`` input pixels to ``size`` output pixels (the same window, triangle filter and normalisation as
    ``F.interpolate(..., mode="bilinear", antialias=True, align_corners=False)``), zero beyond ``lengths[b]``."""
    lengths = lengths.to(torch.float64)[:, None, None]  # [B, 1, 1]
    scale = lengths / size
    support = scale.clamp(min=1.0)  # the filter widens when shrinking; bilinear's radius is 1 when enlarging
    centre = scale * (torch.arange(size, dtype=torch.float64, device=lengths.device)[None, :, None] + 0.5)
    pixel = torch.arange(padded, dtype=torch.float64, device=lengths.device)[None, None, :]
    # the triangle is zero outside the window torch sums over; the padding must not count in the normalisation
    weights = (1.0 - ((pixel - centre + 0.5) / support).abs()).clamp(min=0.0) * (pixel < lengths)
    return (weights / weights.sum(-1, keepdim=True)).to(torch.float32)


def resize_crops(crops: Sequence[torch.Tensor], flips: Sequence[bool], size: int) -> torch.Tensor:
    """float32 [B, C, size, size]: each [C, h, w] crop (any dtype, one device) resized by antialiased bilinear
    interpolation, flipped left-right where ``flips`` says, in groups of at most ``RESIZE_GROUP_BYTES`` of padded
    input."""
    if len(crops) != len(flips):
        raise ValueError(f"resize_crops: {len(crops)} crops but {len(flips)} flips")
    if not crops:
        raise ValueError("resize_crops: no crops")
    out = torch.empty(len(crops), crops[0].shape[0], size, size, device=crops[0].device)
    start = 0
    while start < len(crops):
        end, height, width = start, 0, 0
        while end < len(crops):
            h, w = crops[end].shape[1:]
            if end > start and (end + 1 - start) * crops[0].shape[0] * max(height, h) * max(width, w) * 4 \
                    > RESIZE_GROUP_BYTES:
                break
            height, width, end = max(height, h), max(width, w), end + 1
        out[start:end] = _resize_group(crops[start:end], flips[start:end], size, height, width)
        start = end
    return out


def _resize_group(crops: Sequence[torch.Tensor], flips: Sequence[bool], size: int, height: int, width: int
                  ) -> torch.Tensor:
    device = crops[0].device
    padded = torch.zeros(len(crops), crops[0].shape[0], height, width, dtype=torch.float32, device=device)
    for row, crop in enumerate(crops):
        padded[row, :, :crop.shape[1], :crop.shape[2]] = crop
    heights = torch.tensor([crop.shape[1] for crop in crops], device=device)
    widths = torch.tensor([crop.shape[2] for crop in crops], device=device)
    rows = resize_weights(heights, height, size)  # [B, size, height]
    columns = resize_weights(widths, width, size)  # [B, size, width]
    flipped = torch.tensor(list(flips), dtype=torch.bool, device=device)
    columns = torch.where(flipped[:, None, None], columns.flip(1), columns)
    return rows[:, None] @ padded @ columns[:, None].transpose(-1, -2)
