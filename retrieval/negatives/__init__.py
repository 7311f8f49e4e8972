"""Hard-negative generation: LoOp (optimal points between arcs/segments) and Symmetrical Synthesis.

Each method is a ``HardNegativeMethod`` named in ``retrieval.losses.registry.NEGATIVES``: for a batch's positive
pairs it returns ``PairTerms`` (positive terms, hardest negatives, mask, statistics), which a loss's pair-level form
consumes; build the pair with ``retrieval.losses.build(name, negatives=...)``. Nothing here imports
``retrieval.losses``: what the methods share with the losses (``Stat``, the host copies) is ``retrieval.utils.reads``.

- ``base``: ``PairTerms`` (what a method hands a loss) and the methods' base class.
- ``pairs``: positive pairs and pair-of-pairs combinations, formed from labels.
- ``loop``: LoOp: optimal hard negatives between two geodesic arcs (or line segments).
- ``symm``: Symmetrical Synthesis: points by reflection, the hardest of 16 negative pairs.
- ``points``: the four points of a Symm pair, as combinations of the pair's originals.
- ``kernels``: speed kernels of the hard-negative maths (``hardest_combination`` dispatches to them).
"""

from retrieval.negatives.base import HardNegativeMethod, PairTerms
from retrieval.negatives.loop import (
    LoOp,
    LoOpLinear,
    optimal_arc_distance,
    optimal_segment_distance,
    pair_of_pairs_distances,
)
from retrieval.negatives.pairs import expected_combinations, pair_combinations, positive_pairs
from retrieval.negatives.symm import SymmetricalSynthesis, reflect

__all__ = [
    "HardNegativeMethod",
    "LoOp",
    "LoOpLinear",
    "PairTerms",
    "SymmetricalSynthesis",
    "expected_combinations",
    "optimal_arc_distance",
    "optimal_segment_distance",
    "pair_combinations",
    "pair_of_pairs_distances",
    "positive_pairs",
    "reflect",
]
