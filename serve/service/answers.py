"""What a search answers: ``SearchResponse``, the gallery item a query is, and how clients address an item."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from retrieval.index import SearchResult
from retrieval.index.sources import printable_path
from retrieval.rerank import RerankConfig
from retrieval.serve.diagnostics import NeighbourScores


def image_url(image_id: int) -> str:
    return f"/items/{image_id}/image"


def display_name(path: str) -> str:
    """A gallery image's file name, printable (the API's ``name``: no folders, no server paths); the app names an
    image by its ``path``, the spelling filters compare."""
    return printable_path(PurePosixPath(path).name)


@dataclass(frozen=True)
class QueryItem:
    """The gallery item a query image is: same file bytes (sha256) as that catalogued, indexed file."""

    id: int
    path: str  # relative to the gallery root
    label: str | None
    columns: dict[str, Any] | None = None  # the index's display columns of its row (None: it shows none)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "path": self.path, "name": display_name(self.path), "label": self.label,
                "image_url": image_url(self.id)} | ({"columns": self.columns} if self.columns is not None else {})


@dataclass
class SearchResponse:
    results: list[SearchResult]  # paths relative to the gallery root
    k: int
    timing: dict[str, float] = field(default_factory=dict)  # milliseconds, plus the batch size
    query_item: QueryItem | None = None  # the query is this gallery item (identical file bytes)
    excluded_self: bool = False  # ... and it was left out of the results
    notes: list[str] = field(default_factory=list)  # how the query was read (e.g. an animated image's frame)
    # the answering state's nearest-neighbour similarities, when asked for (``search(..., calibrate=True)``)
    neighbours: NeighbourScores | None = None
    rerank: RerankConfig | None = None  # the re-ranking that ordered the results (None: faiss' order)
    rerank_defaults: str | None = None  # where the sizes the request left unset came from (the gallery)
    # a text query's: whether nothing good matches (retrieval.text.no_match; None: no floor, no claim made)
    no_match: bool | None = None

    def unlike_gallery(self) -> bool:
        """Whether the best result scores below what nearly every gallery image reaches to its own nearest
        neighbour (needs ``neighbours``; a query that is a gallery image never is)."""
        return (self.neighbours is not None and bool(self.results) and self.query_item is None
                and self.neighbours.unlike(self.results[0].score))

    def to_dict(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "count": len(self.results),
            "results": [r.to_dict() | {"name": display_name(r.path), "image_url": image_url(r.id)}
                        for r in self.results],
            "query_item": self.query_item.to_dict() if self.query_item else None,
            "excluded_self": self.excluded_self,
            "notes": list(self.notes),
            "timing": {stage: float(value) for stage, value in self.timing.items()},
        } | ({"rerank": self.rerank.describe(self.rerank_defaults)} if self.rerank is not None else {}) \
            | ({"no_match": self.no_match} if self.no_match is not None else {})
