"""Metadata filters: the ``where`` expression of a search, parsed here and evaluated over column arrays.

The language is a small SQL-like one over the catalogue's columns (``id``, ``path``, ``label``, ``split`` and a
manifest's extra columns)::

    label = "cat" and price < 20
    split in ("test", "val") or not (label != 'dog')

Comparisons ``= != < <= > >=`` (``<>`` is ``!=``, as in SQL), ``in (...)`` and ``not in (...)``, ``and``, ``or``,
``not``, parentheses, string literals in single or double quotes (a quote doubled inside is one quote) and numbers.
Keywords are case-insensitive, column names are not. The text is parsed by this module into a tree and evaluated
with NumPy: it never reaches SQL or ``eval``. A missing value (no label, no such column in a row) makes a
comparison unknown, and unknown rows never match, as in SQL: ``label != "cat"`` leaves out unlabelled images, and
so does ``not (label = "cat")``.

The contract: ``parse_filter(text)`` -> ``Filter`` or ``FilterError`` naming the problem and where it is (and,
for another language's ``== && || !``, the word to write instead);
``Filter.mask(columns)`` -> bool array over the columns' rows. Sizes are bounded before any work (the text's
length, the nesting depth, the values of one ``in``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

MAX_FILTER_CHARS = 4000
MAX_DEPTH = 32  # nested parentheses / not
MAX_IN_VALUES = 1000
MAX_TERMS = 200  # comparisons in one expression

KEYWORDS = ("and", "or", "not", "in")


class FilterError(ValueError):
    """A ``where`` expression that cannot be parsed or does not fit the index's columns."""


# --- columns ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Column:
    """One column over the rows: numbers (float64, NaN = missing) or strings (codes into sorted ``categories``,
    -1 = missing), so that an ordered comparison of strings is one comparison of codes."""

    values: np.ndarray  # float64 [n] for numbers; int32 codes [n] for strings
    categories: np.ndarray | None = None  # sorted unique strings (object array) for a string column

    @property
    def is_text(self) -> bool:
        return self.categories is not None

    @classmethod
    def of_numbers(cls, values: np.ndarray) -> Column:
        return cls(np.asarray(values, dtype=np.float64))

    @classmethod
    def of_strings(cls, values: list[str | None]) -> Column:
        """A string column from Python values (None = missing)."""
        present = sorted({v for v in values if v is not None})
        categories = np.array(present, dtype=object)
        lookup = {v: i for i, v in enumerate(present)}
        return cls(np.fromiter((lookup.get(v, -1) if v is not None else -1 for v in values), dtype=np.int32,
                               count=len(values)), categories)

    def known(self) -> np.ndarray:
        return self.values >= 0 if self.is_text else ~np.isnan(self.values)


def infer_column(values: list[object]) -> Column:
    """Numbers when every present value is a number (or text that reads as a finite one), else strings."""
    numbers = np.full(len(values), np.nan)
    for i, value in enumerate(values):
        if value is None or value == "":
            continue
        if isinstance(value, bool):
            return Column.of_strings([None if v is None else str(v) for v in values])
        try:
            number = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return Column.of_strings([None if v is None or v == "" else str(v) for v in values])
        if not math.isfinite(number):
            return Column.of_strings([None if v is None or v == "" else str(v) for v in values])
        numbers[i] = number
    return Column.of_numbers(numbers)


# --- the tree ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Compare:
    column: str
    op: str
    value: str | float


@dataclass(frozen=True)
class InSet:
    column: str
    values: tuple[str | float, ...]
    negated: bool


@dataclass(frozen=True)
class Not:
    operand: Node


@dataclass(frozen=True)
class Both:
    left: Node
    right: Node


@dataclass(frozen=True)
class Either:
    left: Node
    right: Node


Node = Compare | InSet | Not | Both | Either


# --- tokens and parser ------------------------------------------------------------------------------------------
_TOKEN = re.compile(
    r"""\s*(?:
        (?P<number>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)
      | (?P<string>'(?:[^']|'')*'|"(?:[^"]|"")*")
      | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
      | (?P<op><=|>=|!=|<>|=|<|>)
      | (?P<punct>[(),])
    )""",
    re.VERBOSE,
)


# other languages' operators people write from habit: (what they wrote, the word this language takes instead)
_INSTEAD = {"&&": ("&&", "and"), "&": ("&", "and"), "||": ("||", "or"), "|": ("|", "or"), "!": ("!", "not")}
_EXAMPLES = {"and": 'label = "cat" and price < 20', "or": 'label = "cat" or label = "dog"',
             "not": 'not (label = "cat")', "=": 'label = "cat"'}


@dataclass(frozen=True)
class _Token:
    kind: str  # number | string | name | keyword | op | punct | end
    text: str
    at: int  # character position, for messages


def _tokens(text: str) -> list[_Token]:
    tokens, at = [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            tokens.append(_Token("end", "", at))
            return tokens
        match = _TOKEN.match(text, at)
        if match is None or match.end() == at:
            instead = _INSTEAD.get(text[at:at + 2]) or _INSTEAD.get(text[at])
            if instead is not None:
                written, word = instead
                raise FilterError(f"where: {written!r} at position {at + 1} is not part of the language; write "
                                  f"{word!r} instead, e.g. {_EXAMPLES[word]}")
            raise FilterError(f"where: unexpected character {text[at]!r} at position {at + 1}; use column names, "
                              "quoted strings, numbers, = != < <= > >=, in (...), and, or, not and parentheses")
        kind = match.lastgroup or ""
        value, start = match.group(kind), match.start(kind)
        if kind == "name" and value.lower() in KEYWORDS:
            kind, value = "keyword", value.lower()
        tokens.append(_Token(kind, "!=" if value == "<>" else value, start))
        at = match.end()


class _Parser:
    """Recursive descent: or_expr := and_expr (or and_expr)*; and_expr := unary (and unary)*;
    unary := not unary | ( or_expr ) | comparison."""

    def __init__(self, text: str) -> None:
        self.tokens, self.i, self.terms = _tokens(text), 0, 0

    @property
    def token(self) -> _Token:
        return self.tokens[self.i]

    def fail(self, wanted: str) -> FilterError:
        token = self.token
        found = "the end of the expression" if token.kind == "end" else repr(token.text)
        hint = ""
        before = self.tokens[self.i - 1] if self.i else None
        if token.kind == "op" and token.text == "=" and before is not None and before.text == "=":
            # `==` reads as `=` followed by a stray `=`: name what was meant, not only the stray sign
            hint = f"; compare with one '=', not '==', e.g. {_EXAMPLES['=']}"
        return FilterError(f"where: expected {wanted} at position {token.at + 1}, found {found}{hint}")

    def take(self, kind: str, text: str | None = None) -> _Token | None:
        token = self.token
        if token.kind == kind and (text is None or token.text == text):
            self.i += 1
            return token
        return None

    def parse(self) -> Node:
        node = self.or_expr(0)
        if self.token.kind != "end":
            raise self.fail("and, or, or the end of the expression")
        return node

    def or_expr(self, depth: int) -> Node:
        node = self.and_expr(depth)
        while self.take("keyword", "or"):
            node = Either(node, self.and_expr(depth))
        return node

    def and_expr(self, depth: int) -> Node:
        node = self.unary(depth)
        while self.take("keyword", "and"):
            node = Both(node, self.unary(depth))
        return node

    def unary(self, depth: int) -> Node:
        if depth > MAX_DEPTH:
            raise FilterError(f"where: nested deeper than {MAX_DEPTH} levels; write the expression flatter")
        if self.take("keyword", "not"):
            return Not(self.unary(depth + 1))
        if self.take("punct", "("):
            node = self.or_expr(depth + 1)
            if not self.take("punct", ")"):
                raise self.fail("')'")
            return node
        return self.comparison()

    def comparison(self) -> Node:
        name = self.take("name")
        if name is None:
            raise self.fail("a column name, 'not' or '('")
        self.terms += 1
        if self.terms > MAX_TERMS:
            raise FilterError(f"where: more than {MAX_TERMS} comparisons; use `in (...)` for lists of values")
        negated = bool(self.take("keyword", "not"))
        if self.take("keyword", "in"):
            return InSet(name.text, self.value_list(), negated)
        if negated:
            raise self.fail("'in' after 'not'")
        op = self.take("op")
        if op is None:
            raise self.fail(f"a comparison after {name.text!r} (= != < <= > >= or in)")
        return Compare(name.text, op.text, self.value())

    def value(self) -> str | float:
        token = self.take("string") or self.take("number")
        if token is None:
            raise self.fail("a quoted string or a number")
        if token.kind == "string":
            quote = token.text[0]
            return token.text[1:-1].replace(quote * 2, quote)
        number = float(token.text)
        if not math.isfinite(number):
            raise FilterError(f"where: the number at position {token.at + 1} is out of range")
        return number

    def value_list(self) -> tuple[str | float, ...]:
        if not self.take("punct", "("):
            raise self.fail("'(' after in")
        values = [self.value()]
        while self.take("punct", ","):
            values.append(self.value())
            if len(values) > MAX_IN_VALUES:
                raise FilterError(f"where: more than {MAX_IN_VALUES} values in one in (...)")
        if not self.take("punct", ")"):
            raise self.fail("',' or ')'")
        return tuple(values)


# --- evaluation -------------------------------------------------------------------------------------------------
Columns = Mapping[str, Column]
ColumnSource = Callable[[str], Column | None]  # a column by name, None if the index has no such column


@dataclass(frozen=True)
class Filter:
    """A parsed ``where`` expression."""

    text: str
    root: Node

    def columns(self) -> list[str]:
        """The column names it reads, in order of first use."""
        names: list[str] = []

        def walk(node: Node) -> None:
            if isinstance(node, (Compare, InSet)):
                if node.column not in names:
                    names.append(node.column)
            elif isinstance(node, Not):
                walk(node.operand)
            else:
                walk(node.left)
                walk(node.right)

        walk(self.root)
        return names

    def mask(self, column: ColumnSource, known_names: list[str] | None = None) -> np.ndarray:
        """Per row, whether it matches (unknown counts as no)."""
        columns: dict[str, Column] = {}
        for name in self.columns():
            found = column(name)
            if found is None:
                raise unknown_column(name, known_names)
            columns[name] = found
        true, _ = _truth(self.root, columns)
        return true


def _truth(node: Node, columns: dict[str, Column]) -> tuple[np.ndarray, np.ndarray]:
    """(rows where the node is true, rows where it is false); rows in neither are unknown (a missing value)."""
    if isinstance(node, Not):
        true, false = _truth(node.operand, columns)
        return false, true
    if isinstance(node, Both):
        (lt, lf), (rt, rf) = _truth(node.left, columns), _truth(node.right, columns)
        return lt & rt, lf | rf
    if isinstance(node, Either):
        (lt, lf), (rt, rf) = _truth(node.left, columns), _truth(node.right, columns)
        return lt | rt, lf & rf
    column = columns[node.column]
    known = column.known()
    holds = _in_set(column, node) if isinstance(node, InSet) else _compare(column, node)
    return known & holds, known & ~holds


def _check_type(column: Column, name: str, value: str | float) -> None:
    check_value_type(column.is_text, name, value)


def check_value_type(is_text: bool, name: str, value: str | float) -> None:
    """FilterError unless ``value`` is of the column's kind (text: a quoted string; numbers: a number)."""
    if is_text and not isinstance(value, str):
        raise FilterError(f"where: column {name!r} holds text; compare it with a quoted string, e.g. "
                          f"{name} = \"{value:g}\"")
    if not is_text and isinstance(value, str):
        raise FilterError(f"where: column {name!r} holds numbers; compare it with a number, not {value!r}")


def unknown_column(name: str, known_names: list[str] | None) -> FilterError:
    """The refusal of a filter naming a column the index lacks, listing those it has."""
    known = f"; the columns are: {', '.join(known_names)}" if known_names else ""
    return FilterError(f"where: no column {name!r} in this index{known}")


def _compare(column: Column, node: Compare) -> np.ndarray:
    _check_type(column, node.column, node.value)
    if column.is_text:
        # categories are sorted, so codes compare as the strings do; a value absent from them sits between two
        position = int(np.searchsorted(column.categories, node.value))
        present = position < len(column.categories) and column.categories[position] == node.value
        codes = column.values
        if node.op in ("=", "!="):
            equal = codes == position if present else np.zeros(codes.shape, dtype=bool)
            return equal if node.op == "=" else ~equal
        below = codes < position  # strictly less than the value
        return {"<": below, "<=": below | (codes == position) if present else below,
                ">": ~below & ~(codes == position) if present else ~below,
                ">=": ~below}[node.op]
    values, value = column.values, float(node.value)
    with np.errstate(invalid="ignore"):
        return {"=": values == value, "!=": values != value, "<": values < value, "<=": values <= value,
                ">": values > value, ">=": values >= value}[node.op]


def _in_set(column: Column, node: InSet) -> np.ndarray:
    for value in node.values:
        _check_type(column, node.column, value)
    if column.is_text:
        positions = np.searchsorted(column.categories, np.array(node.values, dtype=object))
        codes = [int(p) for p, v in zip(positions, node.values, strict=True)
                 if p < len(column.categories) and column.categories[p] == v]
        holds = np.isin(column.values, np.array(codes, dtype=np.int32))
    else:
        holds = np.isin(column.values, np.array(node.values, dtype=np.float64))
    return ~holds if node.negated else holds


def parse_filter(text: str) -> Filter:
    """Parse a ``where`` expression; FilterError naming the problem and its position."""
    if not isinstance(text, str):
        raise FilterError(f"where must be a string expression, got {type(text).__name__}")
    if len(text) > MAX_FILTER_CHARS:
        raise FilterError(f"where: the expression is {len(text)} characters; at most {MAX_FILTER_CHARS}")
    if not text.strip():
        raise FilterError('where: the expression is empty; e.g. label = "cat"')
    return Filter(text, _Parser(text).parse())


# --- the index's columns ----------------------------------------------------------------------------------------
BUILT_IN_COLUMNS = ("id", "path", "label")


class FilterTable:
    """The filterable columns of an index's rows (sorted ``ids``): id, path (as shown: relative to the gallery
    root), label and a manifest's extra columns (``split`` among them; ``extra``: id -> JSON object), each made
    into a ``Column`` on first use."""

    def __init__(self, ids: list[int], paths: list[str], labels: list[str | None], extra: Mapping[int, str]) -> None:
        import json
        import threading

        self.ids = np.asarray(ids, dtype=np.int64)
        self._raw: dict[str, list] = {"path": list(paths), "label": list(labels)}
        position = {int(i): n for n, i in enumerate(ids)}
        extras: dict[str, list] = {}
        for image_id, data in extra.items():
            n = position.get(int(image_id))
            try:
                values = json.loads(data) if n is not None else None
            except ValueError:
                continue
            for key, value in (values or {}).items() if isinstance(values, dict) else ():
                if key in BUILT_IN_COLUMNS:
                    continue
                if key not in extras:
                    extras[key] = [None] * len(ids)
                extras[key][n] = value
        self._raw.update(extras)
        self._columns: dict[str, Column] = {"id": Column.of_numbers(self.ids.astype(np.float64))}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        """Every column a ``where`` may name."""
        return ["id", *self._raw]

    def example(self, name: str) -> object | None:
        """The first row's value of a column, as a filter compares it (None: no row has one, or no such column)."""
        return next((value for value in self._raw.get(name, ()) if value is not None and value != ""), None)

    def no_match_hint(self) -> str:
        """What to check when a filter matches no row: how paths and labels compare, with this table's own values
        (a path copied from elsewhere may be spelled differently), and the columns there are."""
        path, label = self.example("path"), self.example("label")
        path_text = f" (e.g. path = {_literal(path)})" if path is not None else ""
        label_text = f" (e.g. label = {_literal(label)})" if label is not None else ""
        return (f"Paths are compared as the API shows them, relative to the gallery{path_text}, and labels exactly, "
                f"case included{label_text}; the columns are: {', '.join(self.names())}")

    def column(self, name: str) -> Column | None:
        with self._lock:
            if name not in self._columns:
                if name not in self._raw:
                    return None
                raw = self._raw[name]
                self._columns[name] = (Column.of_strings(raw) if name in ("path", "label") else infer_column(raw))
            return self._columns[name]

    def matching(self, where: Filter) -> np.ndarray:
        """The sorted ids of the rows that match."""
        return self.ids[where.mask(self.column, self.names())]


def _literal(value: object) -> str:
    """A value as a filter's string literal (a quote inside doubled), printable on one line."""
    from retrieval.index.sources import printable_path

    return '"' + printable_path(str(value)).replace('"', '""') + '"'
