"""What the command's modules share to declare options."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def apply_options(func: F, options: Sequence[Callable[[F], F]]) -> F:
    """``func`` decorated with ``options`` in the order listed, so the first one shows first in ``--help``."""
    for option in reversed(options):
        func = option(func)
    return func
