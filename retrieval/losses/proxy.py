"""Proxy-based losses: every training class has learnt proxies, and a sample is compared with the proxies, not
with the other samples of its batch.

Built as ``build(name, num_classes=C, embedding_dim=D, **hyperparameters)`` and called as ``loss(embeddings,
labels)`` with labels in 0..C-1 (the training split's contiguous class indices). The proxies are the module's
parameter ``proxies``: [C, D], or [C * K, D] with K centres per class (rows c*K .. c*K+K-1 are class c's), as in
pytorch-metric-learning; they travel with the loss's ``state_dict`` (checkpoints, ``--resume``) and never with the
embedder (ONNX export). Every similarity here is a cosine (embeddings and proxies L2-normalised).

``proxy_lr`` is the learning rate the loss's paper gives its proxies (``--loss-lr`` overrides it; None: the head's
``--lr``). The equation each class implements is its ``paper_equation``; none of these papers is in the
repository's paper folder, so the equations are written out there.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from retrieval.distances import l2_normalize, masked_logsumexp, zero_loss
from retrieval.utils.reads import Stat, require_classes


class ProxyLoss(nn.Module):
    """Base class: proxies [C * centers, D] and the cosines of a batch against them; subclasses implement
    ``from_cosines(cosines [B, C, K], labels [B])``."""

    needs_classes = True  # build() passes num_classes and embedding_dim
    normalized_embeddings = True
    proxy_lr: float | None = None
    paper_equation: str = ""
    readings: dict[str, str] = {}

    def __init__(self, num_classes: int, embedding_dim: int, centers: int = 1) -> None:
        super().__init__()
        if int(num_classes) < 2:
            raise ValueError(f"{type(self).__name__} needs num_classes >= 2 (the training classes), got {num_classes}")
        if int(embedding_dim) < 1 or int(centers) < 1:
            raise ValueError(f"embedding_dim and centers must be >= 1, got {embedding_dim} and {centers}")
        self.num_classes, self.embedding_dim, self.centers = int(num_classes), int(embedding_dim), int(centers)
        self.proxies = nn.Parameter(torch.empty(self.num_classes * self.centers, self.embedding_dim))
        nn.init.kaiming_normal_(self.proxies, mode="fan_out")  # Proxy-Anchor's initialisation
        self.last_stats: dict[str, Stat] = {}

    def cosines(self, embeddings: torch.Tensor) -> torch.Tensor:
        """[B, C, K]: cosine of every sample with every centre of every class."""
        proxies = l2_normalize(self.proxies.to(embeddings.dtype))
        return (l2_normalize(embeddings) @ proxies.T).view(len(embeddings), self.num_classes, self.centers)

    def checked_labels(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Shape checks, and the labels within the classes (``require_classes``); returns the labels to use."""
        if embeddings.dim() != 2 or embeddings.shape[1] != self.embedding_dim:
            raise ValueError(f"embeddings must be [batch, {self.embedding_dim}], got shape {tuple(embeddings.shape)}; "
                             "build the loss with the model's embedding_dim")
        if labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
            raise ValueError(f"labels must be [batch] matching embeddings {tuple(embeddings.shape)}, "
                             f"got {tuple(labels.shape)}")
        return require_classes(labels, self.num_classes, "loss")

    def class_mask(self, labels: torch.Tensor) -> torch.Tensor:
        """[B, C] bool: sample i is of class c (``F.one_hot`` without its range check, which reads the device)."""
        return labels.unsqueeze(1) == torch.arange(self.num_classes, device=labels.device)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labels = self.checked_labels(embeddings, labels)
        if embeddings.shape[0] == 0:  # nothing to learn from; still connected to the proxies
            return zero_loss(embeddings) + zero_loss(self.proxies).to(embeddings.dtype)
        return self.from_cosines(self.cosines(embeddings), labels)

    def from_cosines(self, cosines: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"num_classes={self.num_classes}, embedding_dim={self.embedding_dim}, centers={self.centers}"


class ProxyAnchorLoss(ProxyLoss):
    """Proxy-Anchor (Kim et al., CVPR 2020): each proxy is an anchor pulling its class's samples in the batch and
    pushing every other sample away."""

    proxy_lr = 1e-2  # the paper: proxies learn 100x faster than the model (1e-4)
    paper_equation = ("Proxy-Anchor eq. 4: (1/|P+|) sum_{p in P+} log(1 + sum_{x in X+_p} exp(-alpha (s(x,p) - "
                      "delta))) + (1/|P|) sum_{p in P} log(1 + sum_{x in X-_p} exp(alpha (s(x,p) + delta))); P+ = the "
                      "proxies with a positive in the batch, s = cosine")
    readings = {"alpha": "the scale alpha (32 in the paper)", "margin": "the margin delta (0.1 in the paper)"}

    def __init__(self, num_classes: int, embedding_dim: int, alpha: float = 32.0, margin: float = 0.1) -> None:
        super().__init__(num_classes, embedding_dim)
        if not alpha > 0:
            raise ValueError(f"alpha must be > 0, got {alpha}")
        self.alpha, self.margin = float(alpha), float(margin)

    def from_cosines(self, cosines: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = cosines[:, :, 0]  # [B, C]
        positive = self.class_mask(labels)
        with_positive = positive.any(dim=0)  # P+
        pos = masked_logsumexp(-self.alpha * (s - self.margin), positive, dim=0, add_one=True)  # [C]
        neg = masked_logsumexp(self.alpha * (s + self.margin), ~positive, dim=0, add_one=True)  # [C]
        pos_term = torch.where(with_positive, pos, torch.zeros_like(pos)).sum() / with_positive.sum().clamp_min(1)
        self.last_stats = {"proxies_with_positive": with_positive.float().mean().detach()}
        return pos_term + neg.mean()


class ProxyNCALoss(ProxyLoss):
    """ProxyNCA++ (Teh et al., ECCV 2020): a softmax over the negative squared distances to every proxy, at a low
    temperature, with fast-moving proxies."""

    proxy_lr = 1e-2  # fast-moving proxies: far faster than the model (an estimate; --loss-lr overrides)
    paper_equation = ("ProxyNCA++ (section 3, positive proxy in the denominator): -log( exp(-d(x, p_y) / T) / "
                      "sum_{p in all proxies} exp(-d(x, p) / T) ), d = squared Euclidean distance of the "
                      "L2-normalised x and p = 2 - 2 cos")
    readings = {
        "temperature": "T; ProxyNCA++'s low temperature is 1/9 (the original ProxyNCA is T = 1 without the positive "
                       "proxy in the denominator)",
    }

    def __init__(self, num_classes: int, embedding_dim: int, temperature: float = 1 / 9) -> None:
        super().__init__(num_classes, embedding_dim)
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)

    def from_cosines(self, cosines: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        distance = (2.0 - 2.0 * cosines[:, :, 0]).clamp_min(0.0)
        return F.cross_entropy(-distance / self.temperature, labels)


class NormSoftmaxLoss(ProxyLoss):
    """Normalised softmax (Zhai & Wu, BMVC 2019): a cosine classifier with a temperature."""

    paper_equation = ("Zhai & Wu (normalised softmax): -log( exp(cos(x, p_y) / sigma) / sum_c exp(cos(x, p_c) / "
                      "sigma) ), sigma = temperature")
    readings = {"temperature": "sigma (0.05 in the paper)"}

    def __init__(self, num_classes: int, embedding_dim: int, temperature: float = 0.05) -> None:
        super().__init__(num_classes, embedding_dim)
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)

    def from_cosines(self, cosines: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(cosines[:, :, 0] / self.temperature, labels)


class CosFaceLoss(ProxyLoss):
    """CosFace / large-margin cosine loss (Wang et al., CVPR 2018): a margin subtracted from the true class's cosine."""

    paper_equation = "CosFace eq. 4: -log( exp(s (cos_y - m)) / (exp(s (cos_y - m)) + sum_{c != y} exp(s cos_c)) )"
    readings = {"scale": "s (64 in the paper)", "margin": "m, a cosine (0.35 in the paper)"}

    def __init__(self, num_classes: int, embedding_dim: int, scale: float = 64.0, margin: float = 0.35) -> None:
        super().__init__(num_classes, embedding_dim)
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self.scale, self.margin = float(scale), float(margin)

    def from_cosines(self, cosines: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = cosines[:, :, 0]
        logits = s - self.margin * self.class_mask(labels).to(s.dtype)
        return F.cross_entropy(self.scale * logits, labels)


class ArcFaceLoss(ProxyLoss):
    """ArcFace / additive angular margin (Deng et al., CVPR 2019), with sub-centres (Deng et al., ECCV 2020) when
    ``centers`` > 1: a class's cosine is the largest over its K centres."""

    paper_equation = ("ArcFace eq. 3: -log( exp(s cos(theta_y + m)) / (exp(s cos(theta_y + m)) + sum_{c != y} "
                      "exp(s cos theta_c)) ); sub-center ArcFace: cos theta_c = max_k cos(x, p_c^k)")
    readings = {
        "scale": "s (64 in the paper)",
        "margin": "m, an angle in radians (0.5 in the paper)",
        "centers": "K sub-centres per class (1: plain ArcFace; 3 in the sub-center paper)",
        "beyond pi": "where theta_y + m > pi, cos(theta + m) stops decreasing; as the paper's code, the target "
                     "logit is then cos theta_y - m sin m (monotonic, with a gradient)",
    }

    def __init__(self, num_classes: int, embedding_dim: int, scale: float = 64.0, margin: float = 0.5,
                 centers: int = 1) -> None:
        super().__init__(num_classes, embedding_dim, centers)
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        if not 0 <= margin < math.pi / 2:
            raise ValueError(f"margin is an angle in radians and must be in [0, pi/2), got {margin}")
        self.scale, self.margin = float(scale), float(margin)

    def from_cosines(self, cosines: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        c = cosines.amax(dim=2)  # [B, C]
        # sin(theta) with a bounded gradient at |cos| = 1 (theta = 0 or pi)
        sine = (1.0 - c * c).clamp_min(torch.finfo(c.dtype).eps).sqrt()
        with_margin = c * math.cos(self.margin) - sine * math.sin(self.margin)  # cos(theta + m)
        beyond = c <= math.cos(math.pi - self.margin)  # theta + m >= pi
        with_margin = torch.where(beyond, c - self.margin * math.sin(self.margin), with_margin)
        target = self.class_mask(labels)
        return F.cross_entropy(self.scale * torch.where(target, with_margin, c), labels)


class SoftTripleLoss(ProxyLoss):
    """SoftTriple (Qian et al., ICCV 2019): K centres per class, a class's similarity is the softmax-weighted mean of
    its centres' cosines, a margin on the true class, and a regulariser that merges redundant centres."""

    proxy_lr = 1e-2  # the paper's centres learn at 1e-2, the model at 1e-4
    paper_equation = ("SoftTriple (relaxed similarity, loss and regulariser): "
                      "S_c = sum_k softmax_k(cos(x, w_c^k) / gamma) cos(x, w_c^k); "
                      "-log( exp(lambda (S_y - delta)) / (exp(lambda (S_y - delta)) + sum_{c != y} exp(lambda S_c)) )"
                      " + tau sum_c sum_{t<s} sqrt(2 - 2 w_c^t . w_c^s) / (C K (K - 1))")
    readings = {"scale": "lambda (20)", "gamma": "gamma (0.1)", "tau": "the regulariser's weight tau (0.2)",
                "margin": "delta (0.01)", "centers": "K centres per class (10)"}

    def __init__(self, num_classes: int, embedding_dim: int, scale: float = 20.0, gamma: float = 0.1,
                 tau: float = 0.2, margin: float = 0.01, centers: int = 10) -> None:
        super().__init__(num_classes, embedding_dim, centers)
        if not (scale > 0 and gamma > 0 and tau >= 0):
            raise ValueError(f"scale and gamma must be > 0 and tau >= 0, got {scale}, {gamma}, {tau}")
        self.scale, self.gamma, self.tau, self.margin = float(scale), float(gamma), float(tau), float(margin)

    def from_cosines(self, cosines: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(cosines / self.gamma, dim=2)
        relaxed = (weights * cosines).sum(dim=2)  # [B, C]
        logits = relaxed - self.margin * self.class_mask(labels).to(relaxed.dtype)
        loss = F.cross_entropy(self.scale * logits, labels)
        if self.tau > 0 and self.centers > 1:
            loss = loss + self.tau * self.center_spread(cosines.dtype)
        return loss

    def center_spread(self, dtype: torch.dtype) -> torch.Tensor:
        """sum over classes and centre pairs t < s of ||w^t - w^s|| / (C K (K - 1)) (unit centres)."""
        centers = l2_normalize(self.proxies.to(dtype)).view(self.num_classes, self.centers, -1)
        gram = centers @ centers.transpose(1, 2)  # [C, K, K]
        # the pairs t < s as indices, not a mask: a mask index waits for the GPU (its nonzero), forward and backward
        first, second = torch.triu_indices(self.centers, self.centers, offset=1, device=gram.device)
        # + 1e-5 under the root: centres that coincide have distance 0, whose sqrt has no finite gradient
        distances = (2.0 + 1e-5 - 2.0 * gram[:, first, second]).clamp_min(0.0).sqrt()
        return distances.sum() / (self.num_classes * self.centers * (self.centers - 1))
