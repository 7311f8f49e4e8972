"""The API's answers as small typed records, read field by field from the documented bodies
(``retrieval.serve.routes.schemas``); each keeps the JSON it was read from in ``raw``."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, overload

MAX_COUNT = 2**63 - 1  # ids, sizes and counts: SQLite's and NumPy's int64
# what each kind of field must be, and how a message says so; bool is an int in Python, never one here
KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "count": (lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNT,
              "a non-negative integer"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
               "a finite number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "object": (lambda v: isinstance(v, dict), "an object"),
}


def _raw() -> Any:
    return field(default_factory=dict, repr=False, compare=False)


def shown(value: Any) -> str:
    """A field's value in a message, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def checked(value: Any, kind: str, name: str) -> Any:
    """``value`` if it is of ``kind`` (a ``KINDS`` key; a number as a float), else a ValueError naming ``name``."""
    accepts, description = KINDS[kind]
    if not accepts(value):
        raise ValueError(f"{name} must be {description}, got {shown(value)}")
    return float(value) if kind == "number" else value


def read(data: Any, key: str, kind: str, *, nullable: bool = False, required: bool = True) -> Any:
    """``data[key]`` checked as ``kind`` (``checked``); ``nullable``: null is None; not ``required``: missing is
    None. The one way a record reads its answer's fields: anything else is a ValueError naming the field."""
    checked(data, "object", f"the JSON holding {key!r}")
    if key not in data and not required:
        return None
    if key not in data:
        raise ValueError(f"{key!r} is missing")
    value = data[key]
    if value is None and (nullable or not required):
        return None
    return checked(value, kind, repr(key))


def read_each(data: Any, key: str, kind: str) -> list[Any]:
    """``data[key]``, a list each of whose entries is of ``kind``."""
    return [checked(entry, kind, f"{key!r}[{n}]") for n, entry in enumerate(read(data, key, "list"))]


# the column names that hold a row's title, in order (``retrieval.index.display_columns.TITLE_COLUMNS``, kept equal
# by a test: importing that package would load faiss)
TITLE_COLUMNS = ("title", "name", "product_name", "caption")


def read_columns(data: Any) -> dict[str, str | float | None] | None:
    """``data["columns"]`` (the index's display columns of a row): an object of strings, finite numbers or nulls;
    None where the server sends none."""
    columns = read(data, "columns", "object", required=False)
    if columns is None:
        return None
    return {name: value if value is None or isinstance(value, str)
            else checked(value, "number", f"'columns'.{shown(name)}") for name, value in columns.items()}


def title_of(columns: dict[str, Any] | None) -> str | None:
    """The first non-empty text of the ``TITLE_COLUMNS`` among ``columns``, else None."""
    return next((columns[name] for name in TITLE_COLUMNS
                 if isinstance((columns or {}).get(name), str) and columns[name]), None)


def read_numbers(data: Any, key: str) -> dict[str, float]:
    """``data[key]``, an object of finite numbers."""
    return {name: checked(value, "number", f"{key!r}.{name}") for name, value in read(data, key, "object").items()}


@dataclass(frozen=True)
class SearchHit:
    """One result: a catalogued gallery image and its score (cosine similarity, best first)."""

    id: int  # catalogue id (``RetrievalClient.item``, ``item_image``)
    path: str  # relative to the gallery root, as ``where`` filters compare it
    name: str  # the file name, no folders
    label: str | None
    score: float
    image_url: str  # relative to the server's URL
    rerank_score: float | None = None  # the score a re-ranking ordered it by, where one did
    # the index's display columns of its row (a title, a price: `retrieval index columns`); None where it shows none
    columns: dict[str, str | float | None] | None = None
    # a text query's hit: "vector" (the text model), "keyword" (the index's text columns) or "both"; None otherwise
    source: str | None = None
    raw: dict[str, Any] = _raw()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SearchHit:
        """A result of a search answer's ``results``."""
        return cls(read(data, "id", "count"), read(data, "path", "str"), read(data, "name", "str"),
                   read(data, "label", "str", nullable=True), read(data, "score", "number"),
                   read(data, "image_url", "str"), read(data, "rerank_score", "number", required=False),
                   read_columns(data), read(data, "source", "str", required=False), raw=data)

    @property
    def title(self) -> str | None:
        """Its title (the first of ``TITLE_COLUMNS`` among its columns), None where it has none."""
        return title_of(self.columns)


@dataclass(frozen=True)
class QueryItem:
    """The gallery image whose file has exactly the query image's bytes."""

    id: int
    path: str
    name: str
    label: str | None
    image_url: str
    columns: dict[str, str | float | None] | None = None  # its display columns, as a hit's
    raw: dict[str, Any] = _raw()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> QueryItem:
        """A search answer's ``query_item``."""
        return cls(read(data, "id", "count"), read(data, "path", "str"), read(data, "name", "str"),
                   read(data, "label", "str", nullable=True), read(data, "image_url", "str"), read_columns(data),
                   raw=data)

    @property
    def title(self) -> str | None:
        """Its title (the first of ``TITLE_COLUMNS`` among its columns), None where it has none."""
        return title_of(self.columns)


@dataclass(frozen=True)
class RerankInfo:
    """The re-ranking that ordered a search's results."""

    method: str
    title: str
    paper: str
    params: dict[str, float]  # with ``candidates``, the shortlist re-ranked
    defaults: str | None = None  # where the sizes the request left unset came from
    raw: dict[str, Any] = _raw()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RerankInfo:
        """A search answer's ``rerank`` block."""
        return cls(read(data, "method", "str"), read(data, "title", "str"), read(data, "paper", "str"),
                   read_numbers(data, "params"), read(data, "defaults", "str", required=False), data)


@dataclass(frozen=True)
class SearchResults:
    """One query's answer: its hits best first (iterate it, index it, ``len`` it) and how it was searched."""

    k: int  # asked for; fewer hits where the gallery (or the filter) holds fewer
    hits: list[SearchHit]
    query_item: QueryItem | None  # for an image query: the gallery image with identical bytes
    excluded_self: bool  # query_item was left out of the hits
    notes: list[str]  # how the query was read (an animated image's frame, a filter matching nothing)
    timing: dict[str, float]  # milliseconds per stage, and the model's batch size
    rerank: RerankInfo | None = None
    # a text query's: True where nothing in the gallery matches it well (the hits are the nearest anyway); None
    # where the server makes no claim (an image query, or an index with no calibrated floor)
    no_match: bool | None = None
    raw: dict[str, Any] = _raw()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SearchResults:
        """A POST /search answer (or one entry of a batch's)."""
        item = read(data, "query_item", "object", nullable=True)
        rerank = read(data, "rerank", "object", required=False)
        return cls(read(data, "k", "count"), [SearchHit.from_json(hit) for hit in read(data, "results", "list")],
                   None if item is None else QueryItem.from_json(item), read(data, "excluded_self", "bool"),
                   read_each(data, "notes", "str"), read_numbers(data, "timing"),
                   None if rerank is None else RerankInfo.from_json(rerank),
                   read(data, "no_match", "bool", required=False), data)

    @property
    def ids(self) -> list[int]:
        """The hits' catalogue ids, best first."""
        return [hit.id for hit in self.hits]

    def __len__(self) -> int:
        return len(self.hits)

    def __iter__(self) -> Iterator[SearchHit]:
        return iter(self.hits)

    @overload
    def __getitem__(self, index: int) -> SearchHit: ...

    @overload
    def __getitem__(self, index: slice) -> list[SearchHit]: ...

    def __getitem__(self, index: int | slice) -> SearchHit | list[SearchHit]:
        return self.hits[index]


@dataclass(frozen=True)
class QueryFailure:
    """A batch query the server could not answer (its image could not be read), in that query's place."""

    position: int  # its place in the batch
    status: int  # the status POST /search would have answered it with
    error: str  # the server's message
    raw: dict[str, Any] = _raw()

    @classmethod
    def from_json(cls, position: int, data: dict[str, Any]) -> QueryFailure:
        """An ``{"error", "status"}`` entry of a batch's ``results``."""
        return cls(position, read(data, "status", "count"), read(data, "error", "str"), data)


@dataclass(frozen=True)
class Item:
    """An indexed image's catalogue entry (GET /items/{id})."""

    id: int
    path: str
    name: str
    label: str | None
    sha256: str | None  # of the file's bytes, hex
    size: int | None  # bytes
    image_url: str
    columns: dict[str, str | float | None] | None = None  # its display columns, as a hit's
    raw: dict[str, Any] = _raw()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Item:
        """A GET /items/{id} answer."""
        return cls(read(data, "id", "count"), read(data, "path", "str"), read(data, "name", "str"),
                   read(data, "label", "str", nullable=True), read(data, "sha256", "str", nullable=True),
                   read(data, "size", "count", nullable=True), read(data, "image_url", "str"), read_columns(data),
                   raw=data)

    @property
    def title(self) -> str | None:
        """Its title (the first of ``TITLE_COLUMNS`` among its columns), None where it has none."""
        return title_of(self.columns)


@dataclass(frozen=True)
class Health:
    """GET /health: the server searches, this many vectors of this dimension."""

    status: str
    vectors: int
    embedding_dim: int
    raw: dict[str, Any] = _raw()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Health:
        """A GET /health answer."""
        return cls(read(data, "status", "str"), read(data, "vectors", "count"), read(data, "embedding_dim", "count"),
                   data)


@dataclass(frozen=True)
class Limits:
    """What one request may hold (GET /stats ``limits``)."""

    max_upload_bytes: int
    max_pixels: int
    max_k: int
    max_batch_queries: int
    max_batch_upload_bytes: int
    concurrency: int
    max_queue: int

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Limits:
        """GET /stats' ``limits``."""
        return cls(**{name: read(data, name, "count") for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Stats:
    """GET /stats: the served index and model, its statistics, the server's counters and limits."""

    service: dict[str, Any]  # the index and model served, and whether it searches by text
    index: dict[str, Any]  # size, type, parameters, recall vs exact search, latency
    batcher: dict[str, Any]
    admission: dict[str, Any]
    limits: Limits
    raw: dict[str, Any] = _raw()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Stats:
        """A GET /stats answer."""
        return cls(read(data, "service", "object"), read(data, "index", "object"), read(data, "batcher", "object"),
                   read(data, "admission", "object"), Limits.from_json(read(data, "limits", "object")), data)

    @property
    def text_search(self) -> bool:
        """Whether the server has a text model (``search(text=...)`` works)."""
        return bool(self.service.get("text_search"))
