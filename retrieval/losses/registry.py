"""Every loss and hard-negative method by name: the one table each joins, in a leaf module.

``LOSSES`` maps a loss's name to its class and ``NEGATIVES`` a hard-negative method's name to its class, each written
``"module:Class"`` and imported the first time that name is built or asked about (``retrieval.utils.registry``). So
this module imports no loss, no method and no torch: listing the names costs nothing, and a loss that builds another
by name (DCDL's local loss) imports this table, not the other losses. The factory that composes a loss with a method
is ``retrieval.losses.build`` (``factory.py``).
"""

from __future__ import annotations

from typing import Any

from retrieval.utils.registry import Registry

LOSSES: Registry[Any] = Registry("loss", paths={
    # grouped by kind; ``available()`` lists the names sorted
    # pair-based: a PairLoss of the similarity matrix (losses/base.py)
    "contrastive": "retrieval.losses.contrastive:ContrastiveLoss",
    "triplet": "retrieval.losses.triplet:TripletLoss",
    "hphn_triplet": "retrieval.losses.triplet:HPHNTripletLoss",
    "nca_triplet": "retrieval.losses.nca:NCATripletLoss",
    "sct": "retrieval.losses.nca:SelectivelyContrastiveTripletLoss",
    "lifted": "retrieval.losses.lifted:LiftedStructureLoss",
    "lifted_min": "retrieval.losses.lifted:LiftedMinLoss",
    "generalized_lifted": "retrieval.losses.lifted:GeneralizedLiftedLoss",
    "npair": "retrieval.losses.npair:NPairLoss",
    "angular": "retrieval.losses.npair:AngularLoss",
    "angular_npair": "retrieval.losses.npair:AngularNPairLoss",
    "binomial": "retrieval.losses.weighting:BinomialDevianceLoss",
    "vthm": "retrieval.losses.weighting:VTHMLoss",
    "raw": "retrieval.losses.weighting:RAWLoss",
    "ms": "retrieval.losses.weighting:MultiSimilarityLoss",
    "ntxent": "retrieval.losses.ntxent:NTXentLoss",
    # one of the losses above, built by name, plus a class-discrepancy term
    "dcdl": "retrieval.losses.discrepancy:DCDLLoss",
    # proxy-based: learnt proxies per class (losses/proxy.py)
    "proxy_anchor": "retrieval.losses.proxy:ProxyAnchorLoss",
    "proxy_nca": "retrieval.losses.proxy:ProxyNCALoss",
    "norm_softmax": "retrieval.losses.proxy:NormSoftmaxLoss",
    "cosface": "retrieval.losses.proxy:CosFaceLoss",
    "arcface": "retrieval.losses.proxy:ArcFaceLoss",
    "soft_triple": "retrieval.losses.proxy:SoftTripleLoss",
})

NEGATIVES: Registry[Any] = Registry("hard-negative method", paths={
    "loop": "retrieval.negatives.loop:LoOp",
    "loop-linear": "retrieval.negatives.loop:LoOpLinear",
    "symm": "retrieval.negatives.symm:SymmetricalSynthesis",
})

# (loss, method) -> the loss's hyper-parameters the method's paper fixes for that combination; explicit
# hyper-parameters given to ``build`` still win.
COMBINATION_DEFAULTS: dict[tuple[str, str], dict[str, Any]] = {
    ("triplet", "symm"): {"squared": True},  # symm eq. 4: squared distances
}


def available() -> list[str]:
    """Names of the registered losses."""
    return LOSSES.names()
