"""An index held in a Milvus collection: pushed from a folder, written by a Ray build, searched by a server.

- ``milvus_collection``: where a collection is (``MilvusPlace``), what it records, its schema and vector index, and
  ``where`` filters as Milvus expressions (the read side's facts).
- ``milvus_client``: the pymilvus client that loads a released collection and says when Milvus is unreachable.
- ``milvus_index``: ``MilvusIndex``, searched as ``Index`` searches a folder.
- ``milvus_keywords``: an index's ``text_columns`` as a BM25 full-text field, and ``MilvusKeywords``, the keyword
  search a folder's FTS5 file answers, answered by Milvus.
- ``milvus_push``: ``retrieval index push`` and the syncs of ``index add|remove|upgrade --milvus``.
- ``milvus_build``: the collection side of ``index build --engine ray --milvus``.
"""
