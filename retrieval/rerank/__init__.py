"""Re-ranking a query's shortlist from its candidates' stored vectors: αQE, DBA and k-reciprocal re-ranking.

- ``methods``: the methods' scores (αQE, DBA, k-reciprocal) and their registry (``RERANKERS``, ``method_names``).
- ``config``: the request (``RerankConfig``, declared once; ``rerank_from_json``, the API's form).
- ``shortlists``: the shortlist re-ordered (``rerank_candidates``, ``rerank_lists``) and its cost (``work_units``,
  ``peak_bytes``, ``check_memory``).
- ``defaults``: the neighbourhood sizes a request leaves unset, read from the gallery's class sizes.

Plain NumPy (no torch, no faiss): the server and the command line import it.
"""

from retrieval.rerank.config import API_KEY, MAX_CANDIDATES, PAPER_NEIGHBOURHOOD, RerankConfig, rerank_from_json
from retrieval.rerank.defaults import (
    UNLABELLED_RELEVANT,
    Neighbourhood,
    gallery_filled,
    neighbourhood_from_counts,
    neighbourhood_from_labels,
    with_gallery_defaults,
)
from retrieval.rerank.methods import (
    NONE,
    RERANKERS,
    alpha_query_expansion,
    augment_database,
    database_side_augmentation,
    k_reciprocal_distances,
    method_names,
)
from retrieval.rerank.shortlists import (
    MAX_QUERY_BYTES,
    Cancelled,
    RerankTooLarge,
    check_memory,
    one_blas_thread,
    peak_bytes,
    rerank_candidates,
    rerank_lists,
    work_units,
)

__all__ = [
    "API_KEY", "MAX_CANDIDATES", "MAX_QUERY_BYTES", "NONE", "PAPER_NEIGHBOURHOOD", "RERANKERS", "UNLABELLED_RELEVANT",
    "Cancelled", "Neighbourhood", "RerankConfig", "RerankTooLarge", "alpha_query_expansion", "augment_database",
    "check_memory", "database_side_augmentation", "gallery_filled", "k_reciprocal_distances", "method_names",
    "neighbourhood_from_counts", "neighbourhood_from_labels", "one_blas_thread", "peak_bytes", "rerank_candidates",
    "rerank_from_json", "rerank_lists", "with_gallery_defaults", "work_units",
]
