"""Hard-negative generation: LoOp (optimal points between arcs/segments) and Symmetrical Synthesis.

The losses that use them live in ``retrieval.negatives.losses`` and register themselves with
``retrieval.losses.register_negatives``; build them with ``retrieval.losses.build(name, negatives=...)``.
"""

from retrieval.negatives.loop import optimal_arc_distance, optimal_segment_distance, pair_of_pairs_distances
from retrieval.negatives.pairs import expected_combinations, pair_combinations, positive_pairs
from retrieval.negatives.symm import reflect

__all__ = [
    "expected_combinations",
    "optimal_arc_distance",
    "optimal_segment_distance",
    "pair_combinations",
    "pair_of_pairs_distances",
    "positive_pairs",
    "reflect",
]
