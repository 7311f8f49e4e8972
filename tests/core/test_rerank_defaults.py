"""Re-ranking's neighbourhood sizes from the gallery: R read from the labels (the median over images of the others
sharing their label), the sizes it gives, and a request's own sizes kept."""

from __future__ import annotations

import numpy as np
import pytest

from retrieval.rerank import (
    PAPER_NEIGHBOURHOOD,
    UNLABELLED_RELEVANT,
    Neighbourhood,
    RerankConfig,
    gallery_filled,
    neighbourhood_from_counts,
    neighbourhood_from_labels,
    peak_bytes,
    with_gallery_defaults,
    work_units,
)


def others_of_a_typical_image(counts: dict) -> int:
    """The reference: every labelled image listed with the others of its label, the lower median taken."""
    others = sorted(n - 1 for label, n in counts.items() if label is not None for _ in range(n))
    return others[(len(others) - 1) // 2]


@pytest.mark.parametrize("counts", [
    {"a": 3, "b": 17},
    {"a": 2, "b": 2, "c": 2},
    {"x": 1, "y": 5, "z": 9, None: 4},
    {str(i): n for i, n in enumerate(np.random.default_rng(0).integers(1, 40, size=50).tolist())},
])
def test_the_typical_class_size_is_the_median_over_images(counts):
    assert neighbourhood_from_counts(counts).relevant == others_of_a_typical_image(counts)


def test_a_big_class_weighs_by_its_images_not_as_one_label():
    # 10 labels of 2 images and one of 100: a typical image (100 of 120) has 99 others
    counts = {str(i): 2 for i in range(10)} | {"big": 100}
    assert neighbourhood_from_counts(counts).relevant == 99


@pytest.mark.parametrize("counts", [{None: 40}, {"a": 5, None: 40}, {}])
def test_a_mostly_unlabelled_gallery_gets_the_unlabelled_reading(counts):
    neighbourhood = neighbourhood_from_counts(counts)
    assert neighbourhood.relevant == UNLABELLED_RELEVANT
    assert "label" in neighbourhood.basis


def test_labels_as_an_array_or_a_list_give_the_same_reading():
    labels = [0, 0, 0, 1, 1, 2, 2, 2, 2, 2]
    assert neighbourhood_from_labels(np.asarray(labels)) == neighbourhood_from_labels(labels)
    assert neighbourhood_from_labels(labels).relevant == 2  # the lower median of 1, 1, 2, 2, 2, 4, 4, 4, 4, 4


@pytest.mark.parametrize("relevant,expected", [
    (0, {"k": 1, "k1": 3, "k2": 1}),
    (1, {"k": 1, "k1": 3, "k2": 1}),
    (13, {"k": 4, "k1": 13, "k2": 4}),
    (59, {"k": 5, "k1": 20, "k2": 6}),
    (10_000, {"k": 5, "k1": 20, "k2": 6}),
])
def test_the_sizes_follow_the_typical_class_size(relevant, expected):
    assert Neighbourhood(relevant, "").params() == expected


def test_no_derived_size_passes_the_papers():
    for relevant in range(0, 200):
        params = Neighbourhood(relevant, "").params()
        assert all(params[name] <= PAPER_NEIGHBOURHOOD[name] for name in params)


def test_unset_sizes_come_from_the_gallery_and_set_ones_stay():
    small = Neighbourhood(2, "")
    filled = with_gallery_defaults(RerankConfig(method="kreciprocal", k1=15), small)
    assert (filled.k1, filled.k2) == (15, small.params()["k2"])
    assert with_gallery_defaults(RerankConfig(method="qe"), small).k == 1
    assert with_gallery_defaults(RerankConfig(method="qe", k=7), small).k == 7
    assert RerankConfig(method="qe").unset() == ("k",) and RerankConfig(method="qe", k=3).unset() == ()
    assert RerankConfig().unset() == ()


def test_an_unset_size_is_charged_and_bounded_as_the_papers_the_most_a_gallery_sets():
    for method in ("qe", "dba", "kreciprocal"):
        unset = RerankConfig(method=method, candidates=500)
        papers = RerankConfig(method=method, candidates=500, **PAPER_NEIGHBOURHOOD)
        assert work_units(unset, 256) == work_units(papers, 256)
        assert peak_bytes(unset, 256) == peak_bytes(papers, 256)
        smallest = with_gallery_defaults(unset, Neighbourhood(0, ""))
        assert work_units(smallest, 256) <= work_units(unset, 256)
        assert peak_bytes(smallest, 256) <= peak_bytes(unset, 256)


def test_a_gallery_of_twins_is_told_that_re_ranking_seldom_helps():
    assert "seldom helps" in neighbourhood_from_labels([0, 0, 1, 1, 2, 2]).basis
    assert "seldom helps" not in neighbourhood_from_labels([0, 0, 0, 1, 1, 1]).basis


def test_the_gallery_is_read_only_when_a_size_is_left_unset():
    def never():
        raise AssertionError("the gallery was read for a request that set every size")

    assert gallery_filled(RerankConfig(method="qe", k=3), never) == (RerankConfig(method="qe", k=3), None)
    assert gallery_filled(RerankConfig(), never) == (RerankConfig(), None)
    filled, basis = gallery_filled(RerankConfig(method="kreciprocal"), lambda: Neighbourhood(13, "thirteen"))
    assert (filled.k1, filled.k2, basis) == (13, 4, "thirteen")
