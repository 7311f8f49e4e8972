"""Analysis figures: the triplet diagram (SCT paper) and weight vs similarity plots (unified paper)."""

from retrieval.analysis.plots import plot_pair_weights, plot_triplet_diagram
from retrieval.analysis.triplet_diagram import POSITIVE_CHOICES, TripletDiagram, triplet_diagram

__all__ = [
    "POSITIVE_CHOICES",
    "TripletDiagram",
    "plot_pair_weights",
    "plot_triplet_diagram",
    "triplet_diagram",
]
