"""The ingest engines by name (``--engine``): each entry makes an ``IngestEngine`` from the command's options."""

from __future__ import annotations

from collections.abc import Callable

from retrieval.errors import ParameterError
from retrieval.index.embedding.engine import IngestEngine, IngestOptions
from retrieval.index.embedding.ingest import LocalEngine
from retrieval.index.embedding.ray_engine import RayEngine  # Ray itself is imported only when it connects

ENGINES: dict[str, Callable[[IngestOptions], IngestEngine]] = {
    "local": lambda options: LocalEngine(),
    "ray": lambda options: RayEngine(options.ray, options.policy),
}


def open_engine(options: IngestOptions) -> IngestEngine:
    """The engine ``options.engine`` names, not yet entered (the Ray one connects to its cluster on ``with``)."""
    if options.engine not in ENGINES:
        raise ParameterError("engine", f"{options.engine!r} is unknown; choose one of {', '.join(ENGINES)}")
    return ENGINES[options.engine](options)
