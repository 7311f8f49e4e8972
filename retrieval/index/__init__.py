"""Gallery index: a faiss index over L2-normalised embeddings with a SQLite catalogue.

``build_index`` / ``add_images`` / ``remove_images`` / ``repair_index`` write an index folder (see
``IndexLayout``; one writer at a time);
``Index.open(folder).search(embeddings, k, exclude_ids=())`` and ``.search_images(images, k)`` query it, reading
the catalogue through a read-only, per-thread ``CatalogueReader`` (the one read path; it never writes the folder).

The public names are imported on first use (PEP 562): a process that needs one submodule, such as Ray's decode
tasks and embedding actors (``ray_stages``: PIL, numpy, onnxruntime), does not pay for torch, which the builder
imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from retrieval.lazy import lazy_exports

if TYPE_CHECKING:
    from retrieval.index.builder import IngestOptions, add_images, build_index, remove_images, repair_index
    from retrieval.index.catalogue import Catalogue, CatalogueReader
    from retrieval.index.embedder import Embedder, ModelMismatchError, l2_normalize, load_model
    from retrieval.index.faiss_ops import AUTO_POLICY, AutoPolicy, choose_index_key
    from retrieval.index.layout import IndexLayout, IndexLockedError
    from retrieval.index.search import Index, SearchResult
    from retrieval.index.sources import IMAGE_EXTENSIONS, list_gallery
    from retrieval.index.stats import index_stats

# public name -> the submodule that defines it
_SOURCES = {
    "builder": ("IngestOptions", "add_images", "build_index", "remove_images", "repair_index"),
    "catalogue": ("Catalogue", "CatalogueReader"),
    "embedder": ("Embedder", "ModelMismatchError", "l2_normalize", "load_model"),
    "faiss_ops": ("AUTO_POLICY", "AutoPolicy", "choose_index_key"),
    "layout": ("IndexLayout", "IndexLockedError"),
    "search": ("Index", "SearchResult"),
    "sources": ("IMAGE_EXTENSIONS", "list_gallery"),
    "stats": ("index_stats",),
}
__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)

__all__ = [
    "AUTO_POLICY",
    "AutoPolicy",
    "Catalogue",
    "CatalogueReader",
    "Embedder",
    "IMAGE_EXTENSIONS",
    "Index",
    "IndexLayout",
    "IndexLockedError",
    "IngestOptions",
    "ModelMismatchError",
    "SearchResult",
    "add_images",
    "build_index",
    "choose_index_key",
    "index_stats",
    "l2_normalize",
    "list_gallery",
    "load_model",
    "remove_images",
    "repair_index",
]

