"""The command line's errors: a core ``ParameterError`` names the command's own option, not the Python parameter."""

from __future__ import annotations

from typing import Any

import click

from retrieval.errors import ParameterError


def option_flag(command: click.Command, param: str) -> str | None:
    """The long flag (``--memory-size``) of ``command``'s option whose destination is ``param``, if it has one."""
    for option in command.params:
        if option.name == param and isinstance(option, click.Option):
            flags = [flag for flag in option.opts if flag.startswith("--")]
            return flags[0] if flags else option.opts[0]
    return None


class OptionCommand(click.Command):
    """A command whose ``ParameterError``s name its option (``--memory-size must be >= 1``)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ParameterError as exc:
            flag = option_flag(self, exc.param)
            if flag is None:
                raise
            raise click.ClickException(f"{flag} {exc.problem}") from exc


class OptionGroup(click.Group):
    """A group whose commands and subgroups are ``OptionCommand``s and ``OptionGroup``s."""

    command_class = OptionCommand
    group_class = type  # subgroups are of this group's own class
