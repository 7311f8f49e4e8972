"""Copy groups (``copy_groups``) never hold two products: two images whose colours differ (colour variants) never
share a group, even when a third image (a copy of one whose colours drifted) is verified against both; the image
kept is then the variant nearest the third's colours, so neither variant is proposed for removal; and the rule
matches a slow reference on random verdicts. A group keeps its most detailed image (an original rather than its
downscaled copy). Members not compared with each other (no checks left) are never proposed for removal, and a
large group with a small budget compares at most the budget. Also: each image's nearest neighbour is a candidate
pair."""

from __future__ import annotations

from itertools import combinations

import numpy as np
import pytest

from retrieval.errors import ParameterError
from retrieval.index.curation.copy_check import PairComparison
from retrieval.index.curation.copy_verification import (
    COLOURS_DIFFER,
    NOT_CANDIDATES,
    CheckedPair,
    Verification,
    copy_groups,
)
from retrieval.index.curation.duplicates import advice, find_duplicates
from retrieval.index.curation.linked_groups import duplicate_links
from retrieval.index.curation.neighbour_graph import NeighbourGraph


def pair(a: int, b: int, reason: str | None = None, colour: float = 1.0) -> CheckedPair:
    """A compared pair (lower id first) with the colours ``colour`` degrees apart; verified where ``reason`` is
    None."""
    a, b = min(a, b), max(a, b)
    return CheckedPair(a, b, 0.95, PairComparison(40, 20, 1.0, 0.0, 0.9, 0.99, colour, 500), reason)


def answering(truth: dict[tuple[int, int], CheckedPair], asked: list | None = None):
    """``copy_groups``' check answered from ``truth`` (every pair, lower id first)."""
    def check(first: np.ndarray, second: np.ndarray) -> Verification:
        keys = list(zip(first.tolist(), second.tolist(), strict=True))
        if asked is not None:
            asked.extend(keys)
        return Verification([truth[key] for key in keys], len(keys), 0.0)

    return check


def removal(groups) -> set[int]:
    """What the summary proposes: every image of a group but its first."""
    return {int(i) for g in groups for i in g.ids[1:]}


# A (1) red, C (3) orange: distinct products; B (2) a copy of A whose colours drifted towards C, verified against both
CHAIN = [pair(1, 2, colour=4.0), pair(2, 3, colour=7.0)]
VARIANTS = pair(1, 3, COLOURS_DIFFER, colour=11.0)


@pytest.mark.parametrize("cross_check", [False, True])
def test_a_chain_between_two_colour_variants_never_ends_in_one_group(cross_check):
    """A ~ B ~ C verified, A and C compared already and differing in colour: A and C are never in one group, and
    neither is proposed for removal: A (nearest B's colours) is kept with B, C stands alone."""
    groups = copy_groups([*CHAIN, VARIANTS], answering({(1, 3): VARIANTS}), cross_check=cross_check)
    assert not any({1, 3} <= set(g.ids.tolist()) for g in groups)
    assert not {1, 3} & removal(groups)
    assert [g.ids.tolist() for g in groups] == [[1, 2]]


def test_members_are_compared_with_each_other_to_find_colour_variants_not_yet_compared():
    """A and C never compared before: with ``cross_check`` they are, and still never end in one group."""
    asked: list = []
    groups = copy_groups(CHAIN, answering({(1, 3): VARIANTS}, asked), cross_check=True)
    assert asked == [(1, 3)]
    assert [g.ids.tolist() for g in groups] == [[1, 2]] and not {1, 3} & removal(groups)


def test_copies_that_fail_against_each_other_for_content_stay_with_their_original():
    """Copies of one original that do not verify against each other for another reason than colour (a crop and a
    downscale that align badly) all stay in the original's group: only colour tells two products apart."""
    truth = {(a, b): pair(a, b, "content differs") for a, b in combinations(range(2, 6), 2)}
    groups = copy_groups([pair(1, i) for i in range(2, 6)], answering(truth), cross_check=True)
    assert [g.ids.tolist() for g in groups] == [[1, 2, 3, 4, 5]]


def test_a_member_of_another_colour_than_one_nearer_the_first_is_left_for_its_own_group():
    """Around 1: images 2, 3 and 4, and 5 verified against it but differing in colour from 2: 5 (the farther from
    1's colours) is left out and never proposed for removal; 1 lies between two colours, so 2 (nearest its colours,
    verified against 1, 3 and 4) is kept and the others are its copies."""
    candidates = [pair(1, 2, colour=1.0), pair(1, 3, colour=2.0), pair(1, 4, colour=2.5), pair(1, 5, colour=6.0),
                  pair(2, 3), pair(2, 4), pair(3, 4), pair(2, 5, COLOURS_DIFFER, 14.0)]
    truth = {(p.first, p.second): p for p in candidates} | {(3, 5): pair(3, 5, "content differs"),
                                                           (4, 5): pair(4, 5, "no geometric agreement")}
    groups = copy_groups(candidates, answering(truth), cross_check=True)
    assert [g.ids.tolist() for g in groups] == [[2, 1, 3, 4]]
    assert 5 not in removal(groups)


# --- the slow reference: the rule written plainly, every pair looked up in a full table of verdicts
def reference_groups(candidates: list[CheckedPair], truth: dict[tuple[int, int], CheckedPair],
                     rank: dict[int, int] | None = None) -> list[list[int]]:
    """Per connected set of verified candidate pairs: the image with the most verified candidate links to images not
    placed (lowest id among equals) takes every image verified against it; where two of those differ in colour it
    gives way to the one of them nearest its colours; members differing in colour from one nearer the first are
    left out; with ``rank``, the group's member of least rank (lowest id among equals) is then kept instead, with
    the members verified against it; the rest are grouped again, until the best linked image takes none."""
    def verdict(a: int, b: int) -> CheckedPair:
        return truth[(min(a, b), max(a, b))]

    links: dict[int, set[int]] = {}
    for p in candidates:
        if p.verified:
            links.setdefault(p.first, set()).add(p.second)
            links.setdefault(p.second, set()).add(p.first)
    seen: set[int] = set()
    groups = []
    for start in sorted(links):
        if start in seen:
            continue
        component, frontier = {start}, [start]
        while frontier:
            for other in links[frontier.pop()]:
                if other not in component:
                    component.add(other)
                    frontier.append(other)
        seen |= component
        rest = set(component)
        while len(rest) > 1:
            head = min(rest, key=lambda i: (-len(links[i] & rest), i))

            def verified_against(first: int, rest: set[int] = rest) -> list[int]:
                return [o for o in sorted(rest - {first}) if verdict(first, o).verified]

            def clashes(ids: list[int]) -> set[tuple[int, int]]:
                return {(a, b) for a, b in combinations(ids, 2) if verdict(a, b).reason == COLOURS_DIFFER}

            members = verified_against(head)
            if not members:
                break
            if clashes(members):
                old = head
                head = min({i for key in clashes(members) for i in key},
                           key=lambda i: (verdict(old, i).comparison.colour_mismatch, i))
                members = verified_against(head)
            kept: list[int] = []
            for member in sorted(members, key=lambda i: (verdict(head, i).comparison.colour_mismatch, i)):
                if not any((min(member, k), max(member, k)) in clashes(members) for k in kept):
                    kept.append(member)
            group = [head, *sorted(kept)]
            if rank is not None:
                best = min(group, key=lambda i: (rank[i], i))
                group = [best, *(o for o in sorted(group) if o != best and verdict(best, o).verified)]
            groups.append(group)
            rest -= set(group)
    return sorted(groups, key=lambda g: (-len(g), g[0]))


@pytest.mark.parametrize(("seed", "ranked"), [(seed, ranked) for seed in range(8) for ranked in (False, True)])
def test_the_groups_match_the_slow_reference_on_random_verdicts(seed, ranked):
    """Random verdicts among 24 images (copies, colour variants, other failures, each with its own colour distance)
    and random candidate pairs, and (``ranked``) random detail ranks with ties: ``copy_groups`` with every extra
    check answered groups as the reference does; no group holds two images whose colours differ, every member is
    verified against its first, and with ranks the first is its group's member of least rank."""
    rng = np.random.default_rng(seed)
    rank = {i: int(r) for i, r in enumerate(rng.integers(0, 6, 24).tolist())} if ranked else None
    truth = {}
    for a, b in combinations(range(24), 2):
        draw = rng.random()
        reason = None if draw < 0.3 else COLOURS_DIFFER if draw < 0.55 else "content differs"
        truth[(a, b)] = pair(a, b, reason, colour=float(rng.uniform(0, 20)))
    keys = list(truth)
    chosen = rng.choice(len(keys), 70, replace=False)
    candidates = [truth[keys[k]] for k in sorted(chosen.tolist())]
    groups = copy_groups(candidates, answering(truth), cross_check=True, keep=None if rank is None else by_rank(rank))
    assert [g.ids.tolist() for g in groups] == reference_groups(candidates, truth, rank)
    for group in groups:
        ids = group.ids.tolist()
        assert all(truth[(min(ids[0], i), max(ids[0], i))].verified for i in ids[1:])
        assert not any(truth[(a, b)].reason == COLOURS_DIFFER for a, b in combinations(sorted(ids), 2))
        assert rank is None or rank[ids[0]] == min(rank[i] for i in ids)


# --- the image a group keeps: its most detailed (an original, not its downscaled copy)
def by_rank(rank: dict[int, int]):
    """``copy_groups``' keep: the member of least ``rank`` (the lowest id among equals)."""
    return lambda head, joined: min([head, *(i for i, _ in joined)], key=lambda i: (rank[i], i))


@pytest.mark.parametrize("original", [1, 2])
def test_a_group_of_an_original_and_its_downscaled_copy_keeps_the_original_whichever_is_listed_first(original):
    """The original (120 x 120 px) and its copy (60 x 60), ids in either order: the original is kept, the copy
    proposed for removal."""
    copy = 3 - original
    rank = {original: -120 * 120, copy: -60 * 60}  # the most pixels first
    groups = copy_groups([pair(1, 2)], answering({}), cross_check=True, keep=by_rank(rank))
    assert [g.ids.tolist() for g in groups] == [[original, copy]]
    assert removal(groups) == {copy}


def test_the_original_is_kept_though_its_copy_is_verified_against_more_images():
    """Copy 1 (a downscale of 2) is verified against 2 and 3, a crop of it; 2 against 1 only: 1 is the best
    linked, yet 2 (the most detailed) is kept; 3 verified against 2 when compared stays, 4 verified against 1
    alone is left out (not proposed for removal under an image it was never verified against)."""
    candidates = [pair(1, 2), pair(1, 3), pair(1, 4)]
    truth = {(p.first, p.second): p for p in candidates} | {
        (2, 3): pair(2, 3), (2, 4): pair(2, 4, "content differs"), (3, 4): pair(3, 4, "content differs")}
    rank = {1: -60 * 60, 2: -120 * 120, 3: -50 * 50, 4: -60 * 60}
    groups = copy_groups(candidates, answering(truth), cross_check=True, keep=by_rank(rank))
    assert [g.ids.tolist() for g in groups] == [[2, 1, 3]]
    assert 2 not in removal(groups) and 4 not in removal(groups)


def test_each_images_nearest_neighbour_is_a_candidate_whatever_the_cutoff():
    """Image 0's nearest (1, at 0.7) is a candidate below the 0.8 cosine; its second (2, at 0.65) is not; a nearest
    below the floor (3 -> 2 at 0.4) is not either."""
    graph = NeighbourGraph(ids=np.array([0, 1, 2, 3]),
                           scores=np.array([[0.7, 0.65], [0.9, 0.7], [0.9, 0.65], [0.4, 0.3]], np.float32),
                           neighbours=np.array([[1, 2], [2, 0], [1, 0], [2, 0]]))
    first, second, cosines = duplicate_links(graph, 0.8, nearest=1, nearest_floor=0.5)
    assert list(zip(first.tolist(), second.tolist(), strict=True)) == [(0, 1), (1, 2)]
    assert duplicate_links(graph, 0.8)[0].tolist() == [1]


# --- bounded work and safe proposals where members were not all compared with each other
def test_a_large_group_with_a_tiny_budget_compares_at_most_the_budget_and_builds_no_pair_list():
    """3,000 images verified against one, 5 extra checks allowed: at most 5 pairs are asked for, and the members'
    4.5 million pairs are never built (the peak memory stays a few MB; a list of them would take hundreds)."""
    import tracemalloc

    asked: list = []

    def check(first: np.ndarray, second: np.ndarray) -> Verification:
        asked.extend(zip(first.tolist(), second.tolist(), strict=True))
        return Verification([pair(a, b) for a, b in zip(first.tolist(), second.tolist(), strict=True)], len(first), 0)

    candidates = [pair(0, i) for i in range(1, 3001)]
    tracemalloc.start()
    try:
        groups = copy_groups(candidates, check, max_checks=5, cross_check=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(asked) <= 5
    assert peak < 30_000_000
    assert [len(g.ids) for g in groups] == [3001]
    # the members not compared with every other are listed, never proposed for removal
    assert len(groups[0].removable) == 0 and len(groups[0].unconfirmed) == 3000


@pytest.mark.parametrize("budget", ["no check", 0])
def test_two_colour_variants_never_compared_with_each_other_are_listed_but_not_proposed(budget):
    """A ~ B ~ C verified, A and C never compared (no check after Ctrl-C, or no checks left): B is the first, A and C
    are listed with it, and neither is proposed for removal (they may be two products)."""
    check = None if budget == "no check" else answering({(1, 3): VARIANTS})
    groups = copy_groups(CHAIN, check, max_checks=0 if budget == 0 else 100, cross_check=True)
    assert [g.ids.tolist() for g in groups] == [[2, 1, 3]]
    assert not {1, 3} & {i for g in groups for i in g.removable}


def test_members_whose_pair_was_passed_over_as_unlike_are_not_proposed():
    """A and C passed over by the check (less alike than the candidates: not compared): neither is proposed."""
    passed = CheckedPair(1, 3, 0.5, None, NOT_CANDIDATES)
    groups = copy_groups(CHAIN, answering({(1, 3): passed}), cross_check=True)
    assert not {1, 3} & {i for g in groups for i in g.removable}


def test_members_compared_with_each_other_alike_are_proposed():
    """Three copies of one original, compared with each other and alike: all three are proposed for removal."""
    truth = {(a, b): pair(a, b) for a, b in combinations(range(2, 5), 2)}
    groups = copy_groups([pair(1, i) for i in range(2, 5)], answering(truth), cross_check=True)
    assert [g.removable for g in groups] == [[2, 3, 4]]


def test_the_removal_proposed_leaves_out_unconfirmed_members():
    """``advice`` proposes a group's members but the unconfirmed ones."""
    proposal = advice(None, [{"ids": [2, 1, 3, 4], "unconfirmed": [1, 3]}])
    assert proposal["removal"]["ids"] == [4]


def test_find_duplicates_given_other_than_duplicate_options_names_them():
    """The old call ``find_duplicates(index, "auto")`` is refused with an error naming ``DuplicateOptions``."""
    with pytest.raises(ParameterError, match="DuplicateOptions"):
        find_duplicates(None, "auto")  # type: ignore[arg-type]
