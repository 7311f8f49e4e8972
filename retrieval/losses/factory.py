"""The one factory of the losses, ``build(name, negatives=None, **hparams)``, and what a registered loss offers and
wants: ``available_negatives()``, ``composable``, ``describe(name)``, ``wants_normalized``, ``needs_classes`` and
``has_rectangular_form``. The names and their classes are ``retrieval.losses.registry``'s table.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from retrieval.errors import ParameterError
from retrieval.losses.base import PairLoss
from retrieval.losses.registry import COMBINATION_DEFAULTS, LOSSES, NEGATIVES
from retrieval.losses.with_negatives import HardNegativeLoss


def wants_normalized(name: str) -> bool:
    """Whether loss ``name`` trains on L2-normalised embeddings by default: its class's ``normalized_embeddings``
    (True for a loss that does not say)."""
    return bool(getattr(LOSSES.get(name), "normalized_embeddings", True))


def needs_classes(name: str) -> bool:
    """Whether loss ``name`` learns per-class parameters (proxies): ``build`` then needs num_classes and
    embedding_dim."""
    return bool(getattr(LOSSES.get(name), "needs_classes", False))


def has_rectangular_form(name: str) -> bool:
    """Whether loss ``name`` has the query x gallery form (``PairLoss.query_gallery``): its class's
    ``rectangular``."""
    return bool(getattr(LOSSES.get(name), "rectangular", False))


def composable(name: str, negatives: str) -> bool:
    """Whether loss ``name`` has a pair-level form that the hard-negative method ``negatives`` can feed."""
    if name not in LOSSES or negatives not in NEGATIVES:
        return False
    loss_cls, method_cls = LOSSES.get(name), NEGATIVES.get(negatives)
    return (
        isinstance(loss_cls, type)
        and issubclass(loss_cls, PairLoss)
        and loss_cls.from_pair_terms is not PairLoss.from_pair_terms
        and method_cls.works_with(loss_cls.cosine_similarity, loss_cls.positive_rows)
    )


def available_negatives() -> list[tuple[str, str]]:
    """Every (loss, hard-negative method) that ``build(loss, negatives=method)`` accepts."""
    return [(n, m) for n in LOSSES.names() for m in NEGATIVES.names() if composable(n, m)]


def build(name: str, negatives: str | None = None, num_classes: int | None = None, embedding_dim: int | None = None,
          **hparams: Any) -> nn.Module:
    """Build a registered loss; ``negatives="loop" | "loop-linear" | "symm"`` adds hard-negative generation
    (None, "none" or "batch": the batch's own negatives). ``num_classes`` and ``embedding_dim`` size a proxy
    loss's proxies (``needs_classes``); the pair losses have none and ignore them."""
    if needs_classes(name):
        if num_classes is None or embedding_dim is None:
            raise ValueError(f"loss {name!r} learns a proxy per class: build it with num_classes= (the training "
                             "classes) and embedding_dim=")
        if negatives not in (None, "none", "batch"):
            raise ParameterError("negatives", f"{negatives} does not apply to loss {name!r}, which compares samples "
                                              "with proxies, not with the batch's negatives; leave it out")
        return LOSSES.build(name, num_classes=num_classes, embedding_dim=embedding_dim, **hparams)
    if negatives in (None, "none", "batch"):
        return LOSSES.build(name, **hparams)
    if not composable(name, negatives):
        combos = ", ".join(f"{n}+{m}" for n, m in available_negatives()) or "none yet"
        raise ValueError(
            f"the papers define no loss {name!r} with negatives={negatives!r}; combinations that exist: {combos}"
        )
    loss = LOSSES.build(name, **{**COMBINATION_DEFAULTS.get((name, negatives), {}), **hparams})
    return HardNegativeLoss(loss, NEGATIVES.build(negatives))


def describe(name: str) -> dict[str, Any]:
    """What a registered loss implements: its paper equation, its defaults (from its signature, the one place
    they are set) and, per option where a paper reads two ways, what the choices mean."""
    cls = LOSSES.get(name)
    parameters = inspect.signature(cls).parameters.values()
    defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
    if getattr(cls, "proxy_lr", None) is not None:
        defaults["--loss-lr"] = cls.proxy_lr
    return {"equation": getattr(cls, "paper_equation", ""), "defaults": defaults,
            "readings": dict(getattr(cls, "readings", {}))}
