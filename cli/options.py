"""What the command's modules share to declare options."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

from retrieval.cli.config_options import prefixed_options, prefixed_values
from retrieval.rerank import RerankConfig

F = TypeVar("F", bound=Callable)


def apply_options(func: F, options: Sequence[Callable[[F], F]]) -> F:
    """``func`` decorated with ``options`` in the order listed, so the first one shows first in ``--help``."""
    for option in reversed(options):
        func = option(func)
    return func


RERANK_PREFIX = "rerank_"  # the re-ranking's options reach a command as rerank_<field> (search has its own -k)


def rerank_options(func: F) -> F:
    """The ``--rerank*`` options (``retrieval search``, ``retrieval evaluate``), made from
    ``retrieval.rerank.RerankConfig``'s declarations."""
    return apply_options(func, prefixed_options(RerankConfig, RERANK_PREFIX))


def rerank_config(options: dict[str, Any]) -> RerankConfig:
    """The ``RerankConfig`` of the ``--rerank*`` options given (taken out of ``options``), checked: a bad value is a
    usage error that names its flag and range."""
    try:
        return RerankConfig(**prefixed_values(RerankConfig, RERANK_PREFIX, options))
    except ValueError as exc:
        raise click.UsageError(str(exc), ctx=click.get_current_context(silent=True)) from exc
