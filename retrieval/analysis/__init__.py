"""Analysis: the triplet diagram (SCT paper) and weight vs similarity plots (unified paper) in ``triplet_diagram``
and ``plots``; the results grid's definition (``grid``), its written discussion (``grid_discussion``) and its
document (``results``: JSON -> Markdown, read by the app's Results tab).

Import from the submodules: the package imports nothing, so that the app reading a results document (``results``,
no torch) does not load the plots' torch.
"""
