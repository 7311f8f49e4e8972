"""The command lines the docs show, parsed by the real command line without running them (the README's test and
the docs' code-block test)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import click


@contextlib.contextmanager
def paths_need_not_exist() -> Iterator[None]:
    """click's path options take paths that do not exist here (a page's ``/data/CUB_200_2011``, ``INDEX_DIR``, or
    what an earlier command of the page would have made): the option's name and kind are still checked."""
    convert = click.Path.convert

    def lenient(self: click.Path, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        relaxed = copy.copy(self)
        relaxed.exists = False
        return convert(relaxed, value, param, ctx)

    click.Path.convert = lenient
    try:
        yield
    finally:
        click.Path.convert = convert


def command_context(args: list[str]) -> click.Context:
    """``retrieval ARGS`` parsed the way the command line parses it (the group's options, each subcommand's name,
    then the command's options, values and callbacks) without running the command; a wrong name or option raises
    click's UsageError. A training command's options must also make a valid training configuration."""
    from retrieval.cli.config_options import option_values
    from retrieval.cli.main import main
    from retrieval.train.config import TrainConfig

    command: click.Command = main
    context = None
    rest, name = list(args), "retrieval"
    with paths_need_not_exist():
        while isinstance(command, click.Group):
            context = command.make_context(name, rest, parent=context)
            rest = [*context._protected_args, *context.args]
            if not rest:
                return context
            name, found, rest = command.resolve_command(context, rest)
            command = found
        context = command.make_context(name, rest, parent=context)
    if command.name == "train" and not context.params.get("config_file"):
        TrainConfig(**option_values(TrainConfig, {}, context.params))
    return context
