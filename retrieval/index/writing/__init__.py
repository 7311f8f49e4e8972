"""The index folder's writers: building, adding, removing, repairing and upgrading (one writer at a time).

- ``writer``: ``build_index``, ``build_from_embeddings``, ``add_images``, ``remove_images``.
- ``repair``: ``repair_index``, which finishes or mends what a crash left.
- ``records``: what the writers share: the folder's record, the checks before writing, the gallery listed.
- ``collection_writes``: the writers of a folder whose vectors live in a Milvus collection.
- ``keyword_build``: the keyword index (SQLite FTS5 of a manifest's text columns) built and kept in step with the
  catalogue.
- ``mend``: the first steps of every writer (shards a crash left unrecorded, rows without a vector).
- ``upgrade``: ``retrieval index upgrade``, re-embedding the gallery with a new model while servers answer.
- ``upgrade_checks``: what an upgrade checks before it begins (the model's verdict, the index's labels) and the text
  model it turns off.
- ``upgrade_text``: the recorded text model measured on the index's captions before an upgrade that keeps it.
"""
