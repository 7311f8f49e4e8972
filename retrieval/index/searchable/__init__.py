"""What is served and searched, whatever holds it: an index folder (``Index``) or a Milvus collection (``MilvusIndex``).

- ``contract``: ``SearchableIndex``, the one protocol both implement (search, rows by id, the gallery, statistics),
  with the catalogue queries (``GalleryCatalogue``) and filter columns (``FilterColumns``) a server asks of either.
- ``opening``: the one factory: ``index_place`` names what is served (a folder, or a Milvus URI and collection) as an
  ``IndexPlace`` that opens it, once (``open_searchable``, the CLI's search) or state by state (a server's); the one
  place that tells the two apart.

Read side only: nothing here imports the index writer or torch.
"""
