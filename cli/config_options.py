"""Click options made from the options a dataclass declares (``retrieval.options``): an option's name, type, default,
help, choices and range are written once there. The docs' tables of them are ``doc_tables``'s.
"""

from __future__ import annotations

import ast
import functools
import json
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import click

from retrieval.cli.help_text import (
    LazyHelpOption,
    augmentation_help,
    backbone_names,
    dataset_names,
    listing,
    loss_names,
    negatives_names,
)
from retrieval.options import DeclaredOption, declared_options, field_problem, hint_members

F = TypeVar("F", bound=Callable)

# a declaration's ``listing`` -> the text that lists the registry's names, computed when --help shows it
LISTINGS: dict[str, Callable[[], str]] = {
    "datasets": lambda: listing(dataset_names),
    "backbones": lambda: listing(backbone_names),
    "losses": lambda: listing(loss_names),
    "negatives": lambda: listing(negatives_names),
    "augmentations": augmentation_help,
}


def parse_params(pairs: Iterable[str], option: str) -> dict[str, Any]:
    """``key=value`` pairs; values are Python/JSON literals when they parse (0.1, true, "x"), else strings."""
    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint=option)
        value: Any = raw
        for parse in (json.loads, ast.literal_eval):
            try:
                value = parse(raw)
                break
            except (ValueError, SyntaxError):
                continue
        params[key.replace("-", "_")] = value
    return params


def float_pair(ctx: click.Context, param: click.Parameter, value: str | None) -> list[float] | None:
    """Click callback: ``"0.35,1"`` -> ``[0.35, 1.0]``; anything but two numbers is a usage error."""
    if value is None:
        return None
    parts = value.split(",")
    try:
        if len(parts) != 2:
            raise ValueError
        return [float(part) for part in parts]
    except ValueError:
        raise click.BadParameter(f"expected MIN,MAX (two numbers with a comma, e.g. 0.35,1), got {value!r}",
                                 ctx=ctx, param=param) from None


class NumberOrWord(click.ParamType):
    """A number, or one of the words an option allows besides numbers (``--wise-alpha auto``)."""

    name = "number-or-word"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """A float when ``value`` reads as one, else the word as it is."""
        try:
            return float(value)
        except (TypeError, ValueError):
            return value  # the config's check names a word it does not allow


def default_text(declared: DeclaredOption) -> str | None:
    """The default as --help and the docs show it, or None when there is nothing to show."""
    shown = declared.spec.default_text
    if shown is not None:
        return shown() if callable(shown) else shown
    value = declared.default
    if value is None or value == [] or value == {} or value == ():
        return None
    if isinstance(value, bool):
        return declared.flag if value else f"--no-{declared.flag[2:]}" if declared.spec.negatable else None
    return str(value)


def _default_suffix(declared: DeclaredOption) -> str:
    shown = default_text(declared)
    return f" [default: {shown}]" if shown else ""


class DeclaredClickOption(LazyHelpOption):
    """A click option made from a declaration, which it keeps (``declared``): the docs' tables and the tests read
    which declaration each option of a command comes from."""

    def __init__(self, param_decls: Any, *, declared: DeclaredOption, **attrs: Any) -> None:
        super().__init__(param_decls, **attrs)
        self.declared = declared


def click_option(declared: DeclaredOption, *aliases: str, help: str | None = None, default: Any = None,
                 checked: bool = False, callback: Callable | None = None, dest: str | None = None,
                 case_sensitive: bool = True) -> Callable:
    """The click option of one declared option; ``aliases`` are further flags, ``help`` and ``default`` replace
    the declaration's where another command gives the option another meaning of "not given"; ``checked``: click
    checks the value against the declaration (for a command whose values reach no config that checks them);
    ``callback``: the command's own check or conversion of the value instead (``4G`` -> bytes); ``dest``: the name
    the command receives it by, instead of the declaration's; ``case_sensitive``: False accepts a choice in any
    case (``--format NPY``)."""
    spec, flag = declared.spec, declared.flag
    members = [m for m in hint_members(declared.hint) if m is not type(None)]
    origins = [typing.get_origin(m) or m for m in members]
    attrs: dict[str, Any] = {"default": default, "metavar": spec.metavar}
    if spec.required:
        attrs["required"] = True
    decls = [flag, *aliases]
    if members == [bool]:
        if spec.negatable:
            decls = [f"{flag}/--no-{flag[2:]}", *aliases]
        else:
            attrs.update(is_flag=True)
        attrs.pop("metavar")
    elif origins == [dict]:
        attrs.update(multiple=True)
    elif origins == [list] and typing.get_args(members[0]) == (str,):
        attrs.update(multiple=True)
    elif origins == [tuple] and typing.get_args(members[0]) == (str, ...):
        attrs.update(multiple=True)
    elif origins == [list]:
        attrs.update(callback=float_pair)
    elif set(members) == {float, str}:
        attrs.update(type=NumberOrWord())
    elif spec.choices is not None and spec.metavar is None:  # with a metavar, the help lists them instead
        attrs.update(type=click.Choice([str(c) for c in spec.allowed() or () if isinstance(c, str)],
                                       case_sensitive=case_sensitive))
        attrs.pop("metavar")
    elif spec.path is not None:
        attrs.update(type=click.Path(exists=spec.exists, dir_okay=spec.path != "file", file_okay=spec.path != "dir",
                                     path_type=Path if members[0] is Path else None))
    elif members and members[0] in (int, float):
        attrs.update(type=members[0])
    if callback is not None:
        attrs["callback"] = callback
    elif checked and "callback" not in attrs:
        attrs["callback"] = functools.partial(_checked, declared)

    def text() -> str:
        if help is not None:
            return help
        sentence = spec.help_text()
        if spec.listing is not None:
            sentence += f" Choices: {LISTINGS[spec.listing]()}."
        return sentence + _default_suffix(declared)

    # a help that names facts of modules not loaded to start (a registry: torch; the decoder) is made when shown
    lazy = help is None and (spec.listing is not None or callable(spec.help) or callable(spec.default_text))
    return click.option(*decls, dest or declared.dest, cls=DeclaredClickOption, declared=declared,
                        help=None if lazy else text(), help_text=text, **attrs)


def config_options(cls: type) -> list[Callable]:
    """The click options of every option ``cls`` declares on the command line, in declaration order (those
    declared ``command_line=False`` are the command's own to declare and convert)."""
    return [click_option(declared) for declared in declared_options(cls) if declared.spec.command_line]


def prefixed_options(cls: type, prefix: str) -> list[Callable]:
    """``config_options(cls)`` whose values reach the command as ``prefix + field`` (a command with options of its own
    by those names: ``retrieval search``'s ``-k`` and ``--rerank-k``); ``prefixed_values`` reads them back."""
    return [click_option(declared, dest=prefix + declared.name)
            for declared in declared_options(cls) if declared.spec.command_line]


def prefixed_values(cls: type, prefix: str, options: dict[str, Any]) -> dict[str, Any]:
    """The ``prefixed_options`` given on the command line (removed from ``options``) as ``cls``'s field values."""
    values = {declared.name: options.pop(prefix + declared.name, None) for declared in declared_options(cls)}
    return {name: value for name, value in values.items() if value is not None}


def declaration(cls: type, name: str) -> DeclaredOption:
    """The declared option ``name`` of ``cls``."""
    found = {d.name: d for d in declared_options(cls)}
    if name not in found:
        raise KeyError(f"{cls.__name__} declares no option {name!r}")
    return found[name]


def shared_option(cls: type, name: str, *aliases: str, help: str | None = None, default: Any = None) -> Callable:
    """Option ``name`` of ``cls`` on another command (``evaluate --eval-limit``), with that command's help."""
    declared = declaration(cls, name)
    # no config checks it on this command: its declared range is checked as the value is read
    return click_option(declared, *aliases, help=help, default=default, checked=bool(declared.spec.range_text()))


def command_option(cls: type, name: str, *, callback: Callable | None = None, case_sensitive: bool = True
                   ) -> Callable:
    """Option ``name`` of ``cls`` on a command that has no config (``retrieval index ...``): the declared default
    when it is not given, its declared range and choices checked as the value is read (``callback``: the command's
    own check or conversion instead)."""
    declared = declaration(cls, name)
    return click_option(declared, default=declared.default, checked=True, callback=callback,
                        case_sensitive=case_sensitive)


def command_options(cls: type, *names: str) -> Callable[[F], F]:
    """A decorator that puts ``command_option`` of each of ``names`` on a command, the first one first in --help."""
    options = [command_option(cls, name) for name in names]

    def decorate(func: F) -> F:
        for made in reversed(options):
            func = made(func)
        return func

    return decorate


def _checked(declared: DeclaredOption, ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Click callback: ``value`` within the option's declared range (the problem named as click names options)."""
    problem = None if value is None else field_problem(declared, value)
    if problem is not None:
        raise click.BadParameter(problem.removeprefix(f"{declared.flag} "), ctx=ctx, param=param)
    return value


def option_values(cls: type, file_values: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """The options given on the command line as ``cls``'s field values: a table's KEY=VALUE pairs join the config
    file's table, a repeatable option not given leaves the file's list, an option not given is left out."""
    values = {}
    for declared in declared_options(cls):
        value = options.get(declared.name)
        if value is None or value == ():
            continue
        if isinstance(declared.default, dict):
            value = {**file_values.get(declared.name, {}), **parse_params(value, declared.flag)}
        elif isinstance(value, tuple) and not isinstance(declared.default, tuple):  # a tuple field keeps its tuple
            value = list(value)
        values[declared.name] = value
    return values
