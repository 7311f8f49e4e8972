"""The loss and hard-negative-method registries, in a leaf module (as timm's ``_registry.py``).

This module imports no loss module and not ``retrieval.negatives``: the losses register with ``@register_loss``,
the hard-negative methods with ``@register_negatives``, ``retrieval.losses.catalog`` imports both, and
``retrieval.losses.build`` composes them, so no package imports the other's registrations and there is no import
cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from retrieval.utils.registry import Registry

LOSSES: Registry[Any] = Registry("loss")
NEGATIVES: Registry[Any] = Registry("hard-negative method")
# (loss name, method name) -> loss hyper-parameters a paper fixes for that combination, e.g. the Symm paper's
# triplet (its eq. 4) is on squared distances; explicit hyper-parameters given to ``build`` still win.
COMBINATION_DEFAULTS: dict[tuple[str, str], dict[str, Any]] = {}


def register_loss(name: str) -> Callable:
    """Decorator: ``@register_loss("triplet")`` on a class or factory function."""
    return LOSSES.register(name)


def register_negatives(name: str, loss_defaults: dict[str, dict[str, Any]] | None = None) -> Callable:
    """Decorator: ``@register_negatives("symm")`` on a hard-negative method class (``build(loss, negatives=name)``).

    ``loss_defaults`` maps a loss name to the hyper-parameters the method's paper uses with that loss.
    """

    def decorator(cls):
        NEGATIVES.register(name)(cls)
        for loss_name, hparams in (loss_defaults or {}).items():
            COMBINATION_DEFAULTS[(loss_name, name)] = dict(hparams)
        return cls

    return decorator
