"""DCDL: Deep Class-wise Discrepancy Loss (Roy, Han, Harandi, Petersson, "Learning Deep Optimal
Embeddings with Sinkhorn Divergences"), main text eq. 1, 2, 5 and supplementary eq. 11-16.

For every class k in the batch the embeddings split into Z_k+ = {z_i | y_i = k} and
Z_k- = {z_i | y_i != k} (eq. 1), each taken as a uniform empirical distribution (eq. 9). DCDL pushes the
two apart:

    L_phi   = - sum_k phi(Z_k+, Z_k-)                       (eq. 2, a SUM over the classes, as in the paper)
    L_train = L_local + lambda * L_phi                      (eq. 5)

phi is one of
    "mmd_laplacian" / "mmd_gaussian": the biased (V-statistic) MMD^2 of eq. 15 with the kernels of eq. 16,
        sigma = 0.05 (paper default), lambda = 0.2;
    "sinkhorn": the Sinkhorn divergence of eq. 13, SD = W_eps(U, V) - (W_eps(U, U) + W_eps(V, V)) / 2, with
        W_eps of eq. 11 (p = 2, cost D^p(u, v) = |u - v|^2 / 2, epsilon = 2.5e-3), lambda = 0.5.

The paper constrains |z_i| = 1, so the discrepancy is computed on L2-normalised embeddings
(``normalize=True``); the local loss gets the embeddings unchanged and normalises as it defines.
Classes with fewer than ``min_samples_per_class`` samples (the paper keeps at least r per class "to avoid
degenerate solutions") and classes with an empty Z_k- (a one-class batch) are skipped, so a degenerate
batch gives a finite loss instead of NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from geomloss import SamplesLoss
from torch import nn

from retrieval.distances import l2_normalize, safe_sqrt, squared_euclidean_matrix, zero_loss
from retrieval.loss_registry import LOSSES, register_loss

PHIS = ("mmd_laplacian", "mmd_gaussian", "sinkhorn")
DEFAULT_LAMBDA = {"mmd_laplacian": 0.2, "mmd_gaussian": 0.2, "sinkhorn": 0.5}  # main text, "Results"
DEFAULT_SIGMA = 0.05  # eq. 16
DEFAULT_EPSILON = 2.5e-3  # eq. 11
# Ratio between successive blur radii of geomloss's epsilon-scaling (one Sinkhorn iteration per radius);
# closer to 1 = more iterations = closer to the converged fixed point of Algorithm 1. Measured against
# scaling 0.995 on a 128 x 512 batch of 32 classes: values within 2e-4, gradient cosine 0.9999 at 0.9
# (0.987 at geomloss's default 0.5). On tiny low-dimensional clouds 0.9 is a few percent low (tests).
DEFAULT_SCALING = 0.9


# ----------------------------------------------------------------------------- kernels, eq. 16
def laplacian_kernel(squared_distances: torch.Tensor, sigma: float) -> torch.Tensor:
    """k_L(u, v) = exp(-|u - v| / sigma); safe_sqrt keeps the gradient finite at u = v."""
    return torch.exp(-safe_sqrt(squared_distances) / sigma)


def gaussian_kernel(squared_distances: torch.Tensor, sigma: float) -> torch.Tensor:
    """k_G(u, v) = exp(-|u - v|^2 / (2 sigma^2))."""
    return torch.exp(-squared_distances / (2.0 * sigma * sigma))


KERNELS = {"laplacian": laplacian_kernel, "gaussian": gaussian_kernel}


def _kernel(name: str):
    try:
        return KERNELS[name]
    except KeyError:
        raise ValueError(f"unknown MMD kernel {name!r}; choose one of {sorted(KERNELS)}") from None


# ----------------------------------------------------------------------------- two point clouds
def mmd(
    x: torch.Tensor, y: torch.Tensor, kernel: str = "laplacian", sigma: float = DEFAULT_SIGMA
) -> torch.Tensor:
    """Biased MMD^2 between the uniform empirical measures on x [n, D] and y [m, D] (eq. 15)."""
    k = _kernel(kernel)
    k_xx = k(squared_euclidean_matrix(x), sigma).mean()
    k_yy = k(squared_euclidean_matrix(y), sigma).mean()
    k_xy = k(squared_euclidean_matrix(x, y), sigma).mean()
    return k_xx - 2.0 * k_xy + k_yy


def sinkhorn_divergence(
    x: torch.Tensor, y: torch.Tensor, epsilon: float = DEFAULT_EPSILON, scaling: float = DEFAULT_SCALING
) -> torch.Tensor:
    """Sinkhorn divergence SD_eps (eq. 13) between uniform measures on x [n, D] and y [m, D].

    geomloss solves eq. 11 in the log domain (a plain kernel exp(-C / 2.5e-3) underflows). Its
    conventions match the paper's: for p = 2 its cost is |x - y|^2 / 2 and its temperature is
    epsilon = blur^p, hence blur = sqrt(epsilon). Its entropic term is eps * KL(T | a b^T) where eq. 11
    has eps * sum T (log T - 1); the two differ by eps * (sum a log a + sum b log b - 1), a constant
    that cancels exactly in the debiased combination of eq. 13.
    """
    return _sinkhorn_samples_loss(epsilon, scaling)(x, y)


def _sinkhorn_samples_loss(epsilon: float, scaling: float, diameter: float | None = None) -> SamplesLoss:
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0 (the paper uses 2.5e-3), got {epsilon}")
    if not 0 < scaling < 1:
        raise ValueError(f"scaling must be in (0, 1) (closer to 1 = more Sinkhorn iterations), got {scaling}")
    return SamplesLoss(
        "sinkhorn",
        p=2,
        blur=epsilon**0.5,  # geomloss: epsilon = blur^p
        debias=True,  # eq. 13
        scaling=scaling,
        diameter=diameter,
        backend="tensorized",
    )


# ----------------------------------------------------------------------------- class-wise, eq. 1-2
@dataclass
class ClassSplit:
    """Per usable class k: membership mask [K, B] and uniform weights of Z_k+ and Z_k- (eq. 1, 9)."""

    classes: torch.Tensor  # [K] label values
    members: torch.Tensor  # [K, B] bool, True where y_i == k
    positive_weights: torch.Tensor  # [K, B], 1 / |Z_k+| on members, 0 elsewhere
    negative_weights: torch.Tensor  # [K, B], 1 / |Z_k-| on non-members, 0 elsewhere


def split_classes(labels: torch.Tensor, min_samples_per_class: int = 2, dtype=torch.float32) -> ClassSplit:
    """The classes of the batch that define a non-degenerate pair (Z_k+, Z_k-)."""
    if labels.dim() != 1:
        raise ValueError(f"labels must be a 1-D tensor [B], got shape {tuple(labels.shape)}")
    classes, counts = torch.unique(labels, return_counts=True)
    usable = (counts >= min_samples_per_class) & (counts < labels.numel())  # Z_k- must not be empty
    classes, counts = classes[usable], counts[usable]
    members = labels.view(1, -1) == classes.view(-1, 1)
    pos_w = members.to(dtype) / counts.view(-1, 1).to(dtype)
    neg_w = (~members).to(dtype) / (labels.numel() - counts).view(-1, 1).to(dtype)
    return ClassSplit(classes, members, pos_w, neg_w)


def classwise_mmd(
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    kernel: str = "laplacian",
    sigma: float = DEFAULT_SIGMA,
    min_samples_per_class: int = 2,
) -> torch.Tensor:
    """[K] MMD^2(Z_k+, Z_k-) for every usable class, from one shared B x B kernel matrix (eq. 15)."""
    split = split_classes(labels, min_samples_per_class, embeddings.dtype)
    gram = _kernel(kernel)(squared_euclidean_matrix(embeddings), sigma)  # [B, B]
    a, b = split.positive_weights, split.negative_weights  # [K, B]
    # a^T G a - 2 a^T G b + b^T G b for every row k at once.
    return ((a @ gram) * a).sum(1) - 2.0 * ((a @ gram) * b).sum(1) + ((b @ gram) * b).sum(1)


def classwise_sinkhorn(
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    epsilon: float = DEFAULT_EPSILON,
    scaling: float = DEFAULT_SCALING,
    min_samples_per_class: int = 2,
) -> torch.Tensor:
    """[K] SD_eps(Z_k+, Z_k-) (eq. 13) for every usable class, solved as one batch of K problems.

    Z_k+ and Z_k- are gathered into padded [K, n_max, D] and [K, m_max, D] clouds; padding points get
    weight 0, which geomloss excludes (log-weight -1e5), so every problem is only as large as its class.
    """
    split = split_classes(labels, min_samples_per_class, embeddings.dtype)
    if split.classes.numel() == 0:
        return embeddings.new_zeros(0)
    x, a = _gather_padded(embeddings, split.members, split.positive_weights)
    y, b = _gather_padded(embeddings, ~split.members, split.negative_weights)
    diameter = _diameter(embeddings)
    return _sinkhorn_samples_loss(epsilon, scaling, diameter)(a, x, b, y)


def _gather_padded(
    embeddings: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``embeddings`` selected by each row of ``mask``, first the selected ones (padded)."""
    width = int(mask.sum(1).max())
    # A stable sort of ~mask lists the selected indices first, in batch order.
    index = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :width]  # [K, width]
    return embeddings[index], weights.gather(1, index)


def _diameter(embeddings: torch.Tensor) -> float:
    """max |x_i - x_j|, where geomloss's epsilon annealing starts (its own bound, the bounding-box
    diagonal, is ~5x larger for 512-d unit vectors and would cost extra iterations)."""
    with torch.no_grad():
        return max(float(squared_euclidean_matrix(embeddings).max().sqrt()), 1e-3)


# ----------------------------------------------------------------------------- the loss, eq. 5
@register_loss("dcdl")
class DCDLLoss(nn.Module):
    """L = L_local + lambda * L_phi with L_phi = -sum_k phi(Z_k+, Z_k-) (eq. 2, 5).

    ``local``: any registered loss name (the paper uses triplet, npair, angular, angular_npair) with
    ``local_kwargs``; ``None`` or "none" trains on lambda * L_phi alone (supplementary Table 2 ablation).
    ``lam=None`` takes the paper's value for ``phi`` (0.2 for MMD, 0.5 for Sinkhorn).
    ``class_reduction="sum"`` follows eq. 2; "mean" divides by the number of classes used, which keeps
    the scale independent of the classes per batch.
    """

    def __init__(
        self,
        phi: str = "sinkhorn",
        lam: float | None = None,
        local: str | None = "triplet",
        local_kwargs: dict[str, Any] | None = None,
        sigma: float = DEFAULT_SIGMA,
        epsilon: float = DEFAULT_EPSILON,
        scaling: float = DEFAULT_SCALING,
        normalize: bool = True,
        class_reduction: str = "sum",
        min_samples_per_class: int = 2,
    ) -> None:
        super().__init__()
        if phi not in PHIS:
            raise ValueError(f"unknown DCDL discrepancy phi={phi!r}; choose one of {', '.join(PHIS)}")
        if class_reduction not in ("sum", "mean"):
            raise ValueError(f"class_reduction must be 'sum' (eq. 2) or 'mean', got {class_reduction!r}")
        if min_samples_per_class < 1:
            raise ValueError(f"min_samples_per_class must be >= 1, got {min_samples_per_class}")
        if local == "dcdl":
            raise ValueError("the local loss of DCDL cannot be 'dcdl' itself; use e.g. local='triplet'")
        self.phi = phi
        self.lam = DEFAULT_LAMBDA[phi] if lam is None else float(lam)
        self.sigma = sigma
        self.epsilon = epsilon
        self.scaling = scaling
        self.normalize = normalize
        self.class_reduction = class_reduction
        self.min_samples_per_class = min_samples_per_class
        if phi == "sinkhorn":
            _sinkhorn_samples_loss(epsilon, scaling)  # validate the settings now, not at the first batch
        self.local = None if local in (None, "none") else LOSSES.build(local, **(local_kwargs or {}))
        self.last_stats: dict[str, float] = {}

    def discrepancies(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """[K] phi(Z_k+, Z_k-) for the usable classes of the batch."""
        z = l2_normalize(embeddings) if self.normalize else embeddings
        if self.phi == "sinkhorn":
            return classwise_sinkhorn(z, labels, self.epsilon, self.scaling, self.min_samples_per_class)
        kernel = "laplacian" if self.phi == "mmd_laplacian" else "gaussian"
        return classwise_mmd(z, labels, kernel, self.sigma, self.min_samples_per_class)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if embeddings.dim() != 2 or labels.shape != embeddings.shape[:1]:
            raise ValueError(
                f"expected embeddings [B, D] and labels [B], got {tuple(embeddings.shape)} and "
                f"{tuple(labels.shape)}"
            )
        phis = self.discrepancies(embeddings, labels)
        if phis.numel() == 0:  # no class has both Z_k+ and Z_k-: nothing to push apart
            l_phi = zero_loss(embeddings)
        else:
            l_phi = -(phis.sum() if self.class_reduction == "sum" else phis.mean())  # eq. 2
        l_local = self.local(embeddings, labels) if self.local is not None else zero_loss(embeddings)
        self.last_stats = {
            "dcdl_local": float(l_local.detach()),
            "dcdl_phi": float(phis.detach().mean()) if phis.numel() else 0.0,
            "dcdl_classes": float(phis.numel()),
        }
        for key, value in getattr(self.local, "last_stats", {}).items():
            self.last_stats[f"local_{key}"] = value
        return l_local + self.lam * l_phi  # eq. 5
