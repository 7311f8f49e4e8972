"""Files other tools write or read: the embeddings a build takes as input, the tables ``index export`` writes, the
gallery's files as training images.

- ``embedding_input``: vectors someone already has (npy, parquet, ...), read as hostile input, chunk by chunk.
- ``embedding_checks``: that input's files checked from their headers and metadata, and each metadata value bounded.
- ``table_export``: an index's searchable images as parquet or CSV files.
- ``export_rows``: the rows an export writes, read from the catalogue and the shards, and their columns.
- ``export_files``: an export's part files, written under a temporary name and renamed into place.
- ``gallery_images``: an index's gallery (or any folder of images) as images without labels (``load_unlabelled``).
"""
