"""An option declared once: a dataclass field whose metadata says everything the command line, the config file,
the checks and the docs need (no torch, no click).

``TrainConfig``'s and ``ServerConfig``'s fields are declared with ``option(default, section, help, ...)``. From
that one declaration: the config file's keys are the field names, ``field_problem`` checks a value's type,
choices and range, ``retrieval.cli.config_options`` makes the click options and the Markdown reference table.
The commands that have no config file (``retrieval index ...``, ``analyze``, ``audit``) declare their options the
same way, in a dataclass per family of commands whose fields are only declarations (``retrieval.cli.index_options``).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# what a command's --model and --checkpoint help says: an attacker's file is not data (docs/SECURITY.md)
TRUSTED_MODEL = "A model is trusted input: load only models you built or trust (docs/SECURITY.md)."
TRUSTED_CHECKPOINT = ("A checkpoint is trusted input: loading one runs its code (a pickle); load only checkpoints you "
                      "made or trust (docs/SECURITY.md).")
# every command that reads a manifest's labels (index build, train, evaluate, text train) says --label-column so
LABEL_COLUMN_HELP = ("the manifest column that holds each image's class, e.g. category (a manifest without a 'label' "
                     "column: the command names the column that looks like one).")

OPTION_KEY = "option"  # the key of a field's metadata that holds its OptionSpec
REQUIRED: Any = dataclasses.MISSING  # option(REQUIRED, ...): a field that has no default


@dataclass(frozen=True)
class OptionSpec:
    """What an option is, beyond its name, type and default (the dataclass field has those)."""

    section: str  # the heading it appears under in --help and the docs
    # one sentence for people, without the default (that is shown from the field); or a function that makes it when
    # --help shows it, for a text that names facts of modules the command line does not load to start (the decoder's
    # image formats)
    help: str | Callable[[], str]
    choices: Sequence[Any] | Callable[[], Sequence[str]] | None = None  # allowed values, checked (no torch)
    listing: str | None = None  # a registry whose names help lists (checked when the run is built: needs torch)
    low: float | None = None  # lowest allowed value
    high: float | None = None  # highest allowed value
    low_open: bool = False  # low itself not allowed
    high_open: bool = False  # high itself not allowed
    unit: str = ""  # what a number counts, said in messages ("optimizer steps")
    metavar: str | None = None
    flag: str | None = None  # the command-line flag when it is not --field-name
    # the name the command receives the value by when it is not the field's: several declarations of one flag
    # (each command's --model means its own model) reach their commands under the same parameter name
    dest: str | None = None
    path: str | None = None  # "file", "dir" or "any" (either): the value is a path of that kind
    exists: bool = False  # a path that must exist, checked as the command line reads it
    required: bool = False  # the command refuses to run without it (a config's REQUIRED field may have a default)
    negatable: bool = True  # a boolean shows --x/--no-x; False: only --x
    # what the default means when the value alone does not say it; a function: made when shown (as ``help``)
    default_text: str | Callable[[], str] | None = None
    # False: no click option is made from the declaration; the command declares ``flag`` itself, in the form a person
    # gives it (a file that holds a secret, MiB for bytes), and converts that into the field
    command_line: bool = True

    def help_text(self) -> str:
        """The help sentence (made now when it is declared as a function)."""
        return self.help() if callable(self.help) else self.help

    def allowed(self) -> list[Any] | None:
        """The allowed values, or None when any value of the type is allowed."""
        if self.choices is None:
            return None
        return list(self.choices() if callable(self.choices) else self.choices)

    def range_text(self) -> str:
        """The range as people write it: ``>= 1``, ``in (0, 1]``; empty when unbounded."""
        if self.low is not None and self.high is not None:
            return (f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
                    f"{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_number(self.high)}"
        return ""


def option(default: Any = None, section: str = "", help: str | Callable[[], str] = "", *,
           factory: Callable[[], Any] | None = None, **spec: Any) -> Any:
    """A dataclass field declared as an option (``OptionSpec``'s fields as keywords)."""
    metadata = {OPTION_KEY: OptionSpec(section=section, help=help, **spec)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class DeclaredOption:
    """One declared option: the field's name, type hint and default, and its spec."""

    name: str
    hint: Any
    default: Any
    spec: OptionSpec

    @property
    def flag(self) -> str:
        """The command-line flag."""
        return self.spec.flag or "--" + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        """The name the command receives the value by."""
        return self.spec.dest or self.name


@functools.cache
def declared_options(cls: type) -> tuple[DeclaredOption, ...]:
    """The options of dataclass ``cls``, in declaration order; every field must be declared with ``option``."""
    hints = typing.get_type_hints(cls)
    found = []
    for field in dataclasses.fields(cls):
        spec = field.metadata.get(OPTION_KEY)
        if spec is None:
            raise TypeError(f"{cls.__name__}.{field.name} is not declared with option()")
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:  # REQUIRED: the option's default_text says what a command does without it
            default = None
        found.append(DeclaredOption(field.name, hints[field.name], default, spec))
    return tuple(found)


def hint_members(hint: Any) -> tuple[Any, ...]:
    """The types a hint allows: ``int | None`` -> ``(int, NoneType)``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


_TYPE_WORDS = {int: ("int", "a whole number"), float: ("float", "a number"), str: ("str", "a string"),
               bool: ("bool", "true or false"), Path: ("path", "a path")}


def type_name(hint: Any, words: bool = False) -> str:
    """The type as the docs say it (``int or None`` -> ``int``; ``list[str]`` -> ``list of str``), or as a phrase
    for messages (``a whole number``) when ``words``."""
    names = []
    for member in hint_members(hint):
        origin = typing.get_origin(member)
        if member is type(None):
            continue
        if origin is list or (origin is tuple and typing.get_args(member)[1:] == (...,)):  # tuple[str, ...] too
            item = typing.get_args(member)[0]
            plural = {str: "strings", int: "numbers", float: "numbers"}.get(item, f"{type_name(item)} values")
            names.append(f"a list of {plural}" if words else f"list of {type_name(item)}")
        elif origin is tuple:
            names.append(f"({', '.join(type_name(part) for part in typing.get_args(member))})")
        elif origin is dict or member is dict:
            names.append("a table of KEY = VALUE" if words else "table")
        else:
            name, phrase = _TYPE_WORDS.get(member, (getattr(member, "__name__", str(member)),) * 2)
            names.append(phrase if words else name)
    return " or ".join(names)


def matches(hint: Any, value: Any) -> bool:
    """Whether ``value`` has the type ``hint`` declares (a bool is not a number; an int is a float)."""
    for member in hint_members(hint):
        origin = typing.get_origin(member)
        if member is Any:
            return True
        if member is type(None):
            ok = value is None
        elif member is bool:
            ok = isinstance(value, bool)
        elif member is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif member is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif origin is list:
            ok = isinstance(value, list) and all(matches(typing.get_args(member)[0], item) for item in value)
        elif origin is tuple:
            args = typing.get_args(member)
            items = args[:1] * len(value) if args[1:] == (...,) and isinstance(value, tuple) else args
            ok = isinstance(value, tuple) and len(value) == len(items) and all(map(matches, items, value))
        elif origin is dict or member is dict:
            ok = isinstance(value, dict)
        else:
            ok = isinstance(value, member)
        if ok:
            return True
    return False


def field_problem(option: DeclaredOption, value: Any) -> str | None:
    """What is wrong with ``value`` for ``option`` alone (type, choices, range), naming its flag; None if nothing."""
    spec, flag = option.spec, option.flag
    if not matches(option.hint, value):
        members = [m for m in hint_members(option.hint) if m is not type(None)]
        # a list, or a number that a word may replace (ALPHA|auto): the metavar says the shape
        shaped = spec.metavar is not None and (len(members) > 1 or typing.get_origin(members[0]) is list)
        if shaped and len(members) > 1:
            return f"{flag} must be {spec.metavar}, got {value!r}"
        shape = f"{spec.metavar}, " if shaped else ""
        return f"{flag} must be {shape}{type_name(option.hint, words=True)}, got {value!r}"
    allowed = spec.allowed()
    if allowed is not None and value is not None and value not in allowed:
        shown = [str(choice) for choice in allowed if isinstance(choice, str)] or [str(c) for c in allowed]
        return f"{flag} must be one of {', '.join(shown)}, got {value!r}"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and spec.range_text() \
            and not _in_range(spec, value):
        unit = f" {spec.unit}" if spec.unit else ""
        return f"{flag} must be {spec.range_text()}{unit}, got {value!r}"
    return None


def _in_range(spec: OptionSpec, value: float) -> bool:
    if spec.low is not None and (value < spec.low or (spec.low_open and value == spec.low)):
        return False
    if spec.high is not None and (value > spec.high or (spec.high_open and value == spec.high)):
        return False
    return value == value  # NaN is in no range


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
