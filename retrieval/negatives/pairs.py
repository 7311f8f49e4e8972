"""Positive pairs and pair-of-pairs combinations, formed from labels (never from batch positions).

LoOp (Algorithm 1, section 3.4) and Symm (section 3.2) both work on a positive pair (i, j) and a pair (k, l)
of another class. In a P x N batch (N even) the members of each class are paired in order of appearance,
(m0, m1), (m2, m3), ..., giving B / 2 positive pairs; a class with an odd count leaves its last member
unpaired. Every unordered combination of two pairs of different classes is then one LoOp problem:
C = B (B - N) / 8 of them (section 3.4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from retrieval.negatives.kernels import pair_starts_numpy
from retrieval.utils.reads import to_device

NEGATIVE_PAIRS = ("consecutive", "all")  # the other-class pairs (k, l) a positive pair meets (``pair_grid``)


def check_negative_pairs(value: str) -> str:
    """``value`` when it names a reading of the other-class pairs (``NEGATIVE_PAIRS``), else a clear error."""
    if value not in NEGATIVE_PAIRS:
        raise ValueError(f"negative_pairs must be 'consecutive' (LoOp Algorithm 1's pairs) or 'all' (every same-class "
                         f"pair, LoOp section 3.3 read literally), got {value!r}")
    return value


@dataclass(frozen=True)
class PositivePairs:
    first: torch.Tensor  # [Pp] batch index of x_i
    second: torch.Tensor  # [Pp] batch index of x_j
    labels: torch.Tensor  # [Pp] class of the pair

    def __len__(self) -> int:
        return int(self.first.numel())

    def to(self, device: torch.device) -> PositivePairs:
        """The pairs on ``device`` (``to_device``: from the host without waiting for the device)."""
        return PositivePairs(*(to_device(index, device) for index in (self.first, self.second, self.labels)))


def positive_pairs(labels: torch.Tensor) -> PositivePairs:
    """Pair consecutive members of each class (vectorised: one stable sort, no loop over classes)."""
    if labels.dim() != 1:
        raise ValueError(f"labels must be a 1-D tensor of class indices, got shape {tuple(labels.shape)}")
    if labels.numel() == 0:
        empty = labels.new_zeros(0, dtype=torch.long)
        return PositivePairs(empty, empty, labels[:0])
    if labels.device.type == "cpu":  # the NumPy kernel: cheaper than torch's per-op dispatch at B ~ 32
        values = labels.numpy()
        order, pos = pair_starts_numpy(values)
        first, second = order[pos], order[pos + 1]
        return PositivePairs(*(torch.from_numpy(a) for a in (first, second, values[first])))
    order, pos = pair_starts_torch(labels)
    return PositivePairs(first=order[pos], second=order[pos + 1], labels=labels[order[pos]])


def pair_starts_torch(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(stable argsort of labels, sorted positions that open a pair: even rank in its class, next one same), on
    the labels' own device (no host round trip on a GPU; ``kernels.pair_starts_numpy`` is the CPU kernel)."""
    order = torch.argsort(labels, stable=True)
    sorted_labels = labels[order]
    same_as_next = sorted_labels[1:] == sorted_labels[:-1]
    starts = torch.ones_like(sorted_labels, dtype=torch.bool)
    starts[1:] = ~same_as_next
    index = torch.arange(labels.numel(), device=labels.device)
    class_start = torch.where(starts, index, 0).cummax(0).values
    opens = ((index - class_start) % 2 == 0)[:-1] & same_as_next
    return order, torch.nonzero(opens, as_tuple=True)[0]


def pair_combinations(pair_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, q) indices, p < q, of all combinations of two positive pairs from different classes."""
    n = pair_labels.numel()
    p, q = torch.triu_indices(n, n, offset=1, device=pair_labels.device)
    keep = torch.nonzero(pair_labels[p] != pair_labels[q], as_tuple=True)[0]  # one wait on a GPU, not one per index
    return p[keep], q[keep]


@dataclass(frozen=True)
class PairGrid:
    """The batch's pairs and pairs of pairs, formed from its labels on the host, so that every size in it is known
    without asking the device; ``to`` moves it without waiting."""

    pairs: PositivePairs  # the positive pairs p (rows)
    columns: PositivePairs | None  # the other-class pairs q when they are not the rows' pairs ("all")
    negative: torch.Tensor  # [Pp, Q] bool: pairs p and q are of different classes
    combinations: tuple[torch.Tensor, torch.Tensor]  # (p, q) of ``negative``'s entries, p < q without ``columns``

    def to(self, device: torch.device) -> PairGrid:
        """The grid on ``device``."""
        p, q = self.combinations
        return PairGrid(self.pairs.to(device), None if self.columns is None else self.columns.to(device),
                        to_device(self.negative, device), (to_device(p, device), to_device(q, device)))


def nonzero_2d(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.nonzero`` of a 2-D bool array (rows, columns; int64, row-major order) through its flat form: 2.5x
    faster on the 10^4-10^5 entries of a batch's grid, which NumPy's 2-D form walks one coordinate at a time."""
    flat = np.flatnonzero(mask)
    rows = flat // mask.shape[1]
    return rows, flat - rows * mask.shape[1]


def pair_grid(labels: np.ndarray, negative_pairs: str = "consecutive") -> PairGrid:
    """``PairGrid`` of labels [B] in NumPy: Algorithm 1's positive pairs (``positive_pairs``) against themselves
    ("consecutive", each combination once) or against every same-class pair k < l ("all"); the same pairs in the
    same order as ``positive_pairs`` and ``pair_combinations``."""
    check_negative_pairs(negative_pairs)
    order, pos = pair_starts_numpy(labels)
    first, second = order[pos], order[pos + 1]
    pair_labels = labels[first]
    pairs = PositivePairs(*(torch.from_numpy(a) for a in (first, second, pair_labels)))
    if negative_pairs == "all":
        k, l = nonzero_2d(np.triu(labels[:, None] == labels[None, :], k=1))  # noqa: E741
        column_labels = labels[k]
        columns = PositivePairs(*(torch.from_numpy(a) for a in (k, l, column_labels)))
        negative = pair_labels[:, None] != column_labels[None, :]
        p, q = nonzero_2d(negative)
    else:
        columns = None
        negative = pair_labels[:, None] != pair_labels[None, :]
        p, q = nonzero_2d(np.triu(negative, k=1))
    return PairGrid(pairs, columns, torch.from_numpy(negative), (torch.from_numpy(p), torch.from_numpy(q)))


def expected_combinations(batch_size: int, samples_per_class: int) -> int:
    """C = B (B - N) / 8 (section 3.4) for a P x N batch with N even."""
    return batch_size * (batch_size - samples_per_class) // 8
