"""What a loss would read back from the device: the statistics it keeps of its last batch (``last_stats``) and its
batch checks, and the host copies and constants that spare a read; a leaf that the losses, the hard-negative methods,
the device decoder and the trainer all import (the one module of ``retrieval.utils`` that imports torch).

On a GPU each value read back waits for every kernel queued before it, so the host cannot queue the rest of the
step meanwhile. So a loss never reads a statistic itself: a statistic is a 0-d tensor on the loss's device (or a
number the host already knows: a shape, a count it read anyway), and whoever wants the numbers reads them together
(``read_stats``). A batch check (``require``) reads its condition at once, unless the caller collects the checks
(``deferred_checks``) to read them with its own value: the trainer reads them with the step's finiteness check, its
one read a step, and raises the first failed check's error before the optimizer step.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

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


def read_numbers(tensors: Sequence[torch.Tensor]) -> list[float]:
    """0-d tensors as numbers, copied from each device in one transfer: as the widest of their dtypes there, at least
    float32 (exact for counts below 2**24; MPS has no float64), so a bool reads as 0.0 or 1.0."""
    by_device: dict[torch.device, list[int]] = {}
    for position, value in enumerate(tensors):
        by_device.setdefault(value.device, []).append(position)
    numbers: list[float] = [0.0] * len(tensors)
    for positions in by_device.values():
        dtype = functools.reduce(torch.promote_types, (tensors[i].dtype for i in positions), torch.float32)
        read = torch.stack([tensors[i].detach().reshape(()).to(dtype) for i in positions]).tolist()
        for i, number in zip(positions, read, strict=True):
            numbers[i] = number
    return numbers


def read_stats(stats: Mapping[str, Stat]) -> dict[str, float]:
    """The statistics as numbers: the tensors copied from each device in one transfer, the numbers as they are."""
    values = iter(read_numbers(stat_tensors(stats)))
    return {key: next(values) if isinstance(value, torch.Tensor) else float(value) for key, value in stats.items()}


# a check's error, or a function that makes it (called only when the check fails: it may read the device)
CheckError = Exception | Callable[[], Exception]
Check = tuple[torch.Tensor, CheckError]
# the batch checks collected by the innermost ``deferred_checks`` (None: checks read their condition at once)
_collected: contextvars.ContextVar[list[Check] | None] = contextvars.ContextVar("deferred_checks", default=None)


def require(holds: torch.Tensor, error: CheckError) -> None:
    """Raise ``error`` unless ``holds`` (a 0-d bool tensor) is true: at once, or, inside ``deferred_checks``, when its
    caller reads the collected conditions. A loss only defers a check whose failure leaves its value finite or NaN,
    never one whose failure the device itself would trap (an index out of range)."""
    collected = _collected.get()
    if collected is None:
        if not bool(holds):
            raise _made(error)
        return
    collected.append((holds.detach().reshape(()), error))


@contextmanager
def deferred_checks() -> Iterator[list[Check]]:
    """Within, ``require`` collects its (condition, error) pairs in the list it yields instead of reading them; the
    caller reads the conditions (with its own values, in one transfer) and raises ``failed_check``'s error."""
    collected: list[Check] = []
    token = _collected.set(collected)
    try:
        yield collected
    finally:
        _collected.reset(token)


def failed_check(checks: list[Check], held: list[bool]) -> Exception | None:
    """The error of the first check whose condition did not hold (``held``: the conditions as read), else None."""
    return next((_made(error) for (_, error), ok in zip(checks, held, strict=True) if not ok), None)


def read_checks(checks: list[Check], *also: torch.Tensor) -> tuple[list[float], Exception | None]:
    """Read ``also`` (the caller's own 0-d values) with the collected conditions, in one transfer per device:
    (``also`` as numbers, the first failed check's error or None)."""
    numbers = read_numbers([*also, *(holds for holds, _ in checks)])
    return numbers[:len(also)], failed_check(checks, [bool(held) for held in numbers[len(also):]])


# the caller's host copy of a tensor it sent to the device (``known_on_host``)
_on_host: contextvars.ContextVar[tuple[torch.Tensor, torch.Tensor] | None] = contextvars.ContextVar(
    "known_on_host", default=None)


@contextmanager
def known_on_host(tensor: torch.Tensor, host: torch.Tensor) -> Iterator[None]:
    """Within, ``on_host(tensor)`` is ``host``: the caller's host copy of ``tensor`` (the labels it sent to the
    device), so a loss that needs those values on the host does not wait for the device to copy them back. A ``host``
    that is not on the CPU is no copy: nothing is known then. Under ``torch.distributed``, use it on every rank or on
    none: what is known decides which collectives ``GlobalBatchObjective`` runs. Nobody may modify ``host``."""
    if host.shape != tensor.shape or host.dtype != tensor.dtype:
        raise ValueError(f"known_on_host: the host copy must have the tensor's shape {tuple(tensor.shape)} and dtype "
                         f"{tensor.dtype}, got {tuple(host.shape)} {host.dtype}")
    token = _on_host.set((tensor, host) if host.device.type == "cpu" else None)
    try:
        yield
    finally:
        _on_host.reset(token)


def known_host_copy(tensor: torch.Tensor) -> torch.Tensor | None:
    """The host copy ``known_on_host`` gave for this very tensor, else None."""
    known = _on_host.get()
    return known[1] if known is not None and known[0] is tensor else None


def on_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values on the host: the copy ``known_on_host`` gave for this very tensor, else copied back (on a
    GPU a wait for every kernel queued before)."""
    known = known_host_copy(tensor)
    return tensor.detach().cpu() if known is None else known


def device_constant(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A constant (nested tuples of numbers) as a tensor on ``device``, made once: ``torch.tensor(values,
    device=cuda)`` copies from pageable memory at every call, a wait for the GPU's queue. Never modify it. Under
    torch.compile it is a constant of the graph instead."""
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=dtype, device=device)
    return _cached_device_constant(values, dtype, torch.device(device))


@functools.lru_cache(maxsize=64)
def _cached_device_constant(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to ``device``; to a GPU from pinned memory, so the copy is queued and the host goes on
    (a copy from pageable memory would wait for the device's queue)."""
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def require_classes(labels: torch.Tensor, num_classes: int, owner: str) -> torch.Tensor:
    """``require`` every label in [0, ``num_classes``); returns the labels clamped into that range for the caller to
    index with. A deferred check is read after the loss has run, and an index outside the classes would trip the
    device's own check first (on a GPU a device-side assert, which ends the process's use of the GPU)."""
    if not labels.numel():
        return labels
    low, high = torch.aminmax(labels)

    def outside() -> ValueError:  # on failure only: the range is read then
        low, high = torch.stack(torch.aminmax(labels)).tolist()
        return ValueError(f"labels must lie in [0, {num_classes}) (the training classes), got [{low}, {high}]; build "
                          f"the {owner} with num_classes = the number of training classes")

    require((low >= 0) & (high < num_classes), outside)
    return labels.clamp(0, num_classes - 1)


def _made(error: CheckError) -> Exception:
    return error if isinstance(error, BaseException) else error()
