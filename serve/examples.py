"""The app's example queries, chosen by one rule (docs/SERVING.md, "Example queries"), never by hand.

In a gallery with two labels or more: the most typical image of each of its largest labels, largest first (ties by
name): of up to ``MAX_PER_LABEL`` of the label's images, the one whose vector is nearest the label's mean direction.
A visitor's first click then shows what the gallery's labels mean, rather than whatever image an id happens to hold.
In an unlabelled gallery, or one whose index cannot give its vectors back: images spread evenly over the catalogue.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from retrieval.index.faiss_backend.faiss_search import NoStoredVectors

MAX_PER_LABEL = 1000  # vectors read per label at most: the mean of a thousand is as telling as of a million


def example_ids(state: Any, count: int) -> list[int]:
    """The ids of up to ``count`` example queries of a served state (``ServedIndex``), by the rule above."""
    by_label: dict[str, list[int]] = defaultdict(list)
    for image_id, label in state.catalogue.labelled():
        by_label[label].append(int(image_id))
    if len(by_label) < 2:
        return [int(row["id"]) for row in state.catalogue.sample(count)]
    largest = sorted(by_label, key=lambda label: (-len(by_label[label]), label))[:count]
    chosen = []
    for label in largest:
        ids = np.asarray(by_label[label][:MAX_PER_LABEL], dtype=np.int64)
        try:
            vectors = np.asarray(state.index.reconstructed_vectors(ids), dtype=np.float32)
        except NoStoredVectors:
            return [int(row["id"]) for row in state.catalogue.sample(count)]
        chosen.append(int(ids[int(np.argmax(vectors @ vectors.mean(axis=0)))]))
    return chosen
