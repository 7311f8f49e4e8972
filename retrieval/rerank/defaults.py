"""Re-ranking's neighbourhood sizes from the gallery: what a request that sets none of ``k``, ``k1`` and ``k2`` gets.

The papers' values (k = 10 for αQE and DBA, k1 = 20 and k2 = 6 for k-reciprocal) suit their benchmarks, where a
query has tens of relevant images. A catalogue whose labels hold 3 to 17 images each, or a twin per image, is hurt
by them: the neighbourhood a method trusts is mostly other classes. The sizes follow R, the number of other images
of a query's kind a gallery typically holds (the median over its images of their label's count, less the image):

* qe and dba: k = R / 3, rounded, in [1, 5];
* kreciprocal: k1 = R in [3, 20], k2 = k1 / 3, rounded, in [1, 6].

Fitted on leave-one-out sweeps (pretrained and trained embeddings of digits, Fashion-MNIST and emoji, R from 1 to
59, docs/RESULTS.md "Re-ranking's neighbourhood sizes"); an unlabelled gallery, or one with fewer than half its images
labelled, is read as R = ``UNLABELLED_RELEVANT`` (neighbour statistics alone did not tell class sizes apart there).
Plain Python (the server imports it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from retrieval.rerank.config import PAPER_NEIGHBOURHOOD, RerankConfig

UNLABELLED_RELEVANT = 5  # R read for a gallery without labels: small neighbourhoods, which lose least where R = 1
MIN_LABELLED_SHARE = 0.5  # below it, the labels describe too little of the gallery to read R from


@dataclass(frozen=True)
class Neighbourhood:
    """How many other images of a query's kind the gallery typically holds (R), and how that was found."""

    relevant: int
    basis: str  # for people: "a typical image's label has 9 other images (...)", or why no label was read

    def params(self) -> dict[str, int]:
        """The neighbourhood sizes this R gives (``k``, ``k1``, ``k2``), each at most the paper's."""
        k1 = _clamp(self.relevant, 3, PAPER_NEIGHBOURHOOD["k1"])
        return {"k": _clamp(round(self.relevant / 3), 1, 5), "k1": k1,
                "k2": _clamp(round(k1 / 3), 1, PAPER_NEIGHBOURHOOD["k2"])}


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, int(value)))


def neighbourhood_from_counts(counts: Mapping[object, int]) -> Neighbourhood:
    """R from the images per label (``None``: the unlabelled ones): the median over the labelled images of their
    label's count less one; ``UNLABELLED_RELEVANT`` where fewer than half the images have a label."""
    labelled = {label: int(n) for label, n in counts.items() if label is not None and int(n) > 0}
    total = sum(int(n) for n in counts.values())
    images = sum(labelled.values())
    if not images or images < MIN_LABELLED_SHARE * total:
        what = "no image has a label" if not images else f"{images:,} of {total:,} images have a label"
        return Neighbourhood(UNLABELLED_RELEVANT, f"{what}: read as {UNLABELLED_RELEVANT} others of a kind")
    middle, seen = (images - 1) // 2, 0  # the image-weighted median: what a typical query's label holds
    for count in sorted(labelled.values()):
        seen += count
        if seen > middle:
            relevant = count - 1
            break
    others = "other image" if relevant == 1 else "other images"
    advice = ("; with so few, re-ranking has little neighbourhood to agree with and seldom helps (docs/INDEX.md)"
              if relevant < 2 else "")
    return Neighbourhood(relevant, f"a typical image's label has {relevant:,} {others} ({len(labelled):,} labels, "
                                   f"{images:,} images){advice}")


def neighbourhood_from_labels(labels: object) -> Neighbourhood:
    """``neighbourhood_from_counts`` of a label per image (an array or a list; None where an image has none)."""
    counts: dict[object, int] = {}
    for label in list(labels):  # type: ignore[call-overload]
        key = None if label is None else (label.item() if hasattr(label, "item") else label)
        counts[key] = counts.get(key, 0) + 1
    return neighbourhood_from_counts(counts)


def gallery_filled(config: RerankConfig, neighbourhood: Callable[[], Neighbourhood]
                   ) -> tuple[RerankConfig, str | None]:
    """``config`` with the sizes it left unset from the gallery (``neighbourhood()``, asked only when one is unset)
    and where they came from (None where it set them all): what the search command, the server and evaluate show."""
    if not config.unset():
        return config, None
    found = neighbourhood()
    return with_gallery_defaults(config, found), found.basis


def with_gallery_defaults(config: RerankConfig, neighbourhood: Neighbourhood) -> RerankConfig:
    """``config`` with each neighbourhood size it left unset taken from ``neighbourhood``; the sizes it set stay."""
    unset = config.unset()
    if not unset:
        return config
    derived = neighbourhood.params()
    return dataclasses.replace(config, **{name: derived[name] for name in unset})
