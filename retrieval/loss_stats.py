"""The statistics a loss keeps of its last batch (``last_stats``), in a leaf module the losses and the hard-negative
methods both import.

A statistic is a 0-d tensor on the loss's device, or a number the host already knows (a shape, a count it read
anyway). The losses never read a statistic back themselves: on a GPU each read waits for every kernel queued before
it, so the host could not queue the rest of the step meanwhile. Whoever wants the numbers reads them together,
one transfer for all (``read_stats``); the trainer reads them with the step's loss, twice a second.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch

Stat = torch.Tensor | float


@torch.no_grad()
def share(count: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``count / total`` as a 0-d float32 tensor on their device, 0 when ``total`` is 0; nothing is read back."""
    return count.float() / total.clamp_min(1).float()


@torch.no_grad()
def active_fraction(losses: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Share of the kept terms with a nonzero loss (0 when nothing is kept)."""
    return share(((losses > 0) & kept).sum(), kept.sum())


def stat_tensors(stats: Mapping[str, Stat]) -> list[torch.Tensor]:
    """The statistics that are tensors, each 0-d and detached, in ``stats``' order."""
    return [value.detach().reshape(()) for value in stats.values() if isinstance(value, torch.Tensor)]


def read_stats(stats: Mapping[str, Stat]) -> dict[str, float]:
    """The statistics as numbers: the tensors copied from each device in one transfer, the numbers as they are."""
    tensors = stat_tensors(stats)
    by_device: dict[torch.device, list[int]] = {}
    for position, value in enumerate(tensors):
        by_device.setdefault(value.device, []).append(position)
    numbers: list[float] = [0.0] * len(tensors)
    for positions in by_device.values():
        # the widest of their dtypes, at least float32 (exact for counts below 2**24; MPS has no float64)
        dtype = functools.reduce(torch.promote_types, (tensors[i].dtype for i in positions), torch.float32)
        read = torch.stack([tensors[i].to(dtype) for i in positions]).tolist()
        for i, number in zip(positions, read, strict=True):
            numbers[i] = number
    values = iter(numbers)
    return {key: next(values) if isinstance(value, torch.Tensor) else float(value) for key, value in stats.items()}
