"""Image embedding retrieval toolkit: the core library.

Layout (read it like a map):
    retrieval.data       datasets, official splits, samplers, transforms, label noise, images without labels
    retrieval.models     backbone registry and ``create_embedder``
    retrieval.losses     deep-metric-learning losses, one registry, ``build(name, **hparams)``, their device reads
    retrieval.negatives  hard-negative generation (LoOp, Symmetrical Synthesis)
    retrieval.metrics    Recall@K, MAP@R, R-precision, NMI, F1, linear probe, the exact kNN they rank by, evaluation
    retrieval.index      faiss gallery index with a SQLite catalogue
    retrieval.rerank     re-ranking a shortlist (αQE, DBA, k-reciprocal), its sizes from the gallery
    retrieval.analysis   weight view, triplet diagram, plots
    retrieval.client     the HTTP API's Python client (``RetrievalClient``): httpx only, nothing of the server
    retrieval.utils      small shared helpers: files, heap, progress, registry, lazy package names, sizes
    retrieval.pseudo_labels  the groups that training without labels takes its positives from

The core never imports from ``train``, ``export``, ``serve`` or ``cli``.
"""

__version__ = "0.1.0"
