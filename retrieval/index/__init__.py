"""Gallery index: a faiss index over L2-normalised embeddings with a SQLite catalogue.

``build_index`` / ``build_from_embeddings`` / ``add_images`` / ``remove_images`` / ``repair_index`` (``writer``) write
an index folder (see ``IndexLayout``; one writer at a time); ``Index.open(folder).search(embeddings, k,
exclude_ids=())`` and ``.search_images(images, k)`` query it, reading the catalogue through a read-only,
per-thread ``CatalogueReader`` (the one read path; it never writes the folder).

The read side is imported here; the writer's commands on first use (PEP 562, ``retrieval.utils.lazy``): where torch
is installed they import it (the local engine decodes in torch's DataLoader workers; the base install has no torch and
decodes in a process pool instead), which neither a search service nor Ray's worker processes (they import
``ray_stages``, and so this package) should pay for.
"""

from retrieval.index.catalogue import Catalogue, CatalogueReader, Status
from retrieval.index.embedding.engine import IngestOptions
from retrieval.index.faiss_backend.faiss_keys import AUTO_POLICY, AutoPolicy, choose_index_key
from retrieval.index.layout import IndexLayout, IndexLockedError
from retrieval.index.query_embedder import ImageEmbedder, ModelMismatchError, l2_normalize_rows, load_model
from retrieval.index.search import Index, SearchResult
from retrieval.index.sources import IMAGE_EXTENSIONS, list_gallery
from retrieval.index.stats import index_stats
from retrieval.utils.lazy import lazy_exports

# public name -> the submodule that defines it (imported on first use)
_SOURCES = {"writing.writer": ("add_images", "build_from_embeddings", "build_index", "remove_images"),
            "writing.repair": ("repair_index",)}
__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)

__all__ = [
    "AUTO_POLICY", "AutoPolicy", "Catalogue", "CatalogueReader", "IMAGE_EXTENSIONS", "ImageEmbedder", "Index",
    "IndexLayout", "IndexLockedError", "IngestOptions", "ModelMismatchError", "SearchResult", "Status",
    "choose_index_key", "index_stats", "l2_normalize_rows", "list_gallery", "load_model", *_SOURCES["writing.writer"],
    *_SOURCES["writing.repair"],
]
