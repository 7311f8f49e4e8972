"""The core's error for a bad argument: it names the function's own parameter, and callers translate the name.

A core function knows its parameters (a loss's ``size``), not the option a command line or a config file fed into
it (``--memory-size``). It raises ``ParameterError(param, problem)``; the layer that passed the value under another
name re-raises with ``renamed``, and the command line shows the option (``retrieval.cli.errors``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class ParameterError(ValueError):
    """``param`` has a bad value; ``problem`` says what is wrong and what to give instead (no parameter name)."""

    def __init__(self, param: str, problem: str) -> None:
        self.param = param
        self.problem = problem
        super().__init__(f"{param} {problem}")

    def renamed(self, param: str) -> ParameterError:
        """The same problem about the caller's name for the value."""
        return ParameterError(param, self.problem)


@contextlib.contextmanager
def parameters_named(**names: str) -> Iterator[None]:
    """Inside, a ``ParameterError`` about a parameter in ``names`` is raised again under the caller's name for it
    (``parameters_named(size="memory_size")``)."""
    try:
        yield
    except ParameterError as exc:
        if exc.param not in names:
            raise
        raise exc.renamed(names[exc.param]) from exc
