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

The local loss (eq. 3) takes the paper's form by default (``local_form="paper"``): for triplet that is
squared distances, FaceNet's semi-hard mining (supplementary: "L_Trip enforces semi-hard triplet mining"),
the mean over the mined triplets and tau = 0.5 (section 4 and the supplementary's implementation details: "we
set the value of tau in L_Trip to 0.5"). ``local_form="loop"`` keeps the registered loss's own defaults
(for triplet the LoOp / Symm form: non-squared distances, margin 0.2, all triplets, divided by |P|).

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
from torch import nn

from retrieval.distances import l2_normalize, safe_sqrt, squared_euclidean_matrix, zero_loss
from retrieval.losses.registry import LOSSES
from retrieval.losses.sinkhorn import DEFAULT_SCALING, DEFAULT_TOLERANCE, sinkhorn_divergence_batch
from retrieval.utils.reads import Stat

PHIS = ("mmd_laplacian", "mmd_gaussian", "sinkhorn")
DEFAULT_LAMBDA = {"mmd_laplacian": 0.2, "mmd_gaussian": 0.2, "sinkhorn": 0.5}  # main text, "Results"
DEFAULT_SIGMA = 0.05  # eq. 16
DEFAULT_EPSILON = 2.5e-3  # eq. 11
# The local loss of eq. 3 as the paper runs it, per local loss name (``local_form="paper"``); the other local
# losses of eq. 3 (N-pair, angular, their sum) are the registered losses' own definitions and defaults.
PAPER_LOCAL_KWARGS: dict[str, dict[str, Any]] = {
    # eq. 3: squared distances, mean over the mined triplets; supp.: semi-hard mining; sec. 4: tau = 0.5
    "triplet": {"squared": True, "mining": "semihard", "margin": 0.5, "reduction": "triplets"},
}
LOCAL_FORMS = ("paper", "loop")


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
    x: torch.Tensor,
    y: torch.Tensor,
    epsilon: float = DEFAULT_EPSILON,
    scaling: float = DEFAULT_SCALING,
    tolerance: float = DEFAULT_TOLERANCE,
) -> torch.Tensor:
    """Sinkhorn divergence SD_eps (eq. 13) between uniform measures on x [n, D] and y [m, D], converged
    (``retrieval.losses.sinkhorn``; p = 2, cost |x - y|^2 / 2)."""
    a = x.new_full((1, len(x)), 1.0 / len(x))
    b = y.new_full((1, len(y)), 1.0 / len(y))
    return sinkhorn_divergence_batch(x[None], a, y[None], b, epsilon, scaling, tolerance)[0]


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
    tolerance: float = DEFAULT_TOLERANCE,
    compiled: bool = False,
) -> torch.Tensor:
    """[K] SD_eps(Z_k+, Z_k-) (eq. 13) for every usable class, solved as one batch of K problems.

    Z_k+ and Z_k- are gathered into padded [K, n_max, D] and [K, m_max, D] clouds; padding points get
    weight 0 (log-weight -inf), so every problem is only as large as its class. ``compiled``: the iterations run
    through torch.compile (``sinkhorn_divergence_batch``).
    """
    split = split_classes(labels, min_samples_per_class, embeddings.dtype)
    if split.classes.numel() == 0:
        return embeddings.new_zeros(0)
    x, a = _gather_padded(embeddings, split.members, split.positive_weights)
    y, b = _gather_padded(embeddings, ~split.members, split.negative_weights)
    return sinkhorn_divergence_batch(x, a, y, b, epsilon, scaling, tolerance, _diameter(embeddings), compiled)


def _gather_padded(
    embeddings: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``embeddings`` selected by each row of ``mask``, first the selected ones (padded)."""
    width = int(mask.sum(1).max())
    # A stable sort of ~mask lists the selected indices first, in batch order.
    index = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :width]  # [K, width]
    return embeddings[index], weights.gather(1, index)


def _diameter(embeddings: torch.Tensor) -> float:
    """max |x_i - x_j| over the whole batch, where the epsilon annealing starts."""
    with torch.no_grad():
        return max(float(squared_euclidean_matrix(embeddings).max().sqrt()), 1e-3)


# ----------------------------------------------------------------------------- the loss, eq. 5
class DCDLLoss(nn.Module):
    """L = L_local + lambda * L_phi with L_phi = -sum_k phi(Z_k+, Z_k-) (eq. 2, 5).

    ``local``: any registered loss name (the paper uses triplet, npair, angular, angular_npair) with
    ``local_kwargs``; ``None`` or "none" trains on lambda * L_phi alone (supplementary Table 2 ablation).
    ``local_form="paper"`` starts the local loss from eq. 3 as the paper runs it (``PAPER_LOCAL_KWARGS``),
    "loop" from the registered loss's own defaults; ``local_kwargs`` override either.
    ``tolerance``: Sinkhorn iterates until no dual potential moves by more than this (converged).
    ``lam=None`` takes the paper's value for ``phi`` (0.2 for MMD, 0.5 for Sinkhorn).
    ``class_reduction="sum"`` follows eq. 2; "mean" divides by the number of classes used, which keeps
    the scale independent of the classes per batch.
    """

    paper_equation = "dcdl eq. 2 and 5 (eq. 1, 3; supp. eq. 11-16)"
    readings = {
        "local_form": (
            "'paper' = the local loss of dcdl eq. 3 as the paper runs it (triplet: squared distances, "
            "semi-hard mining, mean over the mined triplets, tau = 0.5; default) or 'loop' = the "
            "registered loss's own defaults (the LoOp / Symm triplet)"
        ),
        "tolerance": "Sinkhorn iterates until no dual potential moves by more than this (converged; default 1e-6)",
    }

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
        local_form: str = "paper",
        tolerance: float = DEFAULT_TOLERANCE,
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
        if local_form not in LOCAL_FORMS:
            raise ValueError(f"local_form must be 'paper' (dcdl eq. 3 as the paper runs it) or 'loop' (the "
                             f"registered loss's defaults, the LoOp / Symm triplet), got {local_form!r}")
        self.phi = phi
        self.lam = DEFAULT_LAMBDA[phi] if lam is None else float(lam)
        self.sigma = sigma
        self.epsilon = epsilon
        self.scaling = scaling
        self.tolerance = tolerance
        self.local_form = local_form
        self.normalize = normalize
        self.class_reduction = class_reduction
        self.min_samples_per_class = min_samples_per_class
        if not epsilon > 0 or not 0 < scaling < 1 or not tolerance > 0:
            raise ValueError(f"Sinkhorn needs epsilon > 0 (paper: 2.5e-3), 0 < scaling < 1 and tolerance > 0, got "
                             f"epsilon={epsilon}, scaling={scaling}, tolerance={tolerance}")
        if local in (None, "none"):
            self.local = None
        else:
            form = PAPER_LOCAL_KWARGS.get(local, {}) if local_form == "paper" else {}
            self.local = LOSSES.build(local, **{**form, **(local_kwargs or {})})
        self.last_stats: dict[str, Stat] = {}
        self.compiled = False  # True: the Sinkhorn iterations run through torch.compile (``compile_solver``)

    def compile_solver(self) -> DCDLLoss:
        """Run the Sinkhorn iterations through torch.compile from now on: the same updates in a few fused kernels
        instead of ~20 small ones each (on a GPU the eager iterations are bound by kernel launches); the first
        batch pays the compilation."""
        self.compiled = True
        return self

    def discrepancies(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """[K] phi(Z_k+, Z_k-) for the usable classes of the batch."""
        z = l2_normalize(embeddings) if self.normalize else embeddings
        if self.phi == "sinkhorn":
            return classwise_sinkhorn(z, labels, self.epsilon, self.scaling, self.min_samples_per_class,
                                      self.tolerance, self.compiled)
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
            "dcdl_local": l_local.detach(),
            "dcdl_phi": phis.detach().mean() if phis.numel() else 0.0,
            "dcdl_classes": float(phis.numel()),  # a shape: known on the host
        }
        for key, value in getattr(self.local, "last_stats", {}).items():
            self.last_stats[f"local_{key}"] = value
        return l_local + self.lam * l_phi  # eq. 5
