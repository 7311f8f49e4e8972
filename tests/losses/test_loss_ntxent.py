"""NT-Xent (SimCLR eq. 1, ``retrieval/losses/ntxent.py``): against a float64 loop of the paper's formula, exactly
eq. 1 with two views per image, gradcheck, degenerate batches (finite, never NaN) and what it learns.

The registry-wide tests (``test_losses_registry.py``, ``test_rectangular_losses.py``, ``test_losses_memory.py``)
cover it as every registered loss; its rectangular reference is ``loss_references.ref_ntxent``.
"""

from __future__ import annotations

import math

import pytest
import torch

from retrieval.losses import available, available_negatives, build, describe, has_rectangular_form
from retrieval.losses.ntxent import DEFAULT_TEMPERATURE, NTXentLoss
from retrieval.losses.registry import NEGATIVES
from retrieval.utils.reads import deferred_checks, read_checks, read_stats

F64 = torch.float64


# --- the slow reference: the paper's formula, loops, float64 --------------------------------------------------
def sim(x: torch.Tensor, i: int, j: int) -> torch.Tensor:
    """Cosine similarity of rows i and j."""
    return x[i] @ x[j] / (x[i].norm() * x[j].norm())


def term(x: torch.Tensor, i: int, j: int, tau: float) -> torch.Tensor:
    """Eq. 1: l(i, j) = -log( exp(sim(z_i, z_j) / tau) / sum_{k != i} exp(sim(z_i, z_k) / tau) )."""
    denominator = sum(torch.exp(sim(x, i, k) / tau) for k in range(len(x)) if k != i)
    return -torch.log(torch.exp(sim(x, i, j) / tau) / denominator)


def reference(x: torch.Tensor, labels: list[int], tau: float) -> torch.Tensor:
    """The mean of l(i, j) over every anchor i and every other row j with i's label (0 without any)."""
    terms = [term(x, i, j, tau) for i in range(len(labels)) for j in range(len(labels))
             if j != i and labels[j] == labels[i]]
    return sum(terms) / len(terms) if terms else x.new_zeros(())


def simclr_batch(seed: int, images: int = 5, dim: int = 8, noise: float = 0.5) -> torch.Tensor:
    """SimCLR's layout: rows 0..N-1 the first view of each image, rows N..2N-1 the second."""
    g = torch.Generator().manual_seed(seed)
    images_ = torch.randn(images, dim, generator=g, dtype=F64)
    views = [images_ + noise * torch.randn(images, dim, generator=g, dtype=F64) for _ in range(2)]
    return torch.cat(views).requires_grad_(True)


def grouped_batch(seed: int, sizes: list[int], dim: int = 8, noise: float = 0.8):
    """Views of len(sizes) images, sizes[c] of image c, rows shuffled (labels are not positions)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes))
    labels = labels[torch.randperm(len(labels), generator=g)]
    centres = torch.randn(len(sizes), dim, generator=g, dtype=F64)
    x = centres[labels] + noise * torch.randn(len(labels), dim, generator=g, dtype=F64)
    return x.requires_grad_(True), labels


def value_and_grad(loss: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor):
    value = loss(x, labels)
    (grad,) = torch.autograd.grad(value, x)
    return value, grad


# --- (1) the reference ---------------------------------------------------------------------------------------
BATCHES = {
    "two views": [2, 2, 2, 2, 2, 2],
    "three views": [3, 3, 3, 3],
    "uneven groups": [4, 2, 3, 1, 2],  # an image with one view: a negative, no anchor term
    "one large group": [6, 1, 1, 2],
}


@pytest.mark.parametrize("tau", [DEFAULT_TEMPERATURE, 0.5, 1.0])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("sizes", BATCHES.values(), ids=BATCHES.keys())
def test_matches_the_formula_loop(sizes, seed, tau):
    x, labels = grouped_batch(seed, sizes)
    value, grad = value_and_grad(build("ntxent", temperature=tau), x, labels)
    expected, expected_grad = value_and_grad(lambda x, y: reference(x, y.tolist(), tau), x, labels)
    assert value.dtype == F64
    assert torch.allclose(value, expected, rtol=0, atol=1e-10), (float(value), float(expected))
    assert torch.allclose(grad, expected_grad, rtol=0, atol=1e-10)
    assert grad.abs().max() > 1e-6


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_views_per_image_is_exactly_eq_1(seed):
    # SimCLR: L = 1/(2N) sum_k [l(2k-1, 2k) + l(2k, 2k-1)], both orders of each positive pair; here views k and
    # k + N of image k
    x = simclr_batch(seed)
    n = len(x) // 2
    paper = sum(term(x, k, k + n, 0.5) + term(x, k + n, k, 0.5) for k in range(n)) / (2 * n)
    labels = torch.arange(n).repeat(2)  # the image's id
    value = build("ntxent", temperature=0.5)(x, labels)
    assert value.item() == pytest.approx(paper.item(), rel=1e-12)
    # positions say nothing: any order of the rows, any label values
    perm = torch.randperm(2 * n, generator=torch.Generator().manual_seed(seed))
    assert build("ntxent", temperature=0.5)(x[perm], 7 * labels[perm] + 3).item() == pytest.approx(paper.item(),
                                                                                                    rel=1e-12)


def test_it_is_cross_entropy_over_the_other_rows():
    # with one positive per anchor, eq. 1 is the cross-entropy of logits s_ik / tau, k != i, at the positive
    x = simclr_batch(3).detach()
    n, tau = len(x) // 2, 0.2
    unit = torch.nn.functional.normalize(x, dim=1)
    logits = (unit @ unit.T / tau).fill_diagonal_(-math.inf)
    targets = torch.arange(2 * n).add(n).remainder(2 * n)
    expected = torch.nn.functional.cross_entropy(logits, targets)
    assert build("ntxent", temperature=tau)(x, torch.arange(n).repeat(2)).item() == pytest.approx(expected.item(),
                                                                                                  rel=1e-12)


def test_equal_groups_give_supcon_l_out_and_uneven_groups_weigh_each_term_alike():
    # SupCon L_out (eq. 2) averages anchor i's terms with 1/|P(i)|; ours averages all terms alike: the same when
    # every image has the same number of views
    def supcon_l_out(x, labels, tau):
        per_anchor = []
        for i in range(len(labels)):
            positives = [j for j in range(len(labels)) if j != i and labels[j] == labels[i]]
            if positives:
                per_anchor.append(sum(term(x, i, j, tau) for j in positives) / len(positives))
        return sum(per_anchor) / len(per_anchor)

    x, labels = grouped_batch(4, [3, 3, 3])
    assert build("ntxent")(x, labels).item() == pytest.approx(supcon_l_out(x, labels.tolist(), 0.1).item(), rel=1e-12)
    x, labels = grouped_batch(4, [5, 2, 2])
    ours, theirs = build("ntxent")(x, labels).item(), supcon_l_out(x, labels.tolist(), 0.1).item()
    assert ours == pytest.approx(reference(x, labels.tolist(), 0.1).item(), rel=1e-12)
    assert abs(ours - theirs) > 1e-3


def test_float32_matches_float64():
    x, labels = grouped_batch(5, [2, 3, 2, 4])
    value64 = build("ntxent")(x, labels)
    value32 = build("ntxent")(x.detach().float(), labels)
    assert value32.dtype == torch.float32
    assert value32.item() == pytest.approx(value64.item(), rel=1e-5)


# --- (2) gradients -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sizes", [[2, 2, 2], [3, 1, 2]], ids=["two views", "uneven"])
def test_gradcheck(sizes):
    x, labels = grouped_batch(6, sizes, dim=4)
    loss = build("ntxent", temperature=0.5)
    assert torch.autograd.gradcheck(lambda e: loss(e, labels), (x.detach().requires_grad_(True),), eps=1e-6,
                                    atol=1e-6)


def test_gradcheck_of_the_query_gallery_form():
    x, labels = grouped_batch(7, [2, 2, 3], dim=4)
    queries, memory = x[:3].detach().requires_grad_(True), x[3:].detach().requires_grad_(True)
    loss = build("ntxent", temperature=0.5)

    def against_memory(q: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return loss.query_gallery(q, labels[:3], torch.cat([q, m]), labels, torch.arange(3))

    assert torch.autograd.gradcheck(against_memory, (queries, memory), eps=1e-6, atol=1e-6)


# --- (3) degenerate batches ----------------------------------------------------------------------------------
def finite_and_connected(value: torch.Tensor, *leaves: torch.Tensor) -> None:
    assert torch.isfinite(value), float(value)
    assert value.requires_grad
    for grad in torch.autograd.grad(value, leaves):
        assert torch.isfinite(grad).all()


def test_no_positive_pair_is_the_project_wide_batch_error_and_its_value_is_zero():
    # as every pair loss, the square call refuses a batch with nothing to learn, naming the sampler setting
    # (test_losses_registry.py); the equation itself is 0, connected, which the deferred check lets through
    x = torch.randn(6, 8, dtype=F64, requires_grad=True)
    labels = torch.arange(6)
    loss = build("ntxent")
    with pytest.raises(ValueError, match="no positive pair.*2 or more images per class"):
        loss(x, labels)
    with deferred_checks() as checks:
        value = loss(x, labels)
    assert isinstance(read_checks(checks)[1], ValueError)
    finite_and_connected(value, x)
    assert value.item() == 0.0
    assert loss.from_similarity(loss.similarity(x), labels).item() == 0.0
    assert read_stats(loss.last_stats) == {"positive_pairs": 0.0, "positive_top1": 0.0}


def test_a_single_sample():
    # the square call needs 2 rows (the project's check); against a gallery one query is well defined
    x = torch.randn(1, 8, dtype=F64, requires_grad=True)
    loss = build("ntxent")
    with pytest.raises(ValueError, match="at least 2 samples"):
        loss(x, torch.tensor([0]))
    alone = loss.query_gallery(x, torch.tensor([0]), x, torch.tensor([0]), torch.tensor([0]))  # nothing but itself
    finite_and_connected(alone, x)
    assert alone.item() == 0.0
    other = torch.randn(1, 8, dtype=F64, requires_grad=True)
    one_positive = loss.query_gallery(x, torch.tensor([0]), other, torch.tensor([0]))  # k runs over j alone
    finite_and_connected(one_positive, x, other)
    assert one_positive.item() == pytest.approx(0.0, abs=1e-15)  # -log(1)


@pytest.mark.parametrize("fill", [0.0, 0.3], ids=["zero vectors", "identical embeddings"])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_identical_or_zero_embeddings(fill, dtype):
    # every s_ik equal (1, or 0 for zero vectors, which normalise to 0): each term is log(B - 1)
    x = torch.full((8, 4), fill, dtype=dtype, requires_grad=True)
    value = build("ntxent")(x, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
    finite_and_connected(value, x)
    assert value.item() == pytest.approx(math.log(7), rel=1e-6)


def test_some_zero_rows_and_a_single_image():
    x = torch.randn(6, 4, dtype=F64)
    x[1] = 0.0
    x = x.requires_grad_(True)
    finite_and_connected(build("ntxent")(x, torch.tensor([0, 0, 1, 1, 2, 2])), x)
    one_image = torch.randn(4, 4, dtype=F64, requires_grad=True)  # no negative: the positives fill the denominator
    value = build("ntxent")(one_image, torch.zeros(4, dtype=torch.long))
    finite_and_connected(value, one_image)
    assert value.item() == pytest.approx(reference(one_image, [0] * 4, 0.1).item(), rel=1e-12)


def test_large_logits_stay_finite_in_float32():
    # tau = 0.01 puts logits at +-100: exp overflows float32 without the log-sum-exp
    x, labels = grouped_batch(8, [2, 2, 2, 2], noise=0.05)
    loss = build("ntxent", temperature=0.01)
    x32 = x.detach().float().requires_grad_(True)
    value = loss(x32, labels)
    finite_and_connected(value, x32)
    assert value.item() == pytest.approx(loss(x, labels).item(), rel=1e-4, abs=1e-4)


# --- (4) behaviour and options -------------------------------------------------------------------------------
def test_the_loss_decreases_as_the_views_of_an_image_move_together():
    g = torch.Generator().manual_seed(9)
    first, other = torch.randn(6, 16, generator=g, dtype=F64), torch.randn(6, 16, generator=g, dtype=F64)
    labels = torch.arange(6).repeat(2)
    loss = build("ntxent")
    values = [loss(torch.cat([first, (1 - t) * other + t * first]), labels).item() for t in torch.linspace(0, 1, 6)]
    assert all(a > b for a, b in zip(values, values[1:], strict=False)), values


def test_gradient_steps_pull_the_views_together_and_lower_the_loss():
    x, labels = grouped_batch(10, [2] * 6, noise=1.5)
    x = x.detach().requires_grad_(True)
    loss = build("ntxent")
    optimizer = torch.optim.SGD([x], lr=0.5)
    first = None
    for _ in range(30):
        optimizer.zero_grad()
        value = loss(x, labels)
        first = value.item() if first is None else first
        value.backward()
        optimizer.step()
    assert loss(x, labels).item() < 0.5 * first
    assert read_stats(loss.last_stats) == {"positive_pairs": 12.0, "positive_top1": 1.0}


@pytest.mark.parametrize("tau", [0, 0.0, -0.1, math.nan, math.inf, "0.1", True, None])
def test_the_temperature_must_be_a_positive_number(tau):
    with pytest.raises(ValueError, match="ntxent temperature must be a finite number > 0"):
        build("ntxent", temperature=tau)


def test_registered_with_its_equation_and_default_and_no_hard_negative_form():
    assert "ntxent" in available()
    loss = build("ntxent")
    assert isinstance(loss, NTXentLoss) and loss.temperature == DEFAULT_TEMPERATURE == 0.1
    assert build("ntxent", temperature=1).temperature == 1.0
    described = describe("ntxent")
    assert "SimCLR eq. 1" in described["equation"] and "SupCon" in described["equation"]
    assert described["defaults"] == {"temperature": 0.1}
    assert set(described["readings"]) == {"temperature", "labels"}
    assert has_rectangular_form("ntxent")
    # no pair-level form (from_pair_terms): no hard-negative method composes with it, and asking says so
    assert not [m for n, m in available_negatives() if n == "ntxent"]
    for method in NEGATIVES.names():
        with pytest.raises(ValueError, match="define no loss 'ntxent'"):
            build("ntxent", negatives=method)


def test_the_cli_lists_it():
    from click.testing import CliRunner

    from retrieval.cli.main import main

    out = CliRunner().invoke(main, ["losses"]).output
    assert "ntxent: SimCLR eq. 1" in out and "temperature=0.1" in out
