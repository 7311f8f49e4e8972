"""The API's answers as small typed records, read field by field from the documented bodies
(``retrieval.serve.routes.schemas``); each keeps the JSON it was read from in ``raw``."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, overload


def _raw() -> Any:
    return field(default_factory=dict, repr=False, compare=False)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


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
    raw: dict[str, Any] = _raw()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SearchHit:
        """A result of a search answer's ``results``."""
        return cls(int(data["id"]), data["path"], data["name"], data["label"], float(data["score"]),
                   data["image_url"], _optional_float(data.get("rerank_score")), data)


@dataclass(frozen=True)
class QueryItem:
    """The gallery image whose file has exactly the query image's bytes."""

    id: int
    path: str
    name: str
    label: str | None
    image_url: str
    raw: dict[str, Any] = _raw()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> QueryItem:
        """A search answer's ``query_item``."""
        return cls(int(data["id"]), data["path"], data["name"], data["label"], data["image_url"], data)


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
        return cls(data["method"], data["title"], data["paper"], dict(data["params"]), data.get("defaults"), data)


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
    raw: dict[str, Any] = _raw()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SearchResults:
        """A POST /search answer (or one entry of a batch's)."""
        item, rerank = data["query_item"], data.get("rerank")
        return cls(int(data["k"]), [SearchHit.from_json(hit) for hit in data["results"]],
                   None if item is None else QueryItem.from_json(item), bool(data["excluded_self"]),
                   list(data["notes"]), {stage: float(ms) for stage, ms in data["timing"].items()},
                   None if rerank is None else RerankInfo.from_json(rerank), data)

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
        return cls(position, int(data["status"]), data["error"], data)


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
    raw: dict[str, Any] = _raw()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Item:
        """A GET /items/{id} answer."""
        size = data["size"]
        return cls(int(data["id"]), data["path"], data["name"], data["label"], data["sha256"],
                   None if size is None else int(size), data["image_url"], data)


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
        return cls(data["status"], int(data["vectors"]), int(data["embedding_dim"]), data)


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
        return cls(**{name: int(data[name]) for name in cls.__dataclass_fields__})


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
        return cls(dict(data["service"]), dict(data["index"]), dict(data["batcher"]), dict(data["admission"]),
                   Limits.from_json(data["limits"]), data)

    @property
    def text_search(self) -> bool:
        """Whether the server has a text model (``search(text=...)`` works)."""
        return bool(self.service.get("text_search"))
