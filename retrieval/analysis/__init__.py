"""Analysis: the triplet diagram (SCT paper) and weight vs similarity plots (unified paper) in ``triplet_diagram``
and ``plots``; the results grid's definition (``grid``), its written discussion (``grid_discussion``) and its
document (``results``: JSON -> Markdown, read by the app's Results tab).

- ``pictures``: a grid of queries with their results and a 2-D map of the embeddings (an evaluation's too).
- ``neighbour_pictures``: near-duplicate groups and label suspects, drawn with their neighbours.
- ``plain_text``: text in pictures drawn as written (never read as mathtext).
- ``runs``: training runs compared: configurations, final metrics, learning curves (``retrieval runs compare``).

Import from the submodules: the package imports nothing, so that the app reading a results document (``results``,
no torch) does not load the plots' torch.
"""
