"""Deep-metric-learning losses: one registry, ``build(name, negatives=None, **hparams)``.

Every loss is an ``nn.Module`` called as ``loss(embeddings, labels)`` and returns a scalar tensor.
Pairs are formed from labels, never from positions in the batch. Every loss and hard-negative method is named in
``registry.py``'s table, one line each; ``dcdl`` (discrepancy.py) adds a class-discrepancy term to another of them,
built by name; the auxiliary cross-entropy (auxiliary.py) is not registered: the trainer adds it (``--aux-ce``).

``negatives=None`` trains on the batch's own negatives; ``"loop" | "loop-linear" | "symm"`` feeds the loss's
pair-level form (``PairLoss.from_pair_terms``) with a hard-negative method of ``retrieval.negatives``
(``available_negatives()`` lists the combinations). ``wants_normalized(name)`` says whether a loss trains on
L2-normalised embeddings; ``has_rectangular_form(name)`` whether it also takes query rows against gallery rows
(``PairLoss.query_gallery``).

- ``registry``: ``LOSSES`` and ``NEGATIVES``: name -> ``"module:Class"``, each imported when first used; a leaf that
  imports no loss and no torch.
- ``factory``: ``build``, the one factory, and ``describe``, ``available_negatives`` and what a loss wants.
- ``base``: ``PairLoss``, the pair-based losses' shared form (similarity matrix -> loss, label masks, batch checks).
- ``with_negatives``: a base loss fed by a hard-negative method (what ``build(name, negatives=method)`` returns).
- ``contrastive``: the contrastive loss (cosine form; distance form with two margins).
- ``triplet``: margin triplet losses (all, semi-hard, batch-hard) and HPHN triplet.
- ``nca``: the SCT paper's NCA-form triplet losses (HN / SHN mining, SCT).
- ``lifted``: lifted-structure losses (smooth, hinge, generalised).
- ``npair``: N-pair, angular, and N-pair + angular on raw features.
- ``weighting``: soft pair-weighting losses (binomial deviance, RAW, multi-similarity).
- ``ntxent``: NT-Xent, SimCLR's contrastive loss, for any labelled batch.
- ``proxy``: proxy-based losses (every class has learnt proxies).
- ``miners``: pair and triplet miners: boolean masks, no gradients.
- ``memory``: the cross-batch memory (XBM).
- ``discrepancy``: DCDL, the class-wise discrepancy term added to another loss.
- ``sinkhorn``: the debiased Sinkhorn divergence DCDL computes.
- ``compatible``: backward-compatible training's influence term (BCT).
- ``auxiliary``: the auxiliary cross-entropy head (``--aux-ce``).
- ``regularizers``: robust fine-tuning's regularisers (L2-SP, feature distillation).
- ``weights``: the weight view of a pair-based loss (unified paper, Theorem 3.1).

What a loss reads back from the device (its statistics and batch checks) is ``retrieval.utils.reads``, which the
hard-negative methods import too. The public names are imported on first use (PEP 562, ``retrieval.utils.lazy``):
the losses are torch modules, and a module that needs only the names should load none of them.
"""

from retrieval.utils.lazy import lazy_exports

# public name -> the submodule that defines it
_SOURCES = {
    "factory": ("available_negatives", "build", "composable", "describe", "has_rectangular_form", "needs_classes",
                "wants_normalized"),
    "registry": ("available",),
    "weights": ("pair_weights",),  # the weight view, unified Theorem 3.1
    "with_negatives": ("HardNegativeLoss",),
}
__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)
__all__ = sorted(name for names in _SOURCES.values() for name in names)
