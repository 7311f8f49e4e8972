"""The triplet diagram (Xuan et al., "Hard negative examples are hard, but useful", section 3, Fig. 1, 5-7).

Every anchor a gives one dot (S_ap, S_an) of cosine similarities: x = anchor-positive, y = anchor-negative.
The negative is the hardest one (max S_an over the other classes), as hard-negative mining selects it.
Which positive: the paper draws it at random from the batch for its training-time diagrams (Fig. 3-5,
where each class has 2 samples per batch, so the positive is the only other sample of the class), and
the *easiest* positive (most similar same-class sample) for its dataset-wide diagrams (Fig. 7). The
default here is "easiest" (deterministic, the Fig. 7 convention that fits whole datasets); "random"
(seeded) and "hardest" are available. With 2 samples per class the three coincide.

A triplet is hard when S_an > S_ap (above the diagonal). Anchors are processed in blocks, so memory is
O(block_size x N), never N x N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from retrieval.distances import l2_normalize

POSITIVE_CHOICES = ("easiest", "hardest", "random")


@dataclass
class TripletDiagram:
    """One row per anchor that has both a positive and a negative."""

    s_ap: np.ndarray  # [A] cosine similarity anchor-positive (x axis)
    s_an: np.ndarray  # [A] cosine similarity anchor-hardest-negative (y axis)
    anchors: np.ndarray  # [A] index of the anchor in the input
    positives: np.ndarray  # [A] index of the chosen positive
    negatives: np.ndarray  # [A] index of the hardest negative
    positive: str = "easiest"

    @property
    def hard(self) -> np.ndarray:
        """Boolean [A]: S_an > S_ap, the triplet is in the wrong order (red in the paper)."""
        return self.s_an > self.s_ap

    @property
    def hard_fraction(self) -> float:
        return float(self.hard.mean()) if len(self.s_ap) else 0.0

    def __len__(self) -> int:
        return len(self.s_ap)


def _as_tensor(x, dtype=None) -> torch.Tensor:
    return x.detach().cpu() if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x), dtype=dtype)


def triplet_diagram(
    embeddings: torch.Tensor | np.ndarray,
    labels: torch.Tensor | np.ndarray,
    positive: str = "easiest",
    block_size: int = 1024,
    seed: int = 0,
) -> TripletDiagram:
    """Per-anchor (S_ap, S_an) with the hardest negative and the chosen positive (see module docstring)."""
    if positive not in POSITIVE_CHOICES:
        raise ValueError(f"positive must be one of {POSITIVE_CHOICES}, got {positive!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    z = _as_tensor(embeddings).float()
    y = _as_tensor(labels, dtype=torch.long).long()
    if z.dim() != 2 or y.shape != z.shape[:1]:
        raise ValueError(
            f"expected embeddings [N, D] and labels [N], got {tuple(z.shape)} and {tuple(y.shape)}"
        )
    z = l2_normalize(z)
    generator = torch.Generator().manual_seed(seed)
    parts = [
        _block(z, y, start, min(start + block_size, len(z)), positive, generator)
        for start in range(0, len(z), block_size)
    ]
    if not parts:  # no embeddings at all: an empty diagram
        parts = [(torch.zeros(0), torch.zeros(0), *(torch.zeros(0, dtype=torch.long),) * 3)]
    s_ap, s_an, anchors, positives, negatives = (torch.cat(column) for column in zip(*parts, strict=True))
    return TripletDiagram(
        s_ap=s_ap.numpy().astype(np.float32),
        s_an=s_an.numpy().astype(np.float32),
        anchors=anchors.numpy().astype(np.int64),
        positives=positives.numpy().astype(np.int64),
        negatives=negatives.numpy().astype(np.int64),
        positive=positive,
    )


@torch.no_grad()
def _block(z, y, start, stop, positive, generator):
    """The diagram rows of anchors start..stop-1: a [b, N] similarity block, nothing larger."""
    sim = z[start:stop] @ z.T  # [b, N]
    same = y[start:stop].view(-1, 1) == y.view(1, -1)  # includes the anchor itself
    rows = torch.arange(stop - start)
    same_count = same.sum(1)
    valid = (same_count > 1) & (same_count < len(y))  # has a positive and a negative
    neg_sim, neg_idx = sim.masked_fill(same, -math.inf).max(1)  # hardest negative
    if positive == "random":  # uniform over the positives: argmax of i.i.d. uniform scores restricted to them
        scores = torch.rand(sim.shape, generator=generator).masked_fill_(~same, -1.0)
        scores[rows, rows + start] = -1.0
        pos_idx = scores.argmax(1)
        pos_sim = sim.gather(1, pos_idx.view(-1, 1)).squeeze(1)
    else:
        sign = 1.0 if positive == "easiest" else -1.0  # easiest = max similarity, hardest = min
        signed = (sign * sim).masked_fill_(~same, -math.inf)
        signed[rows, rows + start] = -math.inf  # the anchor is not its own positive
        pos_sim, pos_idx = signed.max(1)
        pos_sim = sign * pos_sim
    return pos_sim[valid], neg_sim[valid], (rows + start)[valid], pos_idx[valid], neg_idx[valid]
