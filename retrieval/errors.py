"""The core's error for a bad argument: it names the function's own parameter, and callers translate the name.

A core function knows its parameters (a loss's ``size``), not the option a command line or a config file fed into
it (``--memory-size``). It raises ``ParameterError(param, problem)``; the layer that passed the value under another
name re-raises with ``renamed``, and the command line shows the option (``retrieval.cli.errors``).
"""

from __future__ import annotations

import contextlib
import re
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


BACKTICKED = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)`")


def with_names(text: str, names: dict[str, str]) -> str:
    """``text`` with each backticked parameter in ``names`` written as the caller names it: a plain name in
    backticks, or the caller's own text when it holds backticks itself (``"`batch_size` / `per_class`"``)."""

    def caller(match: re.Match) -> str:
        name = names.get(match.group(1))
        if name is None:
            return match.group(0)
        return name if "`" in name else f"`{name}`"

    return BACKTICKED.sub(caller, text)


@contextlib.contextmanager
def parameters_named(**names: str) -> Iterator[None]:
    """Inside, the core's errors speak of the caller's names: a ``ParameterError`` about a parameter in ``names`` is
    raised again under the caller's name (``parameters_named(size="memory_size")``), and each backticked parameter
    in ``names`` that its text (or a plain ValueError's) mentions is renamed too."""
    try:
        yield
    except ParameterError as exc:
        param = names.get(exc.param, exc.param)
        if "`" in param:
            param = exc.param
        problem = with_names(exc.problem, names)
        if (param, problem) == (exc.param, exc.problem):
            raise
        raise ParameterError(param, problem) from exc
    except ValueError as exc:
        text = str(exc)
        if type(exc) is not ValueError or with_names(text, names) == text:
            raise
        raise ValueError(with_names(text, names)) from exc
