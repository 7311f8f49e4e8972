"""The one factory of what is searched and served: ``index_place`` names an index folder or a Milvus collection as an
``IndexPlace``, which opens it (``open``: once, as `retrieval search` does; ``open_state``: a server's state, again
after each writer) as a ``SearchableIndex``. Everything backend-specific about opening lives in the two places;
this module is the one place that tells a folder from a collection. The Milvus modules (and pymilvus) load only
where a collection is opened.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, Protocol

from retrieval.index.query_embedder import ImageEmbedder, load_model
from retrieval.index.searchable.contract import SearchableIndex

if TYPE_CHECKING:
    from retrieval.index.milvus.milvus_collection import MilvusPlace


class IndexPlace(Protocol):
    """What is served or searched, named before anything is opened or connected (``str``: as the operator named
    it)."""

    @property
    def root(self) -> Path:
        """Where index.json's relative paths start (a collection: its name, what a server calls it)."""

    @property
    def shown(self) -> str:
        """How the operator's logs and the app name it (server paths included)."""

    @property
    def name(self) -> str:
        """How clients are told its name: never a server path."""

    def is_missing(self) -> bool:
        """Whether it is plainly not there, known without opening or connecting."""

    def open(self, model: str | Path | None = None, gallery_root: str | Path | None = None,
             gpu: bool = False) -> SearchableIndex:
        """Open it once, to search: ``model`` the query model's file (None: the one it records), ``gallery_root``
        where its images are now, ``gpu`` to search on the GPU."""

    def open_state(self, embedder: ImageEmbedder | None, gallery_root: str | Path | None,
                   first: bool) -> SearchableIndex:
        """A server's state of it now (``first``: the server's first, which may open during a writer's run)."""

    def watch(self) -> Callable[[], Any] | None:
        """What a server watches to know a new state must be opened (None: the folder's files, ``live``)."""


@dataclass(frozen=True)
class FolderPlace:
    """An index folder (``search.Index``; a server's states are ``live.Snapshot``s)."""

    folder: Path

    def __str__(self) -> str:
        return str(self.folder)

    @property
    def root(self) -> Path:
        return self.folder

    @property
    def shown(self) -> str:
        return str(self.folder.resolve())

    @property
    def name(self) -> str:
        return PurePath(self.shown).name

    def is_missing(self) -> bool:
        """Whether the folder holds no index.json."""
        return not (self.folder / "index.json").is_file()

    def open(self, model: str | Path | None = None, gallery_root: str | Path | None = None,
             gpu: bool = False) -> SearchableIndex:
        """``Index.open``, with the model loaded now (ModelMismatchError: not the index's, nor compatible)."""
        from retrieval.index.search import Index

        return Index.open(self.folder, embedder=load_model(model) if model else None, gpu=gpu,
                          gallery_root=gallery_root)

    def open_state(self, embedder: ImageEmbedder | None, gallery_root: str | Path | None,
                   first: bool) -> SearchableIndex:
        """A consistent ``Snapshot``; the first takes a consistent index even while a writer holds the folder (as
        ``Index.open`` does), with ``embedder``; later ones take the model the server carries over."""
        from retrieval.index.live import Snapshot

        if first:
            return Snapshot.open(self.folder, embedder=embedder, writer_free=False, gallery_root=gallery_root)
        return Snapshot.open(self.folder, gallery_root=gallery_root)

    def watch(self) -> Callable[[], Any] | None:
        return None


@dataclass(frozen=True)
class CollectionPlace:
    """A Milvus collection (``milvus_index.MilvusIndex``): every state reads the collection as it is."""

    place: MilvusPlace

    def __str__(self) -> str:
        return str(self.place)

    @property
    def root(self) -> Path:
        return Path(self.place.collection)

    @property
    def shown(self) -> str:
        return str(self.place)

    @property
    def name(self) -> str:
        return self.place.collection

    def is_missing(self) -> bool:
        """Never known before connecting (opening it says whether the collection exists)."""
        return False

    def open(self, model: str | Path | None = None, gallery_root: str | Path | None = None,
             gpu: bool = False) -> SearchableIndex:
        """A ``MilvusIndex`` (MilvusError: no such collection); ``model`` is loaded when an image is embedded."""
        from retrieval.index.milvus.milvus_index import MilvusIndex

        if gpu:
            raise ValueError(f"{self.place} is searched by Milvus, not on this machine's GPU")
        return MilvusIndex(self.place, model=None if model is None else str(model),
                           gallery_root=None if gallery_root is None else str(gallery_root))

    def open_state(self, embedder: ImageEmbedder | None, gallery_root: str | Path | None,
                   first: bool) -> SearchableIndex:
        """A ``MilvusIndex`` of the collection now, with ``embedder`` where the server was given one."""
        from retrieval.index.milvus.milvus_index import MilvusIndex

        index = MilvusIndex(self.place, gallery_root=None if gallery_root is None else str(gallery_root))
        if embedder is not None:
            try:
                index.embedder = embedder
            except BaseException:
                index.close()
                raise
        return index

    def watch(self) -> Callable[[], Any] | None:
        """The alias's collection and model (``watch_identity``): an upgrade moves them, adds and removes do not."""
        from retrieval.index.milvus.milvus_index import watch_identity

        return watch_identity(self.place)


def index_place(index_dir: str | Path | IndexPlace | None = None, milvus: MilvusPlace | str | None = None,
                collection: str | None = None) -> IndexPlace:
    """What is served: the Milvus collection ``milvus`` (a ``MilvusPlace``, or a URI with ``collection``, checked
    before anything connects: MilvusError) where one is given, else the index folder ``index_dir`` (an
    ``IndexPlace`` already made is returned as it is)."""
    if isinstance(index_dir, (FolderPlace, CollectionPlace)):
        return index_dir
    if milvus is None:
        if index_dir is None:
            raise ValueError("an index folder or a Milvus collection is needed")
        return FolderPlace(Path(index_dir))
    if isinstance(milvus, str):
        from retrieval.index.milvus.milvus_collection import MilvusPlace

        milvus = MilvusPlace.checked(milvus, collection or "")
    return CollectionPlace(milvus)


def open_searchable(index_dir: str | Path | IndexPlace | None = None, milvus: MilvusPlace | str | None = None,
                    collection: str | None = None, *, model: str | Path | None = None,
                    gallery_root: str | Path | None = None, gpu: bool = False) -> SearchableIndex:
    """Open what ``index_place`` names, to search it (``IndexPlace.open``)."""
    return index_place(index_dir, milvus, collection).open(model, gallery_root, gpu)


def index_stats(directory: str | Path | IndexPlace, queries: int = 500, seed: int = 1) -> dict[str, Any]:
    """``retrieval index stats``: the index opened and measured as it is saved (``SearchableIndex.stats``: recall
    of its search settings against exact search of a sample of its own vectors, p50/p99 latency)."""
    with open_searchable(directory) as index:
        return index.stats(queries=queries, seed=seed)
