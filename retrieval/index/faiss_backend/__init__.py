"""The faiss files of an index folder: choosing, building, tuning, reading and searching them.

- ``faiss_keys``: ``--index-key auto`` and its policy, memory estimates, the index factory.
- ``faiss_build``: the faiss part built from the shards (trained, filled, tuned) or updated to the catalogue.
- ``faiss_tuning``: the cheapest search-time setting reaching the recall target.
- ``faiss_params``: what an index is made of and its search-time parameters.
- ``faiss_files``: ``index.faiss`` read and written atomically, a damaged or forged file refused first.
- ``faiss_search``: search restricted to a selection of ids (``where``).
- ``faiss_measure``: exact neighbours, recall and latency against exact search.
- ``faiss_gpu``: GPU resources, GPU search and training.
"""
