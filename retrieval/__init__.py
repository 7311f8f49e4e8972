"""Image embedding retrieval toolkit: the core library.

Its map (what may import what: docs/ARCHITECTURE.md, "The core's package order"):

- ``data``: data sets, official splits, samplers, transforms, label noise, THE image decoder, images without labels.
- ``models``: the backbone registry, ``create_embedder`` and checkpoints.
- ``losses``: deep-metric-learning losses, one registry, ``build(name, **hparams)``.
- ``negatives``: hard-negative generation (LoOp, Symmetrical Synthesis).
- ``metrics``: Recall@K, MAP@R, R-precision, NMI, F1, linear probe, the exact kNN they rank by, evaluation.
- ``index``: the gallery index: faiss and a SQLite catalogue (or a Milvus collection), read and written.
- ``text``: search by text: the text tower, keywords over the catalogue, their fusion.
- ``rerank``: re-ranking a shortlist (αQE, DBA, k-reciprocal), its sizes from the gallery.
- ``analysis``: the results grid, plots and pictures, run comparison.
- ``client``: the HTTP API's Python client (``RetrievalClient``): httpx only, nothing of the server.
- ``utils``: small shared helpers: files, heap, progress, registry, lazy package names, sizes.
- ``records``: the typed records of the JSON that crosses packages: index.json, a model's config, a run's config.
- ``errors``: ``ParameterError``, the core's error for a bad argument, naming the function's own parameter.
- ``options``: an option declared once (the command line, config files and the docs' tables come from it).
- ``extras``: the install's optional parts, and the words that name the one a feature lacks.
- ``reports``: the run report format (report.json).
- ``distances``: similarity, distance and numerically safe reductions every loss shares.
- ``inference``: batch inference shared by training, evaluation and indexing.
- ``distributed``: cross-rank batches for data-parallel training.
- ``onnx_runtime``: an exported embedder run with onnxruntime (``OnnxEmbedder``) and the ONNX metadata contract.
- ``compatibility``: how two embedders relate: BCT's verdict, and the neighbours a new model keeps.
- ``pseudo_labels``: the groups that training without labels takes its positives from.
- ``near_duplicates``, ``gallery_option``: leaves the command line declares options from (``index add``'s
  near-duplicate check, ``--gallery-root``).
- ``__main__``: ``python -m retrieval``, the ``retrieval`` command.

The core never imports from ``train``, ``export``, ``serve`` or ``cli``.
"""

__version__ = "0.1.0"
