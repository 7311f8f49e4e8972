"""The command line's errors: a core ``ParameterError`` names the command's own option, not the Python parameter.

A core message that names another of its parameters writes it in backticks (``rerun with `index_key` auto``); a
command shows each such name that is one of its options as the option (``rerun with --index-key auto``), in a
``ParameterError``'s problem and in the text of the other errors a command line expects (missing or existing
files, bad values, failures it explains). A command that needs an extra that is not installed (``retrieval.extras``)
says which one, in one line.
"""

from __future__ import annotations

import re
from typing import Any

import click

from retrieval.errors import ParameterError
from retrieval.extras import defining_module, extra_of_module, has_extra, missing_extra_message, require_extra


def option_flag(command: click.Command, param: str) -> str | None:
    """The long flag (``--memory-size``) of ``command``'s option whose destination is ``param``, if it has one."""
    for option in command.params:
        if option.name == param and isinstance(option, click.Option):
            flags = [flag for flag in option.opts if flag.startswith("--")]
            return flags[0] if flags else option.opts[0]
    return None


BACKTICKED_NAME = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)`")


def option_text(command: click.Command, text: str) -> str:
    """``text`` with each backticked parameter name that is one of ``command``'s options shown as the option."""
    return BACKTICKED_NAME.sub(lambda match: option_flag(command, match.group(1)) or match.group(0), text)


def option_message(command: click.Command, exc: BaseException) -> str:
    """What ``command`` says for ``exc``: a ``ParameterError`` names the option, and so does every backticked name."""
    if isinstance(exc, ParameterError):
        flag = option_flag(command, exc.param)
        return f"{flag or exc.param} {option_text(command, exc.problem)}"
    return option_text(command, str(exc))


def where_problem(exc: BaseException) -> str:
    """A filter error's text for ``Invalid value for '--where': ...`` (the option names it, so not ``where:``)."""
    return str(exc).removeprefix("where: ")


def bad_where(command: click.Command, exc: BaseException) -> click.Parameter | None:
    """``command``'s ``--where`` option when ``exc`` is a filter error (an unknown column is known only once the
    index is open), else None."""
    if not isinstance(exc, ValueError):
        return None
    from retrieval.index.filters import FilterError  # only once a ValueError happened: NumPy stays out of --help

    if not isinstance(exc, FilterError):
        return None
    return next((p for p in command.params if p.name == "where" and isinstance(p, click.Option)), None)


class OptionCommand(click.Command):
    """A command whose ``ParameterError``s name its option (``--memory-size must be >= 1``), and that names the extra
    it lacks: ``needs`` (``@main.command("train", needs="train")``) is checked before it runs, and a module of any
    extra found missing while it runs is reported the same way."""

    def __init__(self, *args: Any, needs: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.needs = needs  # the extra (retrieval.extras) the command cannot start without

    def format_help_text(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The help text, then, when the command's extra is missing, what to install."""
        super().format_help_text(ctx, formatter)
        if self.needs is not None and not has_extra(self.needs):
            with formatter.indentation():
                formatter.write_paragraph()
                formatter.write_text(missing_extra_message("This command", defining_module(self.needs)) + ".")

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; its core errors name this command's options, a missing extra names the extra."""
        try:
            if self.needs is not None:
                require_extra(self.needs, ctx.command_path)
            return super().invoke(ctx)
        except ModuleNotFoundError as exc:
            if extra_of_module(exc.name) is None:  # not an optional part: a broken install, shown as it is
                raise
            raise click.ClickException(missing_extra_message(ctx.command_path, exc.name)) from exc
        except ParameterError as exc:
            flag = option_flag(self, exc.param)
            if flag is None and option_text(self, exc.problem) == exc.problem:
                raise
            raise click.ClickException(option_message(self, exc)) from exc
        except (ValueError, OSError, RuntimeError) as exc:
            where = bad_where(self, exc)
            if where is not None:
                # a filter naming a column the index lacks is as bad a value as one that does not parse
                raise click.BadParameter(where_problem(exc), ctx=ctx, param=where) from exc
            # the other errors the command line shows as one line: only those naming an option in backticks change
            if not exc.args or not isinstance(exc.args[0], str) or option_text(self, str(exc)) == str(exc):
                raise
            raise click.ClickException(option_text(self, str(exc))) from exc


class OptionGroup(click.Group):
    """A group whose commands and subgroups are ``OptionCommand``s and ``OptionGroup``s."""

    command_class = OptionCommand
    group_class = type  # subgroups are of this group's own class
