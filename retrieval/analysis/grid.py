"""The results grid as data: the datasets, their training budget, and the tables (methods, claims, caveats).

``retrieval.train.grid_runner`` runs it (``retrieval results run``); ``retrieval.analysis.grid_discussion`` writes what
the numbers say.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrieval.losses import wants_normalized
from retrieval.losses.discrepancy import PAPER_LOCAL_KWARGS

RETRIEVAL_COLUMNS = [("recall@1", "R@1"), ("recall@2", "R@2"), ("recall@4", "R@4"), ("recall@8", "R@8"),
                     ("map@r", "MAP@R"), ("nmi", "NMI"), ("f1", "F1")]
NOISE_SETTINGS = [None, "symmetric:0.1", "symmetric:0.3", "asymmetric:0.1", "asymmetric:0.2"]


# --- what the grid is made of ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DatasetSpec:
    """A dataset and the training budget every method gets on it."""

    key: str
    short: str  # in the discussion and figure titles
    title: str
    overrides: dict[str, Any]  # TrainConfig fields


@dataclass(frozen=True)
class Method:
    """One row of a table: a loss, its hard-negative generation and hyperparameters."""

    label: str
    loss: str
    negatives: str | None = None
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    normalize: bool | None = None
    options: dict[str, Any] = field(default_factory=dict)  # other TrainConfig fields (e.g. the memory)

    def overrides(self) -> dict[str, Any]:
        return {"loss": self.loss, "negatives": self.negatives, "loss_kwargs": dict(self.loss_kwargs),
                "normalize": self.normalize, **self.options}

    def slug(self) -> str:
        parts = [self.loss] + ([f"+{self.negatives}"] if self.negatives else [])
        parts += [f"-{k}={v}" for k, v in sorted({**self.loss_kwargs, **self.options}.items())]
        return "".join(parts)


@dataclass(frozen=True)
class Table:
    id: str
    title: str
    claim: str
    caveats: str
    datasets: tuple[str, ...]
    methods: tuple[Method, ...]
    noise: tuple[str | None, ...] = (None,)  # more than one: the columns are noise settings (DCDL shape)
    blocks: tuple[tuple[str, tuple[Method, ...]], ...] = ()  # grouped rows (DCDL: one block per local loss)
    metric: str = "linear_probe"  # the single metric of noise columns
    curve: str | None = None  # per-epoch training statistic to plot (SCT Figure 6)


COMMON = dict(
    backbone="efficientnet_lite0", pretrained=True, freeze_backbone=True, embedding_dim=512, optimizer="adamw",
    lr=1e-3, weight_decay=1e-4, schedule="cosine", eval_before=False,
    # the grid reports the last epoch, chosen by nothing, on every train class: its published cells stay valid
    val_fraction=0.0,
)


def default_datasets(emoji_dir: Path) -> dict[str, DatasetSpec]:
    """Sizes and steps chosen so that the whole grid fits in about 2 hours on 2 CPU cores."""
    fmnist = dict(dataset="fashion-mnist", image_size=64, batch_size=60)
    specs = [
        DatasetSpec("emoji", "Emoji", "Emoji, class-disjoint (984 train / 983 test emoji, Noto vs OpenMoji), 224 px",
                    dict(dataset="emoji", data=str(emoji_dir), batch_size=60, per_class=2, epochs=15,
                         batches_per_epoch=30)),
        DatasetSpec("fmnist-disjoint", "Fashion-MNIST disjoint",
                    "Fashion-MNIST, class-disjoint (train classes 0-4, test 5-9; 1,000 images per class), 64 px",
                    dict(fmnist, dataset_kwargs={"protocol": "disjoint", "limit_per_class": 1000}, per_class=12,
                         epochs=10, batches_per_epoch=40)),
        DatasetSpec("fmnist-standard", "Fashion-MNIST standard",
                    "Fashion-MNIST, DCDL protocol (all 10 classes; 10,000 train / 10,000 test images), 64 px",
                    dict(fmnist, dataset_kwargs={"protocol": "standard", "limit_per_class": 1000}, per_class=6,
                         epochs=8, batches_per_epoch=100, linear_probe=True)),
    ]
    return {s.key: s for s in specs}


def _pairs(losses: list[str], negatives: str, label: str) -> tuple[Method, ...]:
    return tuple(m for loss in losses for m in (Method(loss, loss), Method(f"{loss} + {label}", loss, negatives)))


def _dcdl_blocks() -> tuple[tuple[str, tuple[Method, ...]], ...]:
    blocks = []
    for local in ("triplet", "npair", "angular", "angular_npair"):
        normalize = wants_normalized(local)  # the same model output with and without the discrepancy
        blocks.append((local, (
            Method(local, local, loss_kwargs=PAPER_LOCAL_KWARGS.get(local, {}), normalize=normalize),  # dcdl eq. 3
            Method(f"{local} + MMD-Laplacian", "dcdl", loss_kwargs={"local": local, "phi": "mmd_laplacian"},
                   normalize=normalize),
            Method(f"{local} + Sinkhorn", "dcdl", loss_kwargs={"local": local, "phi": "sinkhorn"},
                   normalize=normalize),
        )))
    return tuple(blocks)


TABLES = [
    Table("loop", "1. Base losses vs + LoOp (LoOp paper, Table 2 shape)",
          "LoOp improves the base losses in most cases, with fine-tuned backbones: Recall@1 over the previous best "
          "+0.1 to +6 points on CUB-200, +0.7 to +2.9 on Cars-196, a gain for every loss on SOP; least for MS "
          "(at most +1.6), most for HPHN triplet (+14.2 on Cars-196).",
          "a frozen backbone and a linear head; on Fashion-MNIST's class-disjoint split every head trained on "
          "five classes ends below the pretrained features on the five unseen ones, so differences there are "
          "about how little each loss overfits; LoOp's synthetic negatives lie on arcs between embeddings, so "
          "its benefit depends on how curved the head's embedding manifold becomes, which a linear head limits. "
          "The MS + LoOp rows use `positive_rule=loop`, not the default `positive_rule=batch` (which compares "
          "VTHM's positive rule with the batch's negatives, LoOp 3.3.4: the rule \"remains unchanged\"): add "
          "`--loss-param positive_rule=loop` to their commands to reproduce them. HPHN and lifted-min use "
          "Algorithm 1's pairs (`negative_pairs=consecutive`), the default.",
          ("emoji", "fmnist-disjoint"), _pairs(["triplet", "hphn_triplet", "lifted_min", "ms"], "loop", "LoOp")),
    Table("symm", "2. Base losses vs + Symm (Symmetrical Synthesis paper, Tables 1-3 shape)",
          "adding Symm raises clustering and retrieval scores for every base loss on CUB-200, Cars-196 and SOP "
          "by high margins (Recall@1 +5.2 to +11.8 points on SOP), at no cost in training speed.",
          "the synthetic negatives are reflections of real embeddings; with a frozen backbone their hardness "
          "comes from the head alone. The N-pair and angular rows (with and without Symm) are without Sohn "
          "2016's norm regulariser, which both losses add by default (l2_reg = 0.002): add `--loss-param "
          "l2_reg=0` to their commands to reproduce them.",
          ("emoji", "fmnist-disjoint"), _pairs(["triplet", "lifted", "npair", "angular"], "symm", "Symm")),
    Table("sct", "3. NCA triplet: hard negatives (HN) vs semi-hard (SHN) vs selectively contrastive (SCT)",
          "with the hardest negatives, triplet training (HN) gets stuck where batches start with many hard "
          "triplets; SHN avoids that but leaves hard triplets unresolved; SCT trains on hard negatives stably and "
          "beats both on datasets with high intra-class variance (CUB, Cars, Hotels-50K).",
          "a linear head on frozen features cannot collapse the way a fine-tuned network does, so HN's failure "
          "mode is milder here.",
          ("emoji", "fmnist-disjoint"),
          (Method("NCA triplet, HN", "nca_triplet", loss_kwargs={"mining": "hard"}),
           Method("NCA triplet, SHN", "nca_triplet", loss_kwargs={"mining": "semihard"}),
           Method("SCT", "sct")),
          curve="loss_hard_fraction"),
    Table("unified", "4. Unified weight assignment: ablation (unified paper, Table 1 shape)",
          "VTHM mining helps both binomial deviance and RAW; binomial + VTHM beats equal-weight VTHM, and "
          "RAW + VTHM (= multi-similarity) is the best on all four datasets.",
          "the paper fine-tunes BN-Inception at 227 px with Adam 1e-5 and K = 5 images per class; here one "
          "learning rate (1e-3) serves every loss, and emoji batches hold N = 2 images per class, so each anchor has "
          "a single positive and VTHM keeps only the negatives within 0.1 of it: far fewer pairs than the paper's "
          "batches give.",
          ("emoji", "fmnist-disjoint"),
          (Method("binomial", "binomial"), Method("RAW", "raw"), Method("VTHM (equal weights)", "vthm"),
           Method("binomial + VTHM", "binomial", loss_kwargs={"miner": "vthm"}),
           Method("RAW + VTHM (= MS)", "ms"))),
    Table("dcdl", "5. DCDL: local losses alone, + MMD-Laplacian, + Sinkhorn; clean and noisy labels (DCDL paper, "
                  "Tables 1 and 4 shape); linear-probe accuracy",
          "adding the class-wise discrepancy (MMD-Laplacian or Sinkhorn) to a local loss raises classification "
          "accuracy by a considerable margin with clean and with noisy labels; Sinkhorn beats MMD.",
          "a linear head on frozen features followed by a linear probe is still a linear classifier of the "
          "frozen features, so the head cannot add linearly separable information: the pretrained-only probe is "
          "close to a ceiling here, and the table shows which losses lose least. MMD-Laplacian uses the paper's "
          "sigma = 0.05: on unit vectors exp(-|x - y| / 0.05) is almost zero for every pair, so the term has "
          "(almost) no gradient; the linear probe is fitted on clean labels of the training images; N-pair rows "
          "keep N-pair's unnormalised embeddings with and without the term. The runs use the paper's own "
          "settings: the local triplet of DCDL eq. 3 as the paper runs it (squared distances, FaceNet's "
          "semi-hard mining, the mean over the mined triplets, tau = 0.5 as DCDL's implementation details "
          "state), lambda = 0.2 (MMD) / 0.5 (Sinkhorn), the Sinkhorn divergence converged (tolerance 1e-6), "
          "N-pair / angular with the N-pair norm regulariser (l2_reg = 0.002). Not the paper's: one 10 x 6 "
          "batch for every local loss (the paper: at least 10 per class for triplet, 2 for the others), a 512-d "
          "head (the paper: 64-d) on frozen features, 800 steps. A cell is shown only with all three seeds (the "
          "grid size above counts the cells left empty; `retrieval results run --tables dcdl --list` shows "
          "which runs are done).",
          ("fmnist-standard",), (), noise=tuple(NOISE_SETTINGS), blocks=_dcdl_blocks()),
]
XBM = {"memory": "xbm", "memory_size": 2048}  # about the emoji train split, as XBM's memory on small sets
TABLES.append(
    Table("proxy", "6. Proxy baselines and cross-batch memory next to the pair losses",
          "proxy losses converge faster and match or beat pair losses (Proxy-Anchor: Recall@1 above MS on CUB-200, "
          "Cars-196, SOP and In-shop; SoftTriple and ProxyNCA++ likewise); a cross-batch memory (XBM) raises a pair "
          "loss's Recall@1 by large margins on large data sets (SOP, In-shop, VehicleID: +9 to +12 points for "
          "contrastive), less on CUB and Cars.",
          "the papers fine-tune the backbone; here every method trains the same linear head on frozen features with "
          "one learning rate for the head (1e-3), and the proxies at their paper's rate (Proxy-Anchor, ProxyNCA++, "
          "SoftTriple: 1e-2; the classifier losses: 1e-3). Emoji batches hold two images per class and a class has "
          "two train images in all, so every proxy is pulled by two points only; XBM's memory (2,048 rows, about the "
          "whole emoji train split) starts after one epoch. Triplet + XBM is not here: on Fashion-MNIST's 5 train "
          "classes a memory of 2,048 rows gives each anchor about 400 positives, 1.9e9 triplet terms a step, which "
          "the triplet loss refuses (it evaluates at most 2.7e8 at once). The + LoOp and + Symm rows of the same "
          "losses are in tables 1 and 2 (same data, head, budget and seeds).",
          ("emoji", "fmnist-disjoint"),
          (Method("Proxy-Anchor", "proxy_anchor"), Method("ProxyNCA++", "proxy_nca"),
           Method("NormSoftmax", "norm_softmax"), Method("CosFace", "cosface"), Method("ArcFace", "arcface"),
           Method("SoftTriple", "soft_triple"),
           Method("MS", "ms"), Method("MS + XBM", "ms", options=XBM),
           Method("lifted-min", "lifted_min"), Method("lifted-min + XBM", "lifted_min", options=XBM),
           Method("contrastive", "contrastive"), Method("contrastive + XBM", "contrastive", options=XBM))))
TABLE_IDS = [t.id for t in TABLES]
