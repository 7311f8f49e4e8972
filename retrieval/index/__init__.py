"""Gallery index: a faiss index over L2-normalised embeddings with a SQLite catalogue.

``build_index`` / ``build_from_embeddings`` / ``add_images`` / ``remove_images`` / ``repair_index`` (``writer``) write
an index folder (see ``IndexLayout``; one writer at a time); ``Index.open(folder).search(embeddings, k,
exclude_ids=())`` and ``.search_images(images, k)`` query it, reading the catalogue through a read-only,
per-thread ``CatalogueReader`` (the one read path; it never writes the folder). ``searchable`` states what a folder
and a Milvus collection both answer (``SearchableIndex``) and opens either (``index_place``, ``open_searchable``).

The read side is imported here; the writer's commands on first use (PEP 562, ``retrieval.utils.lazy``): where torch
is installed they import it (the local engine decodes in torch's DataLoader workers; the base install has no torch and
decodes in a process pool instead), which neither a search service nor Ray's worker processes (they import
``ray_stages``, and so this package) should pay for.

- ``layout``: the folder's files, index.json and the writer's lock.
- ``catalogue_schema``, ``catalogue_reader``, ``catalogue``: the SQLite catalogue: its schema and row statuses, every
  read query and the read-only connections, the writer's one connection.
- ``shards``: the embedding shards (npz or parquet), one store reading both.
- ``vectors``: the indexed vectors as the catalogue sees them, read from the shards.
- ``sources``: where the gallery comes from (a folder, a manifest CSV, a parquet file); file names as hostile input.
- ``parquet_bounds``: memory bounds on reading a hostile parquet file's text columns.
- ``filters``: the ``where`` language, parsed and evaluated over column arrays.
- ``display_columns``: the manifest columns every answer shows beside its path, bounded and printable.
- ``portable``: where a moved index's model and gallery are now.
- ``query_embedder``: what the index needs of a model (``ImageEmbedder``), an ONNX file loaded, normalisation.
- ``search``: ``Index``, an index folder opened and searched (the one read path).
- ``live``: consistent snapshots of a folder that writers change, swapped in live.
- ``stats``: ``retrieval index stats`` of an index folder.
- ``faiss_backend``: the faiss part: keys, parameters, files, search, measures, build.
- ``milvus``: an index held in a Milvus collection.
- ``searchable``: what is served, whatever holds it (``SearchableIndex``), and the one factory that opens it.
- ``embedding``: the engines that decode and embed a gallery into shards (local and Ray).
- ``formats``: files other tools write or read (embeddings in, tables out), the gallery as training images.
- ``curation``: reading a gallery through its index: near-duplicates, label audit, two models compared.
- ``writing``: the writers: build, add, remove, repair, upgrade.
"""

from retrieval.index.catalogue import Catalogue, CatalogueReader, Status
from retrieval.index.embedding.engine import IngestOptions
from retrieval.index.faiss_backend.faiss_keys import AUTO_POLICY, AutoPolicy, choose_index_key
from retrieval.index.layout import IndexLayout, IndexLockedError
from retrieval.index.query_embedder import ImageEmbedder, ModelMismatchError, l2_normalize_rows, load_model
from retrieval.index.search import Index, SearchResult
from retrieval.index.searchable.opening import index_stats
from retrieval.index.sources import IMAGE_EXTENSIONS, list_gallery
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
