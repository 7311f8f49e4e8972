"""``SearchableIndex``: the contract an index folder (``search.Index``) and a Milvus collection
(``milvus.milvus_index.MilvusIndex``) both meet, stated once: what the CLI's search, the server and the app ask of
an opened index. Each class implements it in its own way; nothing that uses one asks which it is.

``isinstance(x, SearchableIndex)`` checks that every member is there (on Python 3.11 it reads the properties, so
it belongs in tests, not on a request's path); tests/index/test_searchable.py also holds every method's signature
to the one below.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from pathlib import Path, PurePath
from typing import Any, Protocol, runtime_checkable

import numpy as np

from retrieval.index.filters import Filter
from retrieval.index.portable import GalleryPlace
from retrieval.index.query_embedder import ImageEmbedder
from retrieval.index.search import SearchResult
from retrieval.records.index_info import IndexInfo
from retrieval.rerank import Neighbourhood, RerankConfig
from retrieval.text.keywords import KeywordSearch


@runtime_checkable
class GalleryCatalogue(Protocol):
    """The catalogue queries a server asks of an index (examples, labels, duplicates)."""

    def labelled(self) -> list[tuple[int, str]]: ...

    def label_counts(self) -> dict[str | None, int]: ...

    def sample(self, count: int) -> list[dict[str, Any]]: ...

    def duplicates(self, limit: int) -> tuple[int, list[tuple[dict[str, Any], dict[str, Any] | None]]]: ...

    def indexed_count(self) -> int: ...


@runtime_checkable
class FilterColumns(Protocol):
    """The columns a ``where`` may name, and what to check when a filter matches no row."""

    def names(self) -> list[str]: ...

    def no_match_hint(self) -> str: ...


@runtime_checkable
class SearchableIndex(Protocol):
    """An opened index that answers searches: its record, its rows by id, its gallery and its statistics."""

    info: IndexInfo  # its record: index.json, or a collection's copy of it
    remote: bool  # whether it answers over the network (a server never asks it on its event loop)

    # --- what it is
    @property
    def dim(self) -> int: ...

    @property
    def model_hash(self) -> str | None: ...

    @property
    def has_model(self) -> bool: ...

    @property
    def model_output(self) -> str | None: ...

    @property
    def display_columns(self) -> list[str]: ...

    @property
    def embedder(self) -> ImageEmbedder: ...

    @property
    def root(self) -> Path: ...

    @property
    def ids(self) -> np.ndarray: ...

    @property
    def keywords(self) -> KeywordSearch | None: ...

    @property
    def catalogue(self) -> GalleryCatalogue: ...

    @property
    def filter_table(self) -> FilterColumns: ...

    def __len__(self) -> int: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...

    def close(self) -> None: ...

    def check_ready(self) -> None: ...

    def stats(self, queries: int = 500, seed: int = 1) -> dict[str, Any]: ...

    # --- search
    def search(
        self, embeddings: np.ndarray, k: int = 10, exclude_ids: Collection[int] = (),
        where: str | Filter | None = None, rerank: RerankConfig | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> list[list[SearchResult]]: ...

    def search_arrays(self, embeddings: np.ndarray, k: int = 10) -> tuple[np.ndarray, np.ndarray]: ...

    def search_selected(self, embeddings: np.ndarray, k: int, selected: np.ndarray) -> tuple[np.ndarray,
                                                                                            np.ndarray]: ...

    def matching_ids(self, where: str | Filter) -> np.ndarray: ...

    def rerank_neighbourhood(self) -> Neighbourhood: ...

    def reconstructed_vectors(self, ids: np.ndarray) -> np.ndarray: ...

    def stored_rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    # --- rows by id
    def indexed_rows(self, ids: Sequence[int]) -> dict[int, dict[str, Any]]: ...

    def indexed_row(self, image_id: int) -> dict[str, Any] | None: ...

    def indexed_by_sha256(self, sha256: str) -> dict[str, Any] | None: ...

    def with_columns(self, found: list[list[SearchResult]]) -> list[list[SearchResult]]: ...

    def columns_of(self, ids: Sequence[int]) -> dict[int, dict[str, Any]]: ...

    # --- the gallery
    @property
    def gallery_root(self) -> PurePath: ...

    @property
    def gallery(self) -> GalleryPlace: ...

    def public_path(self, path: str) -> str: ...

    def image_file(self, path: str) -> str | None: ...
