"""The engines that decode and embed a gallery's images into shards: local (this process) and Ray (a cluster).

- ``engine``: what an engine is (``IngestEngine``) and the index commands' settings (``IngestOptions``).
- ``engines``: the engines by name (``--engine``).
- ``ingest``: the pending catalogue rows decoded, embedded and written as shards (``Ingestor``); ``LocalEngine``.
- ``decode``, ``gallery_file``: one gallery file hashed, decoded and preprocessed; the local workers' batches.
- ``embed_rows``: catalogued files embedded a batch at a time (upgrades, model comparisons).
- ``ray_engine``, ``ray_stages``, ``ray_collection``: ``--engine ray`` (its Ray Data stages, and the one that
  writes into a Milvus collection).
"""
