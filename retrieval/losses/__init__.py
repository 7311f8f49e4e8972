"""Deep-metric-learning losses: one registry, ``build(name, negatives=None, **hparams)``.

Every loss is an ``nn.Module`` called as ``loss(embeddings, labels)`` and returns a scalar tensor.
Pairs are formed from labels, never from positions in the batch. The pair-based losses are listed in
``losses/pair.py``; ``dcdl`` (discrepancy.py) adds a class-discrepancy term to any of them; the auxiliary
cross-entropy (auxiliary.py) is not registered: the trainer adds it (``--aux-ce``).

``negatives=None`` trains on the batch's own negatives; ``"loop" | "loop-linear" | "symm"`` feeds the loss's
pair-level form (``PairLoss.from_pair_terms``) with a hard-negative method of ``retrieval.negatives``
(``available_negatives()`` lists the combinations). ``wants_normalized(name)`` says whether a loss trains on
L2-normalised embeddings; ``has_rectangular_form(name)`` whether it also takes query rows against gallery rows
(``PairLoss.query_gallery``).

    catalog     every loss and method registered; ``build``, ``available``, ``describe`` and the rest read them
    standalone  every loss but dcdl registered (dcdl's local loss is one of them): what catalog and dcdl import
    registry    the registries (``LOSSES``, ``NEGATIVES``) and their decorators, a leaf module
    reads       the losses' statistics and checks kept on the device and read together (also used by the
                hard-negative methods, the device decoder, distributed evaluation and training)

The public names are imported on first use (PEP 562, ``retrieval.utils.lazy``): the losses are torch modules, and a
module that needs only ``registry`` or ``reads`` should load neither the losses nor their registrations.
"""

from retrieval.utils.lazy import lazy_exports

# public name -> the submodule that defines it
_SOURCES = {
    "catalog": ("available", "available_negatives", "build", "composable", "describe", "has_rectangular_form",
                "needs_classes", "wants_normalized"),
    "registry": ("register_loss",),
    "weights": ("pair_weights",),  # the weight view, unified Theorem 3.1
    "with_negatives": ("HardNegativeLoss",),
}
__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)
__all__ = sorted(name for names in _SOURCES.values() for name in names)
