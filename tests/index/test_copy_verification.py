"""Near-duplicates verified as copies (``copy_verification``): groups never chain two images that are not verified
against each other, the rules are calibrated between planted copies and the distinct pairs that align, candidate
pairs are all checked in any order and Ctrl-C keeps what was checked, each image's features are computed once while
cached, the estimated precision falls as distinct pairs pass; and end to end on a real index: planted copies are
grouped with their original, a colour variant is listed apart as similar, never as a copy."""

from __future__ import annotations

import _thread
import dataclasses
import signal
import threading
import time

import numpy as np
import pytest
from PIL import Image
from planted import fashion_item, graph_of, projection_model, write_items

from retrieval.errors import ParameterError
from retrieval.index import Index, IngestOptions, build_index
from retrieval.index.curation.catalogued_images import catalogued_image_loader
from retrieval.index.curation.copy_calibration import (
    COPY_KINDS,
    CORRELATION_MARGIN,
    LOOSE_COLOUR,
    LOOSE_CORRELATION,
    MIN_CANDIDATE_COSINE,
    TIGHT_COLOUR,
    TIGHT_CORRELATION,
    VerificationCalibration,
    calibrate_verification,
    choose_rules,
    distinct_neighbours,
    group_precision,
)
from retrieval.index.curation.copy_check import PairComparison, colour_difference
from retrieval.index.curation.copy_planting import plant_colour_variant, plant_copies
from retrieval.index.curation.copy_verification import (
    CheckedPair,
    CopyRules,
    FeatureCache,
    Verification,
    check_workers,
    copy_groups,
    verify_pairs,
)
from retrieval.index.curation.duplicates import DuplicateOptions, find_duplicates
from retrieval.index.curation.linked_groups import duplicate_links
from retrieval.index.curation.neighbour_graph import index_graph
from retrieval.index.query_embedder import NoModel

QUICK = IngestOptions(batch_size=32, workers=0, shard_size=64, progress=False)
WHITE = (255, 255, 255)


def measured(correlation: float = 0.99, inliers: int = 20, colour: float = 0.5, overlap: float = 0.9,
             coloured: int = 500) -> PairComparison:
    return PairComparison(2 * inliers, inliers, 1.0, 0.0, overlap, correlation, colour, coloured)


def checked(a: int, b: int, verified: bool = True, correlation: float = 0.99) -> CheckedPair:
    return CheckedPair(a, b, 0.95, measured(correlation), None if verified else "content differs")


def as_sets(groups) -> list[list[int]]:
    return [g.ids.tolist() for g in groups]


def one_by_one(compare):
    """``copy_groups``' check (a batch of pairs) answered by ``compare(a, b)`` pair by pair."""
    def check(first: np.ndarray, second: np.ndarray) -> Verification:
        pairs = [compare(a, b) for a, b in zip(first.tolist(), second.tolist(), strict=True)]
        return Verification(pairs, len(pairs), 0.0)

    return check


# --- groups never chain
CHAIN = (1, 2), (2, 3), (3, 4)  # 2 and 3 each verified against two others: 2 (the lower id) is the first


def test_an_image_verified_only_against_a_member_is_checked_against_the_first_and_left_out():
    """A chain 1 ~ 2 ~ 3 ~ 4, verified pair by pair, 2 ~ 4 checked and failing: 4 never joins 2's group."""
    asked = []

    def check(a: int, b: int) -> CheckedPair:
        asked.append((a, b))
        return checked(a, b, verified=False)

    groups = copy_groups([checked(a, b) for a, b in CHAIN], one_by_one(check))
    assert asked == [(2, 4)]  # the extra check of the image linked to the first only through another
    assert as_sets(groups) == [[2, 1, 3]]
    assert not any(4 in ids for ids in as_sets(groups))


def test_the_first_is_the_image_verified_against_the_most_others():
    """Four crops verified against their original (id 5), not against each other: one group around the original,
    which the removal keeps, and no extra check."""
    groups = copy_groups([checked(i, 5) for i in range(1, 5)],
                         one_by_one(lambda a, b: pytest.fail("no extra check needed")))
    assert as_sets(groups) == [[5, 1, 2, 3, 4]]


def test_without_a_check_an_image_linked_only_through_another_stays_out():
    groups = copy_groups([checked(a, b) for a, b in CHAIN], check=None)
    assert as_sets(groups) == [[2, 1, 3]]


def test_an_extra_check_that_verifies_joins_the_image_to_the_first():
    extra = checked(2, 4, correlation=0.93)
    groups = copy_groups([checked(a, b) for a, b in CHAIN], one_by_one(lambda a, b: extra))
    assert as_sets(groups) == [[2, 1, 3, 4]]
    assert [(p.first, p.second) for p in groups[0].pairs] == [(1, 2), (2, 3), (2, 4)] and groups[0].pairs[2] is extra


def test_images_left_out_of_a_group_form_their_own_around_their_best_linked():
    pairs = [checked(1, 2), checked(1, 3), checked(1, 4), checked(5, 6), checked(6, 7), checked(4, 5)]
    groups = copy_groups(pairs, one_by_one(lambda a, b: checked(a, b, verified=False)))
    assert as_sets(groups) == [[1, 2, 3, 4], [6, 5, 7]]


def test_extra_checks_stop_at_their_budget_and_at_ctrl_c():
    asked = []
    chain = [checked(i, i + 1) for i in range(1, 9)]
    copy_groups(chain, one_by_one(lambda a, b: asked.append((a, b)) or checked(a, b, verified=False)), max_checks=2)
    assert len(asked) == 2

    def interrupted(a: int, b: int) -> CheckedPair:
        raise KeyboardInterrupt

    groups = copy_groups(chain, one_by_one(interrupted))
    assert groups and all(len(g.ids) == len(g.pairs) + 1 for g in groups)  # grouped from the pairs checked


def test_unverified_pairs_make_no_group_and_groups_come_largest_first():
    assert copy_groups([checked(1, 2, verified=False)], one_by_one(checked)) == []
    groups = copy_groups([checked(1, 2), checked(5, 6), checked(5, 7), checked(6, 7)])
    assert as_sets(groups) == [[5, 6, 7], [1, 2]]


def near_neighbour_links(n: int, k: int = 10, seed: int = 0) -> list[CheckedPair]:
    """Copies of one picture as the neighbour graph links them: each image verified against ``k`` others at random
    (near-identical images are each other's nearest in no particular order), each pair once."""
    rng = np.random.default_rng(seed)
    links = {tuple(sorted((i, int(j)))) for i in range(n) for j in rng.choice(n, k, replace=False) if j != i}
    return [checked(a, b) for a, b in sorted(links)]


def test_copies_of_one_picture_make_one_group_however_many_they_are():
    """1,200 copies of one picture, each verified against 10 others: one group, its first compared once with each
    image it was not verified against (one round of extra checks), never a group per neighbourhood."""
    asked = []
    links = near_neighbour_links(1200)
    groups = copy_groups(links, one_by_one(lambda a, b: asked.append((a, b)) or checked(a, b)))
    assert len(groups) == 1 and sorted(groups[0].ids.tolist()) == list(range(1200))
    first = int(groups[0].ids[0])
    assert len(asked) == len(set(asked)) <= 1199 and all(first in pair for pair in asked)


def test_a_long_chain_is_grouped_in_time_that_grows_with_its_links():
    """60,000 images verified in a chain (each against the next two), no check left: grouped in a few seconds (each
    round looks at its first's links, not at every image left), each group its first and its links."""
    n = 60_000
    chain = [checked(i, j) for i in range(n) for j in (i + 1, i + 2) if j < n]
    began = time.perf_counter()
    groups = copy_groups(chain)
    assert time.perf_counter() - began < 10
    placed = [i for g in groups for i in g.ids.tolist()]
    assert len(placed) == len(set(placed)) and len(placed) >= n * 0.9
    assert all(len(g.ids) <= 5 and all(abs(int(i) - int(g.ids[0])) <= 2 for i in g.ids) for g in groups)


def test_the_smaller_sets_get_their_checks_before_a_large_one():
    """A budget of 5 extra checks, a chain of 4 (one check needed: 901 ~ 903) and a large set of 60 (dozens
    needed) of lower ids: the chain is checked first and grouped whole."""
    asked = []
    large = [checked(p.first + 100, p.second + 100) for p in near_neighbour_links(60, k=3)]
    groups = copy_groups([*large, *(checked(a, a + 1) for a in range(900, 903))],
                         one_by_one(lambda a, b: asked.append((a, b)) or checked(a, b)), max_checks=5)
    assert asked[0] == (901, 903) and len(asked) == 5
    assert [901, 900, 902, 903] in as_sets(groups)


@pytest.mark.parametrize("seed", range(6))
def test_every_member_of_a_group_is_verified_against_its_first(seed):
    """Random verified and failed pairs among 40 images, and an extra check with its own verdicts: every group's
    members are verified against its first image, by a pair checked already or an extra check; an image
    is in one group at most; no verified pair is left with both its images outside every group."""
    rng = np.random.default_rng(seed)
    verdict = {}
    pairs = []
    for a, b in {tuple(sorted(rng.choice(40, 2, replace=False).tolist())) for _ in range(90)}:
        pairs.append(checked(a, b, verified=bool(rng.random() < 0.6)))
        verdict[(a, b)] = pairs[-1].verified
    extra = {}

    def check(a: int, b: int) -> CheckedPair:
        assert (a, b) not in verdict and a < b  # only pairs not checked yet, the lower id first
        extra[(a, b)] = bool(rng.random() < 0.5)
        return checked(a, b, verified=extra[(a, b)])

    groups = copy_groups(pairs, one_by_one(check))
    placed = [i for g in groups for i in g.ids.tolist()]
    assert len(placed) == len(set(placed))
    for group in groups:
        ids = group.ids.tolist()
        assert ids[1:] == sorted(ids[1:]) and len(ids) >= 2 and len(group.pairs) == len(ids) - 1
        for member, pair in zip(ids[1:], group.pairs, strict=True):
            key = (min(ids[0], member), max(ids[0], member))
            assert (pair.first, pair.second) == key and pair.verified
            assert verdict.get(key, extra.get(key)) is True
    assert not [p for p in pairs if p.verified and p.first not in placed and p.second not in placed]


# --- the rules
def test_the_correlation_cut_sits_a_margin_below_the_planted_copies():
    copies = [measured(c) for c in np.linspace(0.94, 0.99, 40)]
    floor = float(np.quantile(np.linspace(0.94, 0.99, 40), 0.05))
    rules = choose_rules(copies, [measured(0.2, inliers=2)], [])
    assert rules.correlation == pytest.approx(floor - CORRELATION_MARGIN, abs=1e-4)


def test_the_correlation_cut_stays_above_a_distinct_pair_that_aligns():
    copies = [measured(c) for c in np.linspace(0.90, 0.99, 40)]
    aligned = measured(0.93)  # two alike silhouettes: features agree, the contents correlate
    rules = choose_rules(copies, [aligned, measured(0.5)], [])
    assert rules.correlation > 0.93 and rules.reason(aligned) == "content differs"
    assert LOOSE_CORRELATION <= rules.correlation <= TIGHT_CORRELATION
    # a distinct pair without geometric agreement does not move the cut, however its pixels correlate
    unaligned = choose_rules(copies, [measured(0.99, inliers=2), measured(0.99, overlap=0.1)], [])
    assert unaligned.correlation == choose_rules(copies, [], []).correlation < 0.93


@pytest.mark.parametrize(("copies", "distinct", "cut"), [
    (np.linspace(0.5, 0.9, 30), [], LOOSE_CORRELATION),  # poor copies do not open the cut below the loose one
    (np.linspace(0.95, 1.0, 30), [0.995], TIGHT_CORRELATION),  # a distinct pair at 0.995 does not close it
    ([], [], TIGHT_CORRELATION - CORRELATION_MARGIN),  # no copy aligned: the tight cut, less the margin
])
def test_the_correlation_cut_is_kept_within_loose_and_tight(copies, distinct, cut):
    rules = choose_rules([measured(c) for c in copies], [measured(c) for c in distinct], [])
    assert rules.correlation == pytest.approx(cut, abs=1e-4)


@pytest.mark.parametrize("seed", range(5))
def test_any_cut_is_within_bounds_and_above_aligned_distinct_pairs_where_it_can_be(seed):
    rng = np.random.default_rng(seed)
    copies = [measured(c, inliers=int(i)) for c, i in zip(rng.uniform(0.6, 1.0, 30), rng.integers(0, 40, 30),
                                                         strict=True)]
    distinct = [measured(c, inliers=int(i)) for c, i in zip(rng.uniform(0.3, 0.96, 10), rng.integers(0, 8, 10),
                                                           strict=True)]
    rules = choose_rules(copies, distinct, [])
    assert LOOSE_CORRELATION <= rules.correlation <= TIGHT_CORRELATION
    aligned = [c.correlation for c in distinct if c.inliers >= 4]
    if aligned:
        assert rules.correlation > max(aligned)


def test_the_colour_cut_lies_between_the_copies_and_the_colour_variants():
    copies = [measured(colour=c) for c in np.linspace(0.0, 1.0, 20)]
    variants = [measured(colour=c) for c in (14.0, 30.0, 60.0)]
    rules = choose_rules(copies, [], variants)
    assert 1.0 < rules.colour_mismatch < 14.0
    assert TIGHT_COLOUR <= choose_rules(copies, [], [measured(colour=90.0)]).colour_mismatch <= LOOSE_COLOUR
    assert choose_rules(copies, [], [measured(colour=0.6)]).colour_mismatch == TIGHT_COLOUR  # variants among copies


def test_copies_and_distinct_pairs_count_for_the_cuts_whatever_their_colour_mismatch():
    """Planted JPEG and brightened copies keep their hue only to 2 to 9 degrees (copy_check.colour_difference),
    colour variants differ by 25 or more: the geometric tests that choose which pairs set the cuts are features and
    overlap, not colour."""
    correlations = np.linspace(0.94, 0.99, 40)
    copies = [measured(c, colour=m) for c, m in zip(correlations, np.linspace(1.5, 6.0, 40), strict=True)]
    rules = choose_rules(copies, [], [measured(0.97, colour=m) for m in (30.0, 45.0)])
    assert rules.correlation == pytest.approx(float(np.quantile(correlations, 0.05)) - CORRELATION_MARGIN, abs=1e-4)
    assert rules.colour_mismatch == pytest.approx((float(np.quantile(np.linspace(1.5, 6.0, 40), 0.95)) + 30.0) / 2,
                                                  abs=1e-3)
    aligned = measured(0.95, colour=4.0)  # a distinct pair that aligns, colours a little apart, as JPEG leaves them
    assert choose_rules(copies, [aligned], []).reason(aligned) is not None
    low = [measured(colour=c) for c in np.linspace(0.0, 1.0, 20)]
    assert choose_rules(low, [], [measured(colour=c) for c in (14.0, 30.0)]).colour_mismatch == \
        pytest.approx((0.95 + 14.0) / 2, abs=1e-3)  # halfway to the closest variant
    assert choose_rules(low, [], [measured(colour=90.0)]).colour_mismatch == LOOSE_COLOUR  # never looser


def test_the_rules_say_why_a_pair_is_not_a_copy():
    rules = CopyRules(correlation=0.9, colour_mismatch=12.0)
    assert rules.reason(measured(0.95, colour=3.0)) is None
    assert rules.reason(measured(0.99, inliers=3)) == "no geometric agreement"
    assert rules.reason(measured(0.99, overlap=0.2)) == "no plausible alignment"
    assert rules.reason(PairComparison(10, 8)) == "no plausible alignment"  # no transform fitted
    assert rules.reason(measured(0.89)) == "content differs"
    assert rules.reason(measured(0.99, colour=12.5)) == "colours differ"


# --- the calibration's estimates
def calibration(false_verified: int, distinct: int = 40, copies_per_kind: int = 10) -> VerificationCalibration:
    rules = CopyRules(0.9, 12.0)
    copy_checks = {kind: [measured(0.97)] * (copies_per_kind - 1) + [measured(0.5)] for kind in COPY_KINDS}
    distinct_checks = [measured(0.95) for _ in range(false_verified)] + \
        [measured(0.99, inliers=2) for _ in range(distinct - false_verified)]
    return VerificationCalibration(0.8, rules, copies_per_kind, {k: [0.9] * copies_per_kind for k in COPY_KINDS},
                                   copy_checks, [measured(0.99, colour=40.0)] * 5, distinct_checks)


def test_the_precision_is_a_probability_that_falls_as_distinct_pairs_pass():
    estimates = [calibration(k) for k in (0, 1, 3, 10)]
    rates = [c.false_rate for c in estimates]
    precisions = [c.precision(verified_share=0.3) for c in estimates]
    assert rates == sorted(rates) and len(set(rates)) == 4
    assert precisions == sorted(precisions, reverse=True) and len(set(precisions)) == 4
    assert all(0.0 < p < 1.0 for p in precisions)
    assert rates[0] == pytest.approx(0.5 / 46)  # Jeffreys: none of 45 distinct pairs and variants is never 0
    assert rates[2] == pytest.approx(3.5 / 46)
    assert estimates[0].false_verified == 0 and estimates[2].false_verified == 3
    # Bayes' rule: the planted copies' recall R against the distinct pairs' rate f, the share of copies among the
    # candidates read back from the share verified v: (v - f) / (R - f)
    recall, false = estimates[2].copy_recall, rates[2]
    prior = (0.3 - false) / (recall - false)
    assert precisions[2] == pytest.approx(recall * prior / (recall * prior + false * (1 - prior)))
    assert estimates[2].precision(0.6) > estimates[2].precision(0.3) > estimates[2].precision(0.1) > 0.0
    # no more verified than distinct pairs would give by chance: nothing can be claimed
    assert estimates[2].precision(false) < 1e-3 and estimates[2].precision(0.0) < 1e-3
    missed = dataclasses.replace(estimates[2], candidate_cosine=0.95)  # no planted copy is a candidate
    assert missed.precision(0.3) < 0.01


def test_the_calibration_reports_recall_by_kind_and_warns_of_distinct_pairs_verified():
    clean, leaky = calibration(0), calibration(2)
    assert clean.copy_recall == pytest.approx(0.9) and clean.recall_by_kind() == {k: 0.9 for k in COPY_KINDS}
    assert clean.warning is None
    assert "2 of 45 distinct pairs" in leaky.warning
    below = dataclasses.replace(clean, candidate_cosine=0.95)  # the copies' cosines (0.9) are no candidates
    assert below.copy_recall == 0.0 and "only 0%" in below.warning
    summary = leaky.to_dict()
    assert summary["false_verified"] == 2 and summary["copies"] == 10 * len(COPY_KINDS)
    assert summary["rules"]["correlation"] == 0.9


def test_a_groups_precision_falls_with_each_member_it_holds():
    estimate = calibration(3)
    pair = copy_groups([checked(1, 2)])[0]
    three = copy_groups([checked(1, 2), checked(1, 3)])[0]
    assert group_precision(pair, estimate, 0.3) == pytest.approx(estimate.precision(0.3))
    assert group_precision(three, estimate, 0.3) == pytest.approx(estimate.precision(0.3) ** 2)
    assert 0.0 < group_precision(three, estimate, 0.3) < group_precision(pair, estimate, 0.3) < 1.0


# --- planting
def test_the_copies_are_planted_as_people_make_them():
    image = fashion_item(1, 120, hue=0.6)
    copies = plant_copies(image, COPY_KINDS, seed=3)
    assert list(copies) == list(COPY_KINDS)
    assert copies["resized"].size == (60, 60) and copies["cropped"].size == (96, 96)
    assert copies["shrunk"].size == (40, 40)  # the harsh downscale: a third of each side
    assert copies["rotated"].size[0] > 120 and copies["jpeg"].size == copies["brightness"].size == (120, 120)
    corner = np.asarray(copies["rotated"])[0, 0]
    assert (corner > 240).all()  # the corners filled with the background
    again = plant_copies(image, COPY_KINDS, seed=3)
    assert all(np.array_equal(np.asarray(copies[k]), np.asarray(again[k])) for k in COPY_KINDS)


def test_a_kind_of_copy_not_planted_is_refused_naming_the_kinds():
    with pytest.raises(ParameterError, match=r"'blurred'.*the kinds of copy planted are \['brightness'"):
        plant_copies(fashion_item(1, 32), ["resized", "blurred"])


def test_a_colour_variant_turns_the_hues_and_keeps_the_white():
    image = fashion_item(4, 96, hue=0.6)
    for seed in range(4):
        variant = plant_colour_variant(image, seed=seed)
        assert variant.size == image.size and variant.mode == "RGB"
        before, after = np.asarray(image).reshape(-1, 3), np.asarray(variant).reshape(-1, 3)
        difference, coloured = colour_difference(before, after)
        assert difference > 20.0 and coloured > 500
        white = (before >= 250).all(axis=1)
        assert (after[white] >= 245).all()


# --- distinct neighbours
def test_distinct_neighbours_pass_over_an_images_copies():
    graph = graph_of({
        0: [(1, 0.99), (2, 0.98), (5, 0.80), (6, 0.79), (7, 0.7)],  # two copies, then a gap: the next two
        3: [(8, 0.97), (9, 0.965), (10, 0.96)],  # no gap: its nearest are lookalikes
        4: [(11, 0.7)],
    })
    assert distinct_neighbours(graph, 0) == [5, 6]
    assert distinct_neighbours(graph, 1) == [8, 9]
    assert distinct_neighbours(graph, 2, count=3) == [11]
    labels = {0: "shirt", 1: "shirt", 2: "shirt", 5: "coat", 6: "shirt", 7: "bag", 8: "x", 9: "x", 3: "x", 10: "y"}
    assert distinct_neighbours(graph, 0, labels) == [5, 7]  # another label, whatever the gap
    assert distinct_neighbours(graph, 1, labels) == [10]


def test_check_workers_accepts_whole_numbers_of_threads_only():
    assert check_workers(3) == 3 and check_workers(np.int64(1)) == 1
    for bad in (0, 65, True, 2.5, "2"):
        with pytest.raises(ParameterError, match="workers"):
            check_workers(bad)


# --- verifying candidate pairs
@pytest.fixture(scope="module")
def pictures() -> dict[int, Image.Image]:
    """Two products with copies (0: a pullover, 1 and 2 its JPEG and crop; 3: a coat, 4 its half-size copy) and a
    third product (5)."""
    pullover, coat = fashion_item(1, 128, hue=0.6), fashion_item(4, 128, hue=0.6)
    copies = plant_copies(pullover, COPY_KINDS, seed=0)
    return {0: pullover, 1: copies["jpeg"], 2: copies["cropped"], 3: coat,
            4: plant_copies(coat, ["resized"], seed=1)["resized"], 5: fashion_item(7, 128, hue=0.6)}


COPIES = {(0, 1), (0, 2), (1, 2), (3, 4)}


def all_pairs(ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    pairs = [(a, b) for a in sorted(ids) for b in sorted(ids) if a < b]
    first, second = (np.asarray(column, np.int64) for column in zip(*pairs, strict=True))
    return first, second, np.linspace(0.9, 0.99, len(pairs)).astype(np.float32)


def outcome(verification) -> dict[tuple[int, int], tuple]:
    return {(p.first, p.second): (p.reason, p.cosine, p.comparison.inliers, round(p.comparison.correlation, 6))
            for p in verification.pairs}


def test_every_candidate_pair_is_checked_whatever_their_order(pictures):
    first, second, cosines = all_pairs(pictures)
    cache = FeatureCache(pictures.get, WHITE)
    ordered = verify_pairs(first, second, cosines, cache, CopyRules(), workers=1, progress=False)
    assert cache.computed == len(pictures)  # each image's features computed once
    assert ordered.complete and ordered.stopped_because is None
    assert ordered.candidates == len(ordered.pairs) == 15 and ordered.pairs_per_second > 0
    assert {(p.first, p.second) for p in ordered.pairs if p.verified} == COPIES
    shuffle = np.random.default_rng(0).permutation(len(first))
    shuffled = verify_pairs(first[shuffle], second[shuffle], cosines[shuffle], FeatureCache(pictures.get, WHITE),
                            CopyRules(), workers=3, progress=False)
    assert outcome(shuffled) == outcome(ordered)
    cosine_of = dict(zip(zip(first.tolist(), second.tolist(), strict=True), cosines.tolist(), strict=True))
    assert all(p.cosine == pytest.approx(cosine_of[(p.first, p.second)]) for p in shuffled.pairs)


def test_an_unreadable_image_fails_its_pairs_without_stopping_the_rest(pictures):
    first, second, cosines = all_pairs(pictures)
    readable = {k: v for k, v in pictures.items() if k != 5}
    result = verify_pairs(first, second, cosines, FeatureCache(readable.get, WHITE), CopyRules(), progress=False)
    unreadable = [p for p in result.pairs if p.reason == "unreadable image"]
    assert result.complete and len(result.pairs) == 15
    assert {(p.first, p.second) for p in unreadable} == {(a, 5) for a in range(5)}
    assert all(p.comparison is None for p in unreadable)
    assert {(p.first, p.second) for p in result.pairs if p.verified} == COPIES


def test_an_image_the_comparison_fails_on_fails_its_pairs_without_stopping_the_rest(pictures, monkeypatch):
    """OpenCV raising on one image (a decoder's odd output, say) is that pair's reason, not the job's end."""
    import cv2

    from retrieval.index.curation import copy_verification

    real = copy_verification.compare_pair
    odd = id(pictures[5])

    def compare(a, b):
        if odd in (id(a.source_image), id(b.source_image)):
            raise cv2.error("odd image")
        return real(a, b)

    class Tagged(FeatureCache):
        def get(self, image_id):
            features = super().get(image_id)
            if features is not None:
                features.source_image = pictures[image_id]
            return features

    monkeypatch.setattr(copy_verification, "compare_pair", compare)
    result = verify_pairs(*all_pairs(pictures), Tagged(pictures.get, WHITE), CopyRules(), progress=False)
    failed = [p for p in result.pairs if p.reason and p.reason.startswith("could not be compared")]
    assert result.complete and len(result.pairs) == 15
    assert {(p.first, p.second) for p in failed} == {(a, 5) for a in range(5)}
    assert {(p.first, p.second) for p in result.pairs if p.verified} == COPIES


def test_max_pairs_stops_after_the_first_pairs_in_order(pictures):
    first, second, cosines = all_pairs(pictures)
    shuffle = np.random.default_rng(1).permutation(len(first))
    result = verify_pairs(first[shuffle], second[shuffle], cosines[shuffle], FeatureCache(pictures.get, WHITE),
                          CopyRules(), progress=False, max_pairs=3)
    assert not result.complete and result.candidates == 15
    assert sorted((p.first, p.second) for p in result.pairs) == [(0, 1), (0, 2), (0, 3)]
    assert "3" in result.stopped_because and "15" in result.stopped_because


def test_a_keyboard_interrupt_while_loading_keeps_the_pairs_checked_so_far(pictures):
    """The loader raises KeyboardInterrupt on its 5th image (image 4, the 4th pair's): no exception escapes, the pairs
    checked before are returned, and the verification says it was stopped by Ctrl-C and after how many."""
    first, second, cosines = all_pairs(pictures)
    calls = []

    def load(image_id: int) -> Image.Image:
        calls.append(image_id)
        if len(calls) >= 5:
            raise KeyboardInterrupt
        return pictures[image_id]

    result = verify_pairs(first, second, cosines, FeatureCache(load, WHITE), CopyRules(), workers=1, progress=False)
    assert not result.complete and result.interrupted and 1 <= len(result.pairs) < 15
    assert "Ctrl-C" in result.stopped_because and f"{len(result.pairs)} of 15" in result.stopped_because
    assert all(p.comparison is not None for p in result.pairs)  # each kept pair fully checked
    assert (0, 1) in {(p.first, p.second) for p in result.pairs}
    assert not {4, 5} & {i for p in result.pairs for i in (p.first, p.second)}  # never loaded: never checked


class Counting(CopyRules):
    """The default rules, counting the pairs whose comparison finished (in order)."""

    def __init__(self, finished: list[int]) -> None:
        super().__init__()
        object.__setattr__(self, "finished", finished)

    def reason(self, comparison):
        self.finished.append(len(self.finished))
        return super().reason(comparison)


@pytest.fixture
def python_handles_ctrl_c():
    """Python's own SIGINT handler, as a terminal's process has it: `_thread.interrupt_main` does nothing where an
    earlier test in this worker process left SIGINT to the default or ignored (some libraries' start-up does)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def interrupt_after(pictures, images: int, finished: list[int], at: list[int]):
    """A loader that presses Ctrl-C (as the terminal does, in the main thread) when asked for its ``images``-th
    image, noting how many comparisons had finished then."""
    calls = []

    def load(image_id: int) -> Image.Image:
        calls.append(image_id)
        if len(calls) == images:
            at.append(len(finished))
            _thread.interrupt_main()
        return pictures[image_id]

    return load


def test_ctrl_c_in_the_terminal_stops_the_verification_without_an_exception(pictures, python_handles_ctrl_c):
    first, second, cosines = all_pairs(pictures)
    finished, at = [], []
    result = verify_pairs(first, second, cosines, FeatureCache(interrupt_after(pictures, 4, finished, at), WHITE),
                          Counting(finished), workers=1, progress=False)
    assert at and not result.complete and "Ctrl-C" in result.stopped_because
    assert len(result.pairs) < 15 and all(p.comparison is not None for p in result.pairs)


def test_ctrl_c_keeps_every_pair_whose_check_finished_before_it(pictures, python_handles_ctrl_c):
    """One worker: pairs finish in order; Ctrl-C is pressed while the 3rd pair loads its image (two finished)."""
    first, second, cosines = all_pairs(pictures)
    finished, at = [], []
    result = verify_pairs(first, second, cosines, FeatureCache(interrupt_after(pictures, 4, finished, at), WHITE),
                          Counting(finished), workers=1, progress=False)
    assert at == [2] and not result.complete
    assert [(p.first, p.second) for p in result.pairs][:2] == [(0, 1), (0, 2)]


# --- the feature cache
def test_the_feature_cache_computes_each_image_once_while_it_is_kept(pictures):
    loads = []
    cache = FeatureCache(lambda i: loads.append(i) or pictures.get(i), WHITE, size=2)
    first = cache.get(0)
    assert cache.get(0) is first and loads == [0] and cache.computed == 1
    cache.get(1)
    assert cache.get(0) is first and loads == [0, 1]  # used again: kept
    cache.get(2)  # 1 is the least recently used: it goes
    assert cache.get(0) is first and loads == [0, 1, 2]
    cache.get(1)
    assert loads == [0, 1, 2, 1] and cache.computed == 4
    assert cache.get(99) is None and cache.get(99) is None and loads.count(99) == 1  # unreadable: known as such


def test_two_threads_asking_for_one_image_at_once_compute_it_once(pictures):
    start = threading.Barrier(2)
    loads = []

    def slow(image_id: int) -> Image.Image:
        loads.append(image_id)
        time.sleep(0.2)
        return pictures[image_id]

    cache = FeatureCache(slow, WHITE)
    got = []

    def ask() -> None:
        start.wait()
        got.append(cache.get(0))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert loads == [0] and cache.computed == 1 and got[0] is got[1]


# --- end to end on a real index
ORIGINALS = (10, 21)  # a coat and a sandal whose planted copies all keep their grey levels (correlation >= 0.98)
VARIANT_OF = 14  # a coat whose colour variant keeps its grey levels too (0.98): only its colours differ
K = 3  # neighbours per image: the copies are linked to their original, or through each other (then checked)


@pytest.fixture(scope="module")
def verified_index(tmp_path_factory):
    """10 Fashion-MNIST product shots in class folders, the copies (``COPY_KINDS``) of two of them planted beside
    them, and a colour variant of another, indexed by the projection model: (index folder, {original: its copies},
    {original: its variant}), as catalogue paths."""
    root = tmp_path_factory.mktemp("verified")
    numbers = [*range(6), *ORIGINALS, VARIANT_OF, 11]
    paths = dict(zip(numbers, write_items(root / "gallery", numbers), strict=True))
    copies = {}
    for seed, number in enumerate(ORIGINALS):
        source = paths[number]
        copies[source] = []
        for kind, image in plant_copies(Image.open(source), COPY_KINDS, seed=seed).items():
            path = source.parent / f"{source.stem}_{kind}.{'jpg' if kind == 'jpeg' else 'png'}"
            image.save(path, **({"quality": 95} if kind == "jpeg" else {}))
            copies[source].append(path)
    source = paths[VARIANT_OF]
    variant = source.parent / f"{source.stem}_variant.png"
    plant_colour_variant(Image.open(source), seed=0).save(variant)
    build_index(root / "gallery", root / "index", model=projection_model(root), options=QUICK)
    resolved = {str(k.resolve()): {str(p.resolve()) for p in v} for k, v in copies.items()}
    return root / "index", resolved, {str(source.resolve()): str(variant.resolve())}


def id_of_path(index: Index) -> dict[str, int]:
    return {row["path"]: int(i) for i, row in index.indexed_rows(index.ids.tolist()).items()}


@pytest.fixture(scope="module")
def verified_summary(verified_index):
    index_dir, _, _ = verified_index
    with Index.open(index_dir) as index:
        return find_duplicates(index, DuplicateOptions(k=K, calibration_sample=4)), id_of_path(index)


def test_planted_copies_are_grouped_with_their_original_and_verified(verified_index, verified_summary):
    _, planted, _ = verified_index
    summary, ids = verified_summary
    assert summary["mode"] == "verified" and summary["verification"]["complete"]
    assert summary["verification"]["checked"] == summary["verification"]["candidates"] > 0
    expected = {ids[original]: {ids[c] for c in copies} for original, copies in planted.items()}
    found = {group["ids"][0]: set(group["ids"][1:]) for group in summary["groups"]}
    assert found == expected  # every planted copy with its original, kept first; nothing else grouped
    for group in summary["groups"]:
        assert group["verified"] is True and 0.0 < group["estimated_precision"] <= 1.0
        assert len(group["checks"]) == group["size"] - 1 and all(c["inliers"] >= 4 for c in group["checks"])
    calibration = summary["calibration"]
    assert calibration["images"] == 4 and calibration["copies"] == 4 * len(COPY_KINDS)
    assert calibration["labels_used"] is True
    assert MIN_CANDIDATE_COSINE <= summary["threshold"] == calibration["candidate_cosine"] <= 1.0


def test_the_removal_proposed_is_the_verified_groups_copies_only(verified_index, verified_summary):
    _, planted, variants = verified_index
    summary, ids = verified_summary
    removal = summary["removal"]["ids"]
    assert removal == [i for group in summary["groups"] for i in group["ids"][1:]]
    assert set(removal) == {ids[c] for copies in planted.values() for c in copies}
    assert not set(removal) & {ids[p] for p in (*planted, *variants, *variants.values())}
    assert not summary["removal"]["left_out"]


def test_a_colour_variant_is_similar_not_a_copy(verified_index, verified_summary):
    """Under this raw-pixel model the variant (every pixel changed) is below the auto calibration's candidate
    cosine; with the candidates' cosine at its loosest and the rules auto calibrated it is a candidate, checked,
    and fails on its colours alone: listed as similar, never grouped."""
    index_dir, _, variants = verified_index
    summary, ids = verified_summary
    (original, variant), = ((ids[a], ids[b]) for a, b in variants.items())
    assert not any({original, variant} <= set(group["ids"]) for group in summary["groups"])
    for pair in summary["similar"]:
        if set(pair["ids"]) == {original, variant}:
            assert pair["reason"] == "colours differ"
    calibrated = summary["calibration"]["rules"]
    rules = CopyRules(calibrated["correlation"], calibrated["colour_mismatch"])
    loose = VerificationCalibration(MIN_CANDIDATE_COSINE, rules, 0, {k: [] for k in COPY_KINDS},
                                    {k: [] for k in COPY_KINDS}, [], [])
    with Index.open(index_dir) as index:
        wide = find_duplicates(index, graph=index_graph(index, 1), verification=loose)  # each image's nearest
    assert wide["mode"] == "verified" and wide["threshold"] == MIN_CANDIDATE_COSINE
    assert not any({original, variant} <= set(group["ids"]) for group in wide["groups"])
    similar = [pair for pair in wide["similar"] if set(pair["ids"]) == {original, variant}]
    assert len(similar) == 1 and similar[0]["reason"] == "colours differ"
    assert similar[0]["check"]["colour_mismatch"] > rules.colour_mismatch
    assert similar[0]["check"]["correlation"] >= rules.correlation and similar[0]["check"]["inliers"] >= 4
    assert all(pair["reason"] for pair in wide["similar"])
    assert not {original, variant} & set(wide["removal"]["ids"])


def test_a_given_cosine_groups_by_the_cosine_alone(verified_index):
    index_dir, _, _ = verified_index
    with Index.open(index_dir) as index:
        summary = find_duplicates(index, DuplicateOptions(0.9, k=K))
    assert summary["mode"] == "cosine" and summary["threshold"] == 0.9 and summary["calibration"] is None
    assert "similar" not in summary and "verification" not in summary
    assert all("verified" not in group for group in summary["groups"])


def test_an_index_without_a_model_cannot_plant_copies(verified_index):
    index_dir, _, _ = verified_index
    with Index.open(index_dir) as index:
        graph = index_graph(index, K)
        with pytest.raises(ParameterError, match="threshold"):
            calibrate_verification(index, graph, catalogued_image_loader(index),
                                   NoModel(index.embedder.embedding_dim, index_dir), 4)


# --- Ctrl-C on a real index of copies of one picture
VARIANTS = 12
LOOSE = VerificationCalibration(MIN_CANDIDATE_COSINE, CopyRules(), 0, {k: [] for k in COPY_KINDS},
                                {k: [] for k in COPY_KINDS}, [], [])


@pytest.fixture(scope="module")
def variants_index(tmp_path_factory):
    """12 copies of one product shot, the n-th with n pixels changed (those of the (n-1)-th and one more), indexed
    by the projection model: with 2 neighbours each they are linked in a chain, so grouping them needs extra checks
    against a group's first."""
    root = tmp_path_factory.mktemp("variants")
    pixels = np.asarray(fashion_item(3, 128, hue=0.6)).copy()
    folder = root / "gallery" / "copies"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for n in range(VARIANTS):
        pixels[tuple(rng.integers(0, 128, 2))] = rng.integers(0, 256, 3)
        Image.fromarray(pixels).save(folder / f"v{n:02d}.png")
    build_index(root / "gallery", root / "index", model=projection_model(root), options=QUICK)
    return root / "index"


class Comparisons:
    """Each comparison's start time; Ctrl-C pressed (as the terminal does) at comparison number ``interrupt_at``
    (from 1), after which each comparison takes 0.3 s more (what a large image costs), so that work done after
    Ctrl-C shows in the time to stop."""

    def __init__(self) -> None:
        self.started: list[float] = []
        self.interrupt_at: int | None = None
        self.pressed: float | None = None

    def after_ctrl_c(self) -> int:
        """Comparisons started once Ctrl-C was pressed."""
        return sum(t >= self.pressed for t in self.started)


@pytest.fixture
def comparisons(monkeypatch, python_handles_ctrl_c) -> Comparisons:
    from retrieval.index.curation import copy_verification

    real, noted, lock = copy_verification.compare_pair, Comparisons(), threading.Lock()

    def compare(a, b):
        with lock:
            noted.started.append(time.monotonic())
            if len(noted.started) == noted.interrupt_at:
                noted.pressed = time.monotonic()
                _thread.interrupt_main()
        if noted.pressed is not None:
            time.sleep(0.3)
        return real(a, b)

    monkeypatch.setattr(copy_verification, "compare_pair", compare)
    return noted


def test_ctrl_c_during_the_verification_stops_without_checks_for_the_groups(variants_index, comparisons):
    """Ctrl-C while the last candidate pairs are compared (most of the chain verified, its images linked to the
    best linked one mostly through others): no comparison is made to form groups afterwards (each would take 0.3 s),
    and the summary returns within a comparison, interrupted, with what was verified."""
    with Index.open(variants_index) as index:
        graph = index_graph(index, 2)
        candidates = len(duplicate_links(graph, LOOSE.candidate_cosine)[0])
        comparisons.interrupt_at = candidates - 2
        summary = find_duplicates(index, DuplicateOptions(workers=1), graph=graph, verification=LOOSE)
        stopped = time.monotonic() - comparisons.pressed
    assert summary["verification"]["interrupted"] and not summary["verification"]["complete"]
    assert candidates - 3 <= summary["verification"]["checked"] < candidates and summary["groups"]
    assert comparisons.after_ctrl_c() <= 1 and stopped < 3.0  # a comparison or two, on a busy machine


def test_ctrl_c_during_the_checks_for_the_groups_stops_them_within_a_comparison(variants_index, comparisons):
    """Ctrl-C at the first comparison made to form groups (on 2 workers): the pending ones are cancelled, the
    summary returns within a comparison of each worker, says it was interrupted (the command exits 130) and groups
    what was checked, every member verified against its first."""
    with Index.open(variants_index) as index:
        graph = index_graph(index, 2)
        candidates = len(duplicate_links(graph, LOOSE.candidate_cosine)[0])
        comparisons.interrupt_at = candidates + 1
        summary = find_duplicates(index, DuplicateOptions(workers=2), graph=graph, verification=LOOSE)
        stopped = time.monotonic() - comparisons.pressed
    checks = summary["verification"]
    assert checks["complete"] and checks["interrupted"] and checks["checked"] == candidates
    assert any("Ctrl-C" in warning for warning in summary["warnings"])
    assert comparisons.after_ctrl_c() <= 3 and stopped < 3.0
    assert all(len(group["checks"]) == group["size"] - 1 for group in summary["groups"])
