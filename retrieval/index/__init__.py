"""Gallery index: a faiss index over L2-normalised embeddings with a SQLite catalogue.

``build_index`` / ``add_images`` / ``remove_images`` / ``repair_index`` write an index folder (see
``IndexLayout``; one writer at a time);
``Index.open(folder).search(embeddings, k, exclude_ids=())`` and ``.search_images(images, k)`` query it, reading
the catalogue through a read-only, per-thread ``CatalogueReader`` (the one read path; it never writes the folder).
"""

from retrieval.index.builder import IngestOptions, add_images, build_index, remove_images, repair_index
from retrieval.index.catalogue import Catalogue, CatalogueReader
from retrieval.index.embedder import Embedder, ModelMismatchError, l2_normalize, load_model
from retrieval.index.faiss_ops import AUTO_POLICY, AutoPolicy, choose_index_key
from retrieval.index.layout import IndexLayout, IndexLockedError
from retrieval.index.search import Index, SearchResult
from retrieval.index.sources import IMAGE_EXTENSIONS, list_gallery
from retrieval.index.stats import index_stats

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
