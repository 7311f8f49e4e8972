"""The shared base of the pair-based losses: similarity matrix -> loss, with label masks and batch checks.

A pair-based loss (unified paper, section 3) is a function H(S, y) of the similarity matrix S. Every loss here
computes ``S = similarity(embeddings)`` once and then ``from_similarity(S, labels)``; that split is what lets
``retrieval.losses.pair_weights`` differentiate the loss with respect to S (Theorem 3.1).

Two forms. The square one compares the batch with itself: S [B, B], positives exclude i == j. The rectangular one
(``query_gallery``) compares query rows (the anchors, Q [B, D]) with gallery rows (G [M, D]): S = Q G^T [B, M],
where ``self_index[i]`` names the gallery row that is query i itself (-1: none), which is never its own positive.
A loss whose equation sums over anchors, each reading only its own row of S, implements it once, ``from_pairs``
over an ``AnchorPairs`` (S and the [B, M] masks); the square form is the special case gallery = queries,
``self_index = arange(B)``. A loss whose terms read the rows of other samples too (lifted structure's pair-level
sums, HPHN's hardest pair, angular's x_j.x_k) has no such reading: ``rectangular = False`` and its
``square_only`` says why; it keeps the square form alone.

A loss that can take hard negatives (LoOp, Symm) also has a pair-level form, ``from_pair_terms``: the same
equation over the batch's positive pairs and, for each, the hardest negative of every pair of another class,
as a hard-negative method of ``retrieval.negatives`` computes them (``build(name, negatives=method)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from retrieval.distances import cosine_similarity_matrix, l2_normalize, label_masks, unit_distance
from retrieval.errors import ParameterError
from retrieval.negatives.base import PairTerms
from retrieval.utils.reads import Stat, require

PER_CLASS_HINT = "sample 2 or more images per class into each batch (ClassBalancedBatchSampler samples_per_class >= 2)"
# the most elements one [positive pairs, samples] tensor may hold (2**28 float32 = 1 GiB): checked before allocating
MAX_PAIR_ROW_ELEMENTS = 2**28


def check_pair_rows(pairs: int, samples: int, loss: str) -> None:
    """Refuse a batch whose [positive pairs, samples] terms would not fit (a cross-batch memory over few classes
    makes hundreds of positives per anchor), before anything that size is allocated."""
    if pairs * samples > MAX_PAIR_ROW_ELEMENTS:
        raise ValueError(
            f"{loss}: {pairs:,} positive pairs x {samples:,} samples = {pairs * samples:.2g} terms, more than the "
            f"{MAX_PAIR_ROW_ELEMENTS:.2g} it evaluates at once ({MAX_PAIR_ROW_ELEMENTS * 4 / 2**30:.3g} GiB of "
            "float32); use fewer samples per class, a smaller batch or a smaller cross-batch memory (its size), or a "
            "loss that works per anchor (ms, lifted, lifted_min, contrastive)")


@dataclass(frozen=True)
class AnchorPairs:
    """What a loss's equation reads: anchors (rows) against a gallery (columns)."""

    similarity: torch.Tensor  # [B, M] s_ij
    positive: torch.Tensor  # [B, M] bool: same label, not the anchor itself
    negative: torch.Tensor  # [B, M] bool: another label
    self_similarity: torch.Tensor  # [B] s_ii, which S lacks where an anchor is not in the gallery

    @classmethod
    def square(cls, similarity: torch.Tensor, labels: torch.Tensor) -> AnchorPairs:
        """The batch against itself: S [B, B], positives exclude i == j."""
        positive, negative = label_masks(labels)
        return cls(similarity, positive, negative, torch.diagonal(similarity))

    @classmethod
    def rectangular(cls, similarity: torch.Tensor, labels: torch.Tensor, gallery_labels: torch.Tensor,
                    self_index: torch.Tensor, self_similarity: torch.Tensor) -> AnchorPairs:
        """Queries against a gallery: S [B, M], positives exclude column ``self_index[i]`` of row i."""
        positive, negative = label_masks(labels, gallery_labels, self_index)
        return cls(similarity, positive, negative, self_similarity)


class PairLoss(nn.Module):
    """Base class: ``forward(embeddings, labels) = from_similarity(similarity(embeddings), labels)``.

    Subclasses implement ``from_pairs`` (one equation for the square and the rectangular form), or, for a loss
    with ``rectangular = False``, ``from_similarity``; they may override ``similarity`` (N-pair works on raw dot
    products) and ``check_batch`` (stricter batch requirements).
    """

    # True when S is the cosine similarity matrix, the variable of the weight view (pair_weights); False: raw
    # inner products (a hard-negative method then works on the unnormalised embeddings).
    cosine_similarity: bool = True
    # Whether the model feeding this loss L2-normalises its embeddings by default (``--normalize`` unset); ask
    # ``retrieval.losses.wants_normalized(name)``.
    normalized_embeddings: bool = True
    # Whether the loss has the query x gallery form (``query_gallery``): its equation sums over anchors, each
    # reading its own row of S only. False: ``square_only`` says which term reads other rows.
    rectangular: bool = True
    square_only: str = ""
    # Positive-side rows the pair-level form compares with the negatives (a ``symm.Combinations``); None: the
    # points of the positive pair themselves.
    positive_rows = None
    # The other-class pairs (k, l) a hard-negative method forms for each positive pair: "consecutive" (LoOp's
    # Algorithm 1) or "all" (every same-class pair; ``retrieval.negatives.pairs.NEGATIVE_PAIRS``).
    negative_pairs = "consecutive"
    # What ``retrieval losses`` prints: the paper equation the loss implements, and for each option where a paper
    # can be read two ways (or where we chose a value the paper does not give) what the choices mean.
    paper_equation: str = ""
    readings: dict[str, str] = {}

    def __init__(self) -> None:
        super().__init__()
        # the last batch's statistics: 0-d tensors on the device, read together (``retrieval.utils.reads``)
        self.last_stats: dict[str, Stat] = {}

    # --- the pieces -------------------------------------------------------------------------------------
    def similarity(self, embeddings: torch.Tensor, gallery: torch.Tensor | None = None) -> torch.Tensor:
        """S_ij = cosine similarity of row i with gallery row j (the batch's own rows without a gallery)."""
        return cosine_similarity_matrix(embeddings, gallery)

    def self_similarity(self, embeddings: torch.Tensor) -> torch.Tensor:
        """[B] s_ii of each row with itself: the diagonal of the square ``similarity``."""
        unit = l2_normalize(embeddings)
        return (unit * unit).sum(dim=1)

    @staticmethod
    def pairs(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positive, negative) boolean masks [B, B]; positives exclude i == j."""
        return label_masks(labels)

    def from_pairs(self, pairs: AnchorPairs) -> torch.Tensor:
        """The loss's equation over anchors (rows of ``pairs``) against the gallery (columns)."""
        raise NotImplementedError

    def from_similarity(self, similarity: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss of the batch against itself from its square similarity matrix [B, B]."""
        return self.from_pairs(AnchorPairs.square(similarity, labels))

    def from_pair_terms(self, terms: PairTerms) -> torch.Tensor:
        """The loss over positive pairs and their hardest negatives; only losses with a pair-level form have it."""
        raise NotImplementedError

    # --- batch checks -----------------------------------------------------------------------------------
    def check_batch(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        """Shape checks plus: the batch holds at least one positive pair (else nothing can be learnt). The one value a
        forward pass reads back from the device, besides the shapes that depend on the data; the trainer defers it
        to its own read (``retrieval.utils.reads.require``)."""
        self.check_shapes(embeddings, labels)
        positive, _ = label_masks(labels)
        require(positive.any(), self.no_positive_pair)

    def check_shapes(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        """[B, D] embeddings, [B] labels, B >= 2 (nothing is read from the device)."""
        if embeddings.dim() != 2:
            raise ValueError(f"embeddings must be [batch, dim], got shape {tuple(embeddings.shape)}")
        if labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
            raise ValueError(
                f"labels must be [batch] matching embeddings {tuple(embeddings.shape)}, "
                f"got {tuple(labels.shape)}"
            )
        if embeddings.shape[0] < 2:
            raise ValueError(f"{type(self).__name__} needs a batch of at least 2 samples; {PER_CLASS_HINT}")

    def no_positive_pair(self) -> ValueError:
        """The error for a batch in which every label appears once."""
        return ValueError(f"{type(self).__name__}: the batch has no positive pair (every label appears once); "
                          f"{PER_CLASS_HINT}")

    def check_query_gallery(self, queries: torch.Tensor, labels: torch.Tensor, blocks: list[torch.Tensor],
                            gallery_labels: torch.Tensor, self_index: torch.Tensor | None = None) -> None:
        """The loss has a rectangular form, and the shapes and ``self_index`` fit (None: no query is in the
        gallery); a query without a positive in the gallery is allowed (its terms are empty sums). Reads one value,
        the ``self_index`` check, which the trainer defers (``require``)."""
        if not self.rectangular:
            raise ParameterError("gallery", f"has no meaning for {type(self).__name__}: {self.square_only}; "
                                            "call it on one batch (loss(embeddings, labels))")
        for name, rows in (("queries", queries), *(("gallery", block) for block in blocks)):
            if rows.dim() != 2 or rows.shape[1] != queries.shape[1]:
                raise ParameterError(name, f"must be [rows, {queries.shape[-1]}] like the queries, got shape "
                                           f"{tuple(rows.shape)}")
        size = sum(len(block) for block in blocks)
        for name, count, row_labels in (("labels", len(queries), labels), ("gallery_labels", size, gallery_labels)):
            if count == 0 or row_labels.shape != (count,):
                raise ParameterError(name, f"must hold one label per row of {count} (at least 1), got shape "
                                           f"{tuple(row_labels.shape)}")
        if self_index is None:
            return
        if self_index.shape != labels.shape:
            raise ParameterError("self_index", f"must hold one gallery row (or -1) per query, got shape "
                                               f"{tuple(self_index.shape)} for {len(labels)} queries")
        present = self_index >= 0
        outside = (self_index < -1) | (self_index >= size)
        # clamped for this check alone: later self_index is only compared with column numbers, never indexes
        mislabelled = present & (gallery_labels[self_index.clamp(0, size - 1)] != labels)

        def refused() -> ParameterError:  # on failure only: which of the two is read then
            if bool(outside.any()):
                return ParameterError("self_index", f"must be -1 or a gallery row in [0, {size})")
            return ParameterError("self_index", "names a gallery row whose label differs from its query's")

        require(~(outside | mislabelled).any(), refused)

    # --- the two forms ----------------------------------------------------------------------------------
    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.check_batch(embeddings, labels)
        return self.from_similarity(self.similarity(embeddings), labels)

    def query_gallery(self, queries: torch.Tensor, labels: torch.Tensor,
                      gallery: torch.Tensor | Sequence[torch.Tensor], gallery_labels: torch.Tensor,
                      self_index: torch.Tensor | None = None) -> torch.Tensor:
        """The loss over the query rows as anchors against the gallery rows (S = Q G^T [B, M]); query i is
        gallery row ``self_index[i]`` (-1 or None: not in the gallery). ``query_gallery(x, y, x, y, arange(B))``
        is ``loss(x, y)`` up to float rounding.

        ``gallery`` may be a sequence of blocks of rows, in order (``gallery_labels`` covers them all): each block's
        similarities are computed apart, so a block without gradient (a memory) costs no backward.
        """
        blocks = [gallery] if isinstance(gallery, torch.Tensor) else list(gallery)
        self.check_query_gallery(queries, labels, blocks, gallery_labels, self_index)
        if self_index is None:
            self_index = torch.full_like(labels, -1)
        # one product per block: autograd would take a gradient for every row of one concatenated gallery
        similarity = torch.cat([self.similarity(queries, block) for block in blocks], dim=1)
        pairs = AnchorPairs.rectangular(similarity, labels, gallery_labels, self_index, self.self_similarity(queries))
        return self.from_pairs(pairs)


class DistancePairLoss(PairLoss):
    """A pair loss written on Euclidean distances of unit vectors: d^2 = 2 - 2 S (loop section 3.3)."""

    def __init__(self, squared: bool = False) -> None:
        super().__init__()
        self.squared = squared

    def distance(self, similarity: torch.Tensor) -> torch.Tensor:
        return unit_distance(similarity, self.squared)


def anchors_with_triplets(positive: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """[B] bool: anchors that have at least one positive and one negative (a valid triplet)."""
    return positive.any(dim=1) & negative.any(dim=1)


def mean_over(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask``; 0 connected to the graph when the mask is empty."""
    kept = torch.where(mask, values, torch.zeros_like(values))  # where, not *: 0 * inf would be NaN
    return kept.sum() / mask.sum().clamp_min(1).to(values.dtype)


def masked_max(x: torch.Tensor, mask: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """max over ``mask`` along ``dim``; 0 (no gradient) where the mask is empty."""
    filled = torch.where(mask, x, torch.full_like(x, torch.finfo(x.dtype).min))
    values = filled.amax(dim=dim)
    return torch.where(mask.any(dim=dim), values, torch.zeros_like(values))


def masked_min(x: torch.Tensor, mask: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """min over ``mask`` along ``dim``; 0 (no gradient) where the mask is empty."""
    return -masked_max(-x, mask, dim=dim)

