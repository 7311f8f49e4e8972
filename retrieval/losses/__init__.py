"""Deep-metric-learning losses: one registry, ``build(name, **hparams)``.

Every loss is an ``nn.Module`` called as ``loss(embeddings, labels)`` and returns a scalar tensor.
Pairs are formed from labels, never from positions in the batch.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from torch import nn

from retrieval.losses.weights import pair_weights  # noqa: F401  (the weight view, unified Theorem 3.1)
from retrieval.registry import Registry

LOSSES: Registry[nn.Module] = Registry("loss")
# (loss name, negatives method) -> factory, for the hard-negative generation methods (LoOp, Symm).
NEGATIVE_LOSSES: dict[tuple[str, str], Any] = {}


def register_loss(name: str):
    """Decorator: ``@register_loss("triplet")`` on a class or factory function."""
    return LOSSES.register(name)


def register_negatives(loss_name: str, method: str):
    """Decorator registering ``build(loss_name, negatives=method)``."""

    def decorator(factory):
        key = (loss_name, method)
        if key in NEGATIVE_LOSSES:
            raise KeyError(f"loss {loss_name!r} with negatives={method!r} is registered twice")
        NEGATIVE_LOSSES[key] = factory
        return factory

    return decorator


def available() -> list[str]:
    _import_all()
    return LOSSES.names()


def available_negatives() -> list[tuple[str, str]]:
    _import_all()
    return sorted(NEGATIVE_LOSSES)


def build(name: str, negatives: str | None = None, **hparams: Any) -> nn.Module:
    """Build a registered loss; ``negatives="loop" | "loop-linear" | "symm"`` adds hard-negative generation."""
    _import_all()
    if negatives in (None, "none", "batch"):
        return LOSSES.build(name, **hparams)
    key = (name, negatives)
    if key not in NEGATIVE_LOSSES:
        combos = ", ".join(f"{n}+{m}" for n, m in sorted(NEGATIVE_LOSSES)) or "none yet"
        raise ValueError(
            f"the papers define no loss {name!r} with negatives={negatives!r}; combinations that exist: {combos}"
        )
    return NEGATIVE_LOSSES[key](**hparams)


def _import_all() -> None:
    # Importing the modules runs their @register_loss decorators.
    from retrieval.losses import (
        discrepancy,  # noqa: F401
        pair,  # noqa: F401
    )

    # The hard-negative methods register themselves when present (find_spec also copes with
    # retrieval/negatives/ existing without its __init__.py yet, where the import raises a plain ImportError).
    if importlib.util.find_spec("retrieval.negatives.losses") is not None:
        importlib.import_module("retrieval.negatives.losses")
