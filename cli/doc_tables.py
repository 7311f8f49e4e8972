"""The docs' reference tables of the declared options (``retrieval.options``), written between markers into the
documents (``make docs``; a test checks they are current).

Two kinds of tables: a config's (``reference_tables``: training, serving, re-ranking; a row per field, with its
config key) and a family of commands' (``command_tables``: the gallery commands, analyze; a row per declaration,
with the commands that take it, read from the command line itself). So this module sits above the command line: it
imports ``main`` and the commands, and none of them imports it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import click

from retrieval.cli.config_options import DeclaredClickOption, default_text
from retrieval.options import DeclaredOption, declared_options, hint_members, type_name


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
    from retrieval.train.text_config import TextTrainConfig

    return [("docs/TRAINING.md", "options", TrainConfig), ("docs/SERVING.md", "serve-options", ServerConfig),
            ("docs/INDEX.md", "rerank-options", RerankConfig), ("docs/TEXT.md", "text-options", TextTrainConfig)]


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

    print("wrote " + ", ".join(write_references(sys.argv[1] if len(sys.argv) > 1 else ".")))
