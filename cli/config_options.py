"""Click options and the docs' reference tables, made from the options a dataclass declares (``retrieval.options``):
an option's name, type, default, help, choices and range are written once there.

Two kinds of tables: a config's (``reference_tables``: training, serving, re-ranking; a row per field, with its
config key) and a family of commands' (``command_tables``: the gallery commands, analyze; a row per declaration,
with the commands that take it, read from the command line itself).
"""

from __future__ import annotations

import ast
import functools
import json
import os
import typing
from collections.abc import Callable, Iterable, Iterator
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
from retrieval.options import DeclaredOption, declared_options, field_problem, hint_members, type_name

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


def options_markdown(cls: type) -> str:
    """The reference table of ``cls``'s options, one Markdown table per section (what the docs show)."""
    lines: list[str] = []
    section = None
    for declared in declared_options(cls):
        spec = declared.spec
        if spec.section != section:
            section = spec.section
            lines += ["", f"#### {section}", "", "| option | config key | type | default | allowed | what it does |",
                      "| --- | --- | --- | --- | --- | --- |"]
        shown = str(declared.default).lower() if isinstance(declared.default, bool) and \
            declared.spec.default_text is None else default_text(declared)
        cells = [f"`{declared.flag}`", f"`{declared.name}`", type_name(declared.hint), shown and f"{shown}",
                 _allowed_text(declared), spec.help_text()]
        lines.append(_row(cells))
    return "\n".join(lines[1:]) + "\n"


def _allowed_text(declared: DeclaredOption) -> str:
    """The docs' "allowed" cell: the choices, the registry the names come from, or the range."""
    spec = declared.spec
    allowed = spec.allowed()
    if allowed is not None:
        return ", ".join(f"`{c}`" for c in allowed if isinstance(c, str))
    if spec.listing is not None:
        return f"registered {spec.listing}"
    return (spec.range_text() + (f" {spec.unit}" if spec.unit else "")).strip()


def _row(cells: list[str | None]) -> str:
    return "| " + " | ".join((cell or "").replace("|", "\\|") for cell in cells) + " |"


def markers(name: str = "options") -> tuple[str, str]:
    """The two lines of a document between which the reference table of ``name`` goes."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


MARKERS = markers()


def with_reference(document: str, table: str, name: str = "options") -> str:
    """``document`` with ``table`` between the two markers of ``name`` (which must be there, in order)."""
    start_line, end_line = markers(name)
    start, end = document.find(start_line), document.find(end_line)
    if start < 0 or end < start:
        raise ValueError(f"the document has no {start_line} ... {end_line} block for the {name} table")
    return document[:start + len(start_line)] + "\n" + table + document[end:]


def reference_tables() -> list[tuple[str, str, type]]:
    """Each generated reference table: (document under the repository, marker name, the declaring config)."""
    from retrieval.rerank import RerankConfig
    from retrieval.serve.config import ServerConfig
    from retrieval.train.config import TrainConfig

    return [("docs/TRAINING.md", "options", TrainConfig), ("docs/SERVING.md", "serve-options", ServerConfig),
            ("docs/INDEX.md", "rerank-options", RerankConfig)]


def command_tables() -> list[tuple[str, str, tuple[type, ...]]]:
    """Each generated table of a family of commands' options: (document under the repository, marker name, the
    classes that declare them)."""
    from retrieval.cli.analyze import AnalyzeOptions
    from retrieval.cli.curation import CurationOptions
    from retrieval.cli.index_options import IndexOptions
    from retrieval.gallery_option import GalleryRoot
    from retrieval.near_duplicates import DuplicateCheck

    return [("docs/INDEX.md", "index-options", (IndexOptions, GalleryRoot, DuplicateCheck, CurationOptions)),
            ("docs/LOSSES.md", "analyze-options", (AnalyzeOptions,))]


def declared_params(command: click.Command, path: tuple[str, ...] = ()) -> Iterator[tuple[str, DeclaredClickOption]]:
    """(command path, option) of every option made from a declaration, in ``command`` and its subcommands."""
    for param in command.params:
        if isinstance(param, DeclaredClickOption):
            yield " ".join(path), param
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from declared_params(sub, (*path, name))


def commands_markdown(classes: tuple[type, ...], cli: click.Command, document: str) -> str:
    """The table of a family of commands' options: a row per declaration of ``classes``, under its section, with the
    commands of ``cli`` that take it; then the options those commands take from another table (``document``: where
    the table goes, for the links)."""
    # a declaration is its OptionSpec object: every option made from it keeps that one object
    users: dict[int, tuple[DeclaredOption, set[str]]] = {}
    for path, param in declared_params(cli):
        users.setdefault(id(param.declared.spec), (param.declared, set()))[1].add(path)
    ours = [declared for cls in classes for declared in declared_options(cls)]
    sections: dict[str, list[str]] = {}
    for declared in ours:
        paths = users.get(id(declared.spec), (declared, set()))[1]
        sections.setdefault(declared.spec.section, []).append(_row([
            f"`{declared.flag}`", ", ".join(f"`{path}`" for path in sorted(paths)), _type_text(declared),
            _command_default(declared), _allowed_text(declared), declared.spec.help_text()]))
    lines: list[str] = []
    for section, rows in sections.items():
        lines += ["", f"#### {section}", "", "| option | commands | type | default | allowed | what it does |",
                  "| --- | --- | --- | --- | --- | --- |", *rows]
    own = {id(declared.spec) for declared in ours}
    family = set().union(*(paths for key, (_declared, paths) in users.items() if key in own))
    others = sorted(((declared, sorted(paths & family)) for key, (declared, paths) in users.items()
                     if key not in own and paths & family), key=lambda item: item[0].flag)
    if others:
        shown = [f"`{declared.flag}` ({', '.join(f'`{path}`' for path in paths)}; {_table_of(declared, document)})"
                 for declared, paths in others]
        lines += ["", f"Options these commands take from another table: {', '.join(shown)}."]
    return "\n".join(lines[1:]) + "\n"


def _type_text(declared: DeclaredOption) -> str:
    """A command table's "type" cell: the kind of path, ``flag`` for an option given alone, else the type."""
    spec = declared.spec
    if spec.path is not None:
        return {"file": "file", "dir": "folder"}.get(spec.path, "path")
    if hint_members(declared.hint) == (bool,) and not spec.negatable:
        return "flag"
    return type_name(declared.hint)


def _command_default(declared: DeclaredOption) -> str:
    """A command table's "default" cell: ``required``, or the default shown by --help."""
    return "required" if declared.spec.required else default_text(declared) or ""


def _table_of(declared: DeclaredOption, document: str) -> str:
    """Where the config table that declares ``declared`` is, seen from ``document``: a link and the section."""
    for relative, _name, cls in reference_tables():
        if any(d.spec is declared.spec for d in declared_options(cls)):
            if relative == document:
                return f"this page, {declared.spec.section}"
            link = os.path.relpath(relative, os.path.dirname(document))
            return f"[{Path(relative).name}]({link}), {declared.spec.section}"
    raise ValueError(f"no table documents {declared.flag} ({declared.spec.section}): declare it in a family's class")


def write_references(root: str) -> list[str]:
    """Write every reference table into its document under ``root``; returns the documents written."""
    from retrieval.cli.main import main

    tables = [(relative, name, options_markdown(cls)) for relative, name, cls in reference_tables()]
    tables += [(relative, name, commands_markdown(classes, main, relative))
               for relative, name, classes in command_tables()]
    for relative, name, table in tables:
        document = Path(root) / relative
        document.write_text(with_reference(document.read_text(), table, name))
    return list(dict.fromkeys(relative for relative, _name, _table in tables))


if __name__ == "__main__":
    import sys

    # the module itself, not this __main__ copy: the commands' options are of its DeclaredClickOption class
    from retrieval.cli.config_options import write_references as write

    print("wrote " + ", ".join(write(sys.argv[1] if len(sys.argv) > 1 else ".")))
