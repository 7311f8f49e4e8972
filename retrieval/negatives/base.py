"""What a hard-negative method hands a loss: ``PairTerms``, and the base class of the methods.

A hard-negative method (LoOp, Symm; in the spirit of a pytorch-metric-learning miner) has one job: for the
batch's positive pairs (i, j), formed from labels, it returns the Gram matrix the positive terms are read from,
the hardest negative of every pair p against every pair q of another class (real or synthetic), the mask of
those pairs of pairs and its statistics. A loss with a pair-level form (``PairLoss.from_pair_terms``) turns
them into a value; ``retrieval.losses.build(name, negatives=method)`` composes the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from retrieval.distances import label_masks, unit_distance
from retrieval.negatives.pairs import PairGrid, PositivePairs, check_negative_pairs, pair_grid
from retrieval.utils.reads import Stat, on_host, to_device

Tensor = torch.Tensor
NEGATIVE_PAIRS_READING = (  # what a loss with a min over those pairs prints for ``retrieval losses``
    "with LoOp, the other-class pairs (k, l) of the min: 'consecutive' = Algorithm 1's pairs (the C = B (B - N) / 8 "
    "problems of loop section 3.4, default) or 'all' = every same-class pair (the equation read literally)"
)


@dataclass(frozen=True)
class PairTerms:
    """Positive and hardest-negative terms of a batch's positive pairs p = (first[p], second[p])."""

    pairs: PositivePairs
    labels: Tensor  # [B] the batch's labels, on the embeddings' device
    gram: Tensor  # [B, B] inner products of the embeddings the method worked on (unit or raw)
    negative: Tensor  # [Pp, Q] bool: pairs p and q are of different classes (the terms a loss may use)
    hardest: Tensor | None  # [Pp, Q] hardest negative of pair p against pair q; None: one class, no negative
    hardest_is_distance: bool  # True: ``hardest`` holds distances of unit vectors, False: inner products
    stats: dict[str, Stat]  # ``retrieval.utils.reads``: 0-d tensors on the device, or numbers

    def positive_similarity(self) -> Tensor:
        """[Pp] inner product of each positive pair, S_ij."""
        return self.gram[self.pairs.first, self.pairs.second]

    def negative_similarity(self) -> Tensor:
        """[Pp, Q] inner products of the hardest negatives (s = 1 - d^2 / 2 on the unit sphere when the method
        measures distances)."""
        return 1.0 - self.hardest.pow(2) / 2.0 if self.hardest_is_distance else self.hardest

    def negative_distance(self, squared: bool = False) -> Tensor:
        """[Pp, Q] Euclidean (or squared) distances of the hardest negatives; unit embeddings only."""
        if self.hardest_is_distance:
            return self.hardest.pow(2) if squared else self.hardest
        return unit_distance(self.hardest, squared)

    def nearest_negative(self, squared: bool = False) -> tuple[Tensor, Tensor]:
        """([Pp] distance of each pair's nearest negative over the pairs of other classes, [Pp] bool: it has one;
        the distance is inf where it has none)."""
        distance = self.negative_distance(squared)
        return torch.where(self.negative, distance, math.inf).amin(dim=1), self.negative.any(dim=1)

    def same_class(self) -> Tensor:
        """[B, B] bool: positives of the batch (same label, i != j)."""
        return self.class_masks()[0]

    def class_masks(self) -> tuple[Tensor, Tensor]:
        """([B, B] positives of the batch (same label, i != j), [B, B] its negatives (another label))."""
        return label_masks(self.labels)


class HardNegativeMethod:
    """Base of the hard-negative methods; a subclass implements ``gram`` and ``hardest``.

    ``unit_only``: the method is defined on the unit sphere only (it then works with the losses on cosine
    similarities). ``rows`` (``PairLoss.positive_rows``) names sums of a pair's points on the positive side
    (Symm's angular loss); ``None`` is the pair's points themselves, the only rows every method supports.
    """

    unit_only: bool = False
    supports_all_pairs: bool = False  # True: ``hardest`` accepts other-class pairs beyond Algorithm 1's (``columns``)
    supports_rows: bool = False  # True: ``hardest`` accepts rows other than None
    hardest_is_distance: bool = False  # what ``hardest`` returns: distances of unit vectors or inner products
    empty_stats: dict[str, float] = {}  # statistics of a batch with one class (no negative pair)

    @classmethod
    def works_with(cls, cosine_similarity: bool, rows: object | None) -> bool:
        """Whether a loss on cosine similarities (or raw inner products) with these positive-side rows can use it."""
        return (cosine_similarity or not cls.unit_only) and (rows is None or cls.supports_rows)

    def gram(self, embeddings: Tensor, unit: bool) -> Tensor:
        """[B, B] inner products of the embeddings (L2-normalised first when ``unit``)."""
        raise NotImplementedError

    def hardest(
        self, gram: Tensor, pairs: PositivePairs, negative: Tensor, rows: object | None, *,
        columns: PositivePairs | None = None, combinations: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, dict[str, Stat]]:
        """([Pp, Q] hardest negative of pair p against pair q, statistics); entries outside ``negative`` are
        ignored by the losses. The pairs q are ``columns`` when given (``supports_all_pairs``), else the positive
        pairs themselves. ``combinations``: the (p, q) entries of ``negative`` to solve, p < q without ``columns``
        (``PairGrid.combinations``, made on the host by ``pair_terms``), for a method that solves one problem per
        entry; a method that scores every entry at once ignores them."""
        raise NotImplementedError

    def pair_terms(
        self, embeddings: Tensor, labels: Tensor, unit: bool, rows: object | None = None,
        negative_pairs: str = "consecutive",
    ) -> PairTerms:
        """The batch's positive pairs and their hardest negatives, for ``PairLoss.from_pair_terms``.

        ``negative_pairs``: the other-class pairs (k, l) each positive pair meets: "consecutive", the batch's
        positive pairs as Algorithm 1 forms them (LoOp section 3.4 counts C = B (B - N) / 8 such problems),
        or "all", every same-class pair k < l (the min over c[i] != c[k] = c[l] of LoOp section 3.3 read
        literally; differs from "consecutive" with more than 2 samples per class)."""
        check_negative_pairs(negative_pairs)
        if negative_pairs == "all" and not self.supports_all_pairs:
            raise ValueError(f"{type(self).__name__} forms its negatives from Algorithm 1's pairs only; "
                             "use negative_pairs='consecutive'")
        if embeddings.dim() != 2:
            raise ValueError(f"embeddings must be [B, D], got shape {tuple(embeddings.shape)}")
        if labels.dim() != 1 or labels.numel() != embeddings.shape[0]:
            raise ValueError(
                f"labels must be [B] with B = {embeddings.shape[0]} (one per row), got {tuple(labels.shape)}"
            )
        grid = host_pair_grid(labels, negative_pairs, embeddings.device)
        labels = to_device(labels, embeddings.device)
        gram = self.gram(embeddings, unit)
        pairs, negative = grid.pairs, grid.negative
        if grid.combinations[0].numel() == 0:  # one class only (a shape: known on the host)
            return PairTerms(pairs, labels, gram, negative, None, self.hardest_is_distance, dict(self.empty_stats))
        hardest, stats = self.hardest(gram, pairs, negative, rows, columns=grid.columns, combinations=grid.combinations)
        return PairTerms(pairs, labels, gram, negative, hardest, self.hardest_is_distance, stats)


@torch.compiler.disable
def host_pair_grid(labels: Tensor, negative_pairs: str, device: torch.device) -> PairGrid:
    """The batch's ``PairGrid`` on ``device``, formed on the host, where every data-dependent size is known without
    the device: from the labels' host copy (the trainer's, ``known_on_host``, or host labels given), else after one
    wait to copy them back. Never traced by torch.compile: a compiled loss resumes after it with every size known
    instead of tracing the NumPy pairing into its graph."""
    grid = pair_grid(on_host(labels).numpy(), negative_pairs)
    if len(grid.pairs) == 0:
        raise ValueError(
            "LoOp/Symm losses need positive pairs, but every label appears once in the batch; sample 2 or more "
            "images per class into each batch (an even number: ClassBalancedBatchSampler samples_per_class)"
        )
    return grid.to(device)
