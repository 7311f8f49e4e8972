"""The query x gallery (rectangular) form of the pair losses: query rows are the anchors, gallery rows the pairs'
other ends, S = Q G^T [B, M], and a query found in the gallery (``self_index``) is never its own positive.

Every loss that has the form matches a float64 loop of its paper's formula over the query anchors (values and
gradients), its square call is the rectangular call with the batch as gallery, gradcheck passes, and degenerate
galleries give a finite loss; the losses without the form refuse it with their reason.
"""

from __future__ import annotations

import pytest
import torch
from loss_references import ANCHOR_REFERENCES, QueryGallery, make_batch
from reads_back import ReadsBack

from retrieval.errors import ParameterError
from retrieval.losses import available, build, has_rectangular_form
from retrieval.losses.registry import LOSSES
from retrieval.utils.reads import deferred_checks, read_checks, read_stats

ATOL = 1e-8
QUERIES = 6  # the first rows of a pool are the queries, the rest a memory
RAW_FEATURE_LOSSES = {"npair"}

CASES = [
    ("contrastive", {}),
    ("contrastive", {"form": "distance", "pos_margin": 0.3, "neg_margin": 1.2}),
    ("triplet", {}),
    ("triplet", {"margin": 0.3, "squared": True}),
    ("triplet", {"mining": "semihard"}),
    ("triplet", {"mining": "semihard", "squared": True, "margin": 0.5, "reduction": "triplets"}),
    ("triplet", {"mining": "hard"}),
    ("nca_triplet", {}),
    ("nca_triplet", {"mining": "semihard", "temperature": 0.5}),
    ("sct", {}),
    ("sct", {"hard_rule": "paper_or_threshold", "threshold": 0.3}),
    ("generalized_lifted", {}),
    ("npair", {}),
    ("npair", {"l2_reg": 0.01}),
    ("binomial", {}),
    ("binomial", {"miner": "vthm"}),
    ("vthm", {}),
    ("raw", {}),
    ("raw", {"miner": "vthm"}),
    ("ms", {}),
    ("ms", {"margin": 0.3}),
    ("ntxent", {}),
    ("ntxent", {"temperature": 0.5}),
]
LAYOUTS = ["batch+memory", "memory", "shuffled"]
RECTANGULAR = [name for name in available() if has_rectangular_form(name)]
SQUARE_ONLY = [name for name in available() if not has_rectangular_form(name)]


def _id(case) -> str:
    name, kwargs = case
    return name + "".join(f"-{k}={v}" for k, v in kwargs.items())


def pool(seed: int, name: str, classes: int = 4, per_class: int = 5):
    """Clustered rows with shuffled labels: the first QUERIES are the queries, the rest a memory."""
    return make_batch(seed, classes=classes, per_class=per_class, scale=0.5 if name in RAW_FEATURE_LOSSES else 1.0)


def layout(x: torch.Tensor, labels: torch.Tensor, kind: str):
    """(queries, labels, gallery, gallery labels, self_index) of a pool: the queries and the memory as gallery
    (XBM's), the memory alone (no query in it), or both in a shuffled order."""
    queries, query_labels = x[:QUERIES], labels[:QUERIES]
    if kind == "batch+memory":
        return queries, query_labels, x, labels, torch.arange(QUERIES)
    if kind == "memory":
        return queries, query_labels, x[QUERIES:], labels[QUERIES:], None
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(7))
    return queries, query_labels, x[order], labels[order], torch.argsort(order)[:QUERIES]


def test_every_loss_with_the_rectangular_form_has_a_reference_and_a_case():
    assert set(RECTANGULAR) == set(ANCHOR_REFERENCES) == {name for name, _ in CASES}


def test_the_losses_without_the_form_say_why():
    assert {"lifted", "lifted_min", "hphn_triplet", "angular", "angular_npair", "dcdl"} <= set(SQUARE_ONLY)
    for name in SQUARE_ONLY:
        assert not getattr(LOSSES.get(name), "rectangular", False)
        if hasattr(LOSSES.get(name), "square_only"):
            assert LOSSES.get(name).square_only  # a pair loss without the form names the term that needs more


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_the_rectangular_loss_matches_the_paper_formula_over_query_anchors(case, kind, seed):
    name, kwargs = case
    x, labels = pool(seed, name)
    value = build(name, **kwargs).query_gallery(*layout(x, labels, kind))
    (grad,) = torch.autograd.grad(value, x)
    expected = ANCHOR_REFERENCES[name](QueryGallery(*layout(x, labels, kind)), **kwargs)
    (expected_grad,) = torch.autograd.grad(expected, x)
    assert torch.allclose(value, expected, atol=ATOL, rtol=0), (float(value), float(expected))
    assert torch.allclose(grad, expected_grad, atol=ATOL, rtol=0)
    assert grad.abs().max() > 1e-6  # something is learnt


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_the_square_call_is_the_rectangular_call_with_the_batch_as_gallery(case):
    name, kwargs = case
    x, labels = pool(3, name)
    square_loss, rectangular_loss = build(name, **kwargs), build(name, **kwargs)
    square = square_loss(x, labels)
    (square_grad,) = torch.autograd.grad(square, x)
    rectangular = rectangular_loss.query_gallery(x, labels, x, labels, torch.arange(len(labels)))
    (rectangular_grad,) = torch.autograd.grad(rectangular, x)
    assert torch.allclose(square, rectangular, rtol=1e-12, atol=1e-14)
    assert torch.allclose(square_grad, rectangular_grad, rtol=1e-12, atol=1e-14)
    assert read_stats(square_loss.last_stats) == pytest.approx(read_stats(rectangular_loss.last_stats), rel=1e-12)


@pytest.mark.parametrize("name", RECTANGULAR)
def test_rectangular_gradients_pass_gradcheck(name):
    x, labels = make_batch(5, classes=3, per_class=3, dim=4, scale=0.5)
    queries, memory = x[:3].detach().requires_grad_(True), x[3:].detach().requires_grad_(True)
    query_labels, memory_labels = labels[:3], labels[3:]
    loss = build(name)

    def against_memory(q: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        gallery, gallery_labels = torch.cat([q, m]), torch.cat([query_labels, memory_labels])
        return loss.query_gallery(q, query_labels, gallery, gallery_labels, torch.arange(3))

    assert torch.autograd.gradcheck(against_memory, (queries, memory), eps=1e-6, atol=1e-6)


def degenerate(kind: str):
    """(queries, labels, gallery, gallery labels, self_index) where some anchor has no positive or no negative."""
    g = torch.Generator().manual_seed(11)
    queries, gallery = torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randn(6, 5, generator=g,
                                                                                         dtype=torch.float64)
    if kind == "a query class absent from the gallery":
        return queries, torch.tensor([0, 0, 1, 2]), gallery, torch.tensor([0, 1, 1, 0, 1, 3]), None
    if kind == "one class":
        return queries, torch.zeros(4, dtype=torch.long), gallery, torch.zeros(6, dtype=torch.long), None
    if kind == "no positive at all":
        return queries, torch.tensor([5, 5, 6, 7]), gallery, torch.tensor([0, 1, 1, 0, 1, 3]), None
    if kind == "the queries alone, each of its own class":
        return queries, torch.arange(4), queries, torch.arange(4), torch.arange(4)
    return queries, torch.tensor([0, 1, 1, 2]), gallery[:1], torch.tensor([1]), None  # a one-row gallery


DEGENERATE = ["a query class absent from the gallery", "one class", "no positive at all",
              "the queries alone, each of its own class", "a one-row gallery"]


@pytest.mark.parametrize("kind", DEGENERATE)
@pytest.mark.parametrize("name", RECTANGULAR)
def test_degenerate_galleries_give_a_finite_loss(name, kind):
    queries, labels, gallery, gallery_labels, self_index = degenerate(kind)
    queries, gallery = queries.clone().requires_grad_(True), gallery.clone().requires_grad_(True)
    value = build(name).query_gallery(queries, labels, gallery, gallery_labels, self_index)
    value.backward()
    assert torch.isfinite(value)
    assert torch.isfinite(queries.grad).all() and torch.isfinite(gallery.grad).all()


def test_a_query_missing_from_self_index_is_its_own_positive():
    # contrastive (unified eq. 5) adds -s_ii = -1 for each anchor, averaged over the anchors: exactly -1
    x, labels = pool(0, "contrastive")
    loss = build("contrastive")
    excluded = loss.query_gallery(x, labels, x, labels, torch.arange(len(labels)))
    included = loss.query_gallery(x, labels, x, labels)
    assert float((included - excluded).detach()) == pytest.approx(-1.0, abs=1e-12)


@pytest.mark.parametrize("name", [n for n in SQUARE_ONLY if hasattr(LOSSES.get(n), "query_gallery")])
def test_a_loss_without_the_form_refuses_a_gallery(name):
    x, labels = pool(0, name)
    loss = build(name)
    with pytest.raises(ParameterError, match="gallery has no meaning") as error:
        loss.query_gallery(x[:QUERIES], labels[:QUERIES], x, labels, torch.arange(QUERIES))
    assert type(loss).square_only in str(error.value)


def query_gallery_checked(loss, deferred: bool, *args):
    """``loss.query_gallery(*args)``, its batch checks read at once or, as the trainer does, after it ran."""
    if not deferred:
        return loss.query_gallery(*args)
    with deferred_checks() as checks:
        value = loss.query_gallery(*args)
    failed = read_checks(checks)[1]
    if failed is not None:
        raise failed
    return value


@pytest.mark.parametrize("deferred", [False, True], ids=["at once", "deferred"])
@pytest.mark.parametrize(("self_index", "message"), [
    (torch.tensor([0, 1, 2]), "one gallery row"),
    (torch.tensor([0, 1, 2, 3, 4, 40]), r"-1 or a gallery row in \[0, 20\)"),
    (torch.tensor([0, 1, 2, 3, 4, -2]), r"-1 or a gallery row"),
])
def test_a_bad_self_index_is_refused(self_index, message, deferred):
    x, labels = pool(0, "ms")
    with pytest.raises(ParameterError, match=message):
        query_gallery_checked(build("ms"), deferred, x[:QUERIES], labels[:QUERIES], x, labels, self_index)


@pytest.mark.parametrize("deferred", [False, True], ids=["at once", "deferred"])
def test_a_self_index_naming_a_row_of_another_label_is_refused(deferred):
    x, labels = pool(0, "ms")
    other = int(torch.nonzero(labels != labels[0])[0])
    self_index = torch.arange(QUERIES)
    self_index[0] = other
    with pytest.raises(ParameterError, match="label differs"):
        query_gallery_checked(build("ms"), deferred, x[:QUERIES], labels[:QUERIES], x, labels, self_index)


def test_the_query_gallery_form_reads_its_self_index_check_once_or_defers_it():
    x, labels = pool(0, "ms")
    loss, args = build("ms"), (x[:QUERIES], labels[:QUERIES], x, labels)
    with ReadsBack() as given:
        loss.query_gallery(*args, torch.arange(QUERIES))
    with ReadsBack() as none:  # no query in the gallery: nothing to check
        loss.query_gallery(*args)
    with ReadsBack() as deferred, deferred_checks() as checks:
        loss.query_gallery(*args, torch.arange(QUERIES))
    assert (given.count, none.count, deferred.count, len(checks)) == (1, 0, 0, 1)


@pytest.mark.parametrize("name", ["ms", "npair", "triplet"])
def test_a_gallery_in_blocks_is_the_gallery_they_make(name):
    x, labels = pool(2, name)
    memory = x[QUERIES:].detach()
    queries = x[:QUERIES].detach()
    values, grads = [], []
    for gallery in (lambda q: torch.cat([q, memory]), lambda q: (q, memory)):
        q = queries.clone().requires_grad_(True)
        value = build(name).query_gallery(q, labels[:QUERIES], gallery(q), labels, torch.arange(QUERIES))
        values.append(value)
        grads.append(torch.autograd.grad(value, q)[0])
    assert torch.allclose(values[0], values[1], rtol=1e-12, atol=1e-14)
    assert torch.allclose(grads[0], grads[1], rtol=1e-12, atol=1e-14)
