"""Similarity, distance and numerically safe reductions shared by every loss (one place for the eps)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = 1e-12


def l2_normalize(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return F.normalize(x, p=2, dim=dim, eps=EPS)


def cosine_similarity_matrix(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """S_ij = <x_i, y_j> / (|x_i| |y_j|), shape [n, m]."""
    x = l2_normalize(x)
    y = x if y is None else l2_normalize(y)
    return x @ y.T


def dot_similarity_matrix(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """S_ij = <x_i, y_j> without normalisation (N-pair works on raw features)."""
    return x @ (x if y is None else y).T


class _SymmetricGram(torch.autograd.Function):
    """x x^T with a one-matmul backward: dL/dx = (G + G^T) x (autograd's x @ x.T does G x + G^T x)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x @ x.T

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return (grad + grad.T) @ x


def gram_matrix(x: torch.Tensor) -> torch.Tensor:
    """S = x x^T [n, n], the same values as ``x @ x.T`` but a backward with one matmul instead of two
    (the batch x batch similarity matmuls dominate a loss's cost at D = 512)."""
    return _SymmetricGram.apply(x)


def squared_euclidean_matrix(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """|x_i - y_j|^2 >= 0, shape [n, m], via the Gram expansion."""
    y_ = x if y is None else y
    x2 = (x * x).sum(dim=1, keepdim=True)
    y2 = (y_ * y_).sum(dim=1, keepdim=True).T
    d2 = (x2 + y2 - 2.0 * (x @ y_.T)).clamp_min(0.0)
    if y is None:  # exact zeros on the diagonal, whatever the rounding
        d2 = d2 - torch.diag_embed(torch.diagonal(d2))
    return d2


def safe_sqrt(x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """sqrt with a finite gradient at 0 (the gradient there is taken as 0)."""
    positive = x > eps
    return torch.where(positive, torch.sqrt(torch.where(positive, x, torch.ones_like(x))), torch.zeros_like(x))


def unit_distance(similarity: torch.Tensor, squared: bool = False) -> torch.Tensor:
    """Euclidean distance of unit vectors from their cosine similarity: d^2 = 2 - 2 S (loop section 3.3)."""
    d2 = (2.0 - 2.0 * similarity).clamp_min(0.0)
    return d2 if squared else safe_sqrt(d2)


def masked_logsumexp(
    x: torch.Tensor, mask: torch.Tensor, dim: int = -1, add_one: bool = False, keepdim: bool = False
) -> torch.Tensor:
    """log(sum_{mask} exp(x)) along ``dim`` (plus exp(0)=1 when ``add_one``: log(1 + sum exp)).

    A row whose mask is empty gives 0 (not -inf) with a zero gradient, so that a degenerate batch
    contributes nothing rather than NaN.
    """
    mask = mask.bool()
    neg_inf = torch.finfo(x.dtype).min
    x_masked = torch.where(mask, x, torch.full_like(x, neg_inf))
    if add_one:
        zeros_shape = list(x.shape)
        zeros_shape[dim] = 1
        x_masked = torch.cat([x_masked, x.new_zeros(zeros_shape)], dim=dim)
    max_val = x_masked.amax(dim=dim, keepdim=True).detach()
    max_val = torch.where(torch.isfinite(max_val) & (max_val > neg_inf), max_val, torch.zeros_like(max_val))
    summed = torch.exp(x_masked - max_val).sum(dim=dim, keepdim=True)
    out = torch.log(summed.clamp_min(torch.finfo(x.dtype).tiny)) + max_val
    if not add_one:
        any_valid = mask.any(dim=dim, keepdim=True)
        out = torch.where(any_valid, out, torch.zeros_like(out))
    return out if keepdim else out.squeeze(dim)


def label_masks(
    labels: torch.Tensor, other_labels: torch.Tensor | None = None, self_index: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(positive, negative) boolean masks [n, m]; positives exclude i == j when comparing a set to itself, and
    against another set column ``self_index[i]`` of row i (where row i is itself; -1: it is not there)."""
    other = labels if other_labels is None else other_labels
    same = labels.view(-1, 1) == other.view(1, -1)
    negative = ~same
    positive = same
    if other_labels is None:
        positive = same & ~torch.eye(len(labels), dtype=torch.bool, device=labels.device)
    elif self_index is not None:
        columns = torch.arange(len(other), device=labels.device)
        positive = same & (columns.view(1, -1) != self_index.view(-1, 1))
    return positive, negative


def zero_loss(like: torch.Tensor) -> torch.Tensor:
    """A scalar 0 connected to the graph (zero gradient), for batches with nothing to learn from."""
    return (like * 0.0).sum()
