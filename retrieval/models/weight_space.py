"""Weight-space ensembling of a zero-shot/pretrained and a fine-tuned model (WiSE-FT).

Wortsman et al., "Robust fine-tuning of zero-shot models", CVPR 2022: the weight-space ensemble
theta_alpha = (1 - alpha) * theta_0 + alpha * theta_1, applied key by key to two state dicts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

__all__ = ["interpolate_weights"]


def _interpolable(t: torch.Tensor) -> bool:
    return torch.is_floating_point(t) or torch.is_complex(t)


def interpolate_weights(
    start: Mapping[str, torch.Tensor],
    finetuned: Mapping[str, torch.Tensor],
    alpha: float,
    keep_finetuned: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """WiSE-FT: (1 - alpha) * start + alpha * finetuned for every floating tensor of two state dicts.

    alpha = 0 gives exactly ``start``'s values, alpha = 1 exactly ``finetuned``'s (the form (1 - a) s + a f, not
    lerp, keeps both ends bitwise; a non-finite value on the side weighted 0 still yields NaN, as 0 * inf does).
    Non-floating tensors (BatchNorm's num_batches_tracked) and the keys for which ``keep_finetuned(key)`` is True
    (e.g. a randomly initialised head, whose start value means nothing) are copied from ``finetuned``; such kept
    keys may be missing from ``start`` or have another shape there. Every result is a new tensor with
    ``finetuned``'s device and dtype, in ``finetuned``'s key order.
    """
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0:  # also refuses NaN
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    keep = keep_finetuned or (lambda key: False)
    kept = {key for key in finetuned if keep(key)}
    only_start = sorted(set(start) - set(finetuned))
    only_finetuned = sorted(set(finetuned) - set(start) - kept)
    if only_start or only_finetuned:
        raise ValueError(
            f"state dicts have different keys: only in start {only_start}, only in finetuned {only_finetuned}"
        )
    bad_shapes = [
        f"{key}: {tuple(start[key].shape)} vs {tuple(f.shape)}"
        for key, f in finetuned.items()
        if key not in kept and start[key].shape != f.shape
    ]
    if bad_shapes:
        raise ValueError(f"state dicts have different shapes: {bad_shapes}")

    out: dict[str, torch.Tensor] = {}
    for key, f in finetuned.items():
        f = f.detach()
        if key in kept or not _interpolable(f):
            out[key] = f.clone()
            continue
        # Compute in at least float32 (bf16/fp16 weights would otherwise round twice), then store as finetuned's.
        dtype = torch.promote_types(f.dtype, torch.float32)
        s = start[key].detach().to(device=f.device, dtype=dtype)
        mixed = (1.0 - alpha) * s + alpha * f.to(dtype)
        # .to() returns its input unchanged when nothing converts: mixed is a fresh tensor either way.
        out[key] = mixed.to(f.dtype)
    return out
