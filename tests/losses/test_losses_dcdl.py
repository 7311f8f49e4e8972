"""DCDL (dcdl eq. 1, 2, 5; supplementary eq. 11-16) against slow float64 references and POT."""

from __future__ import annotations

import math

import numpy as np
import ot
import pytest
import torch

from retrieval import losses
from retrieval.losses.discrepancy import (
    DCDLLoss,
    classwise_mmd,
    classwise_sinkhorn,
    mmd,
    sinkhorn_divergence,
    split_classes,
)

torch.set_default_dtype(torch.float32)


def unit_cloud(n: int, dim: int, seed: int, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g, dtype=torch.float64) + shift
    return x / x.norm(dim=1, keepdim=True)


# ----------------------------------------------------------------------------- references
def mmd_reference(x: np.ndarray, y: np.ndarray, kernel: str, sigma: float) -> float:
    """Eq. 15 with the kernels of eq. 16, as explicit double loops."""

    def k(u, v):
        d = math.sqrt(sum((ui - vi) ** 2 for ui, vi in zip(u, v, strict=True)))
        return math.exp(-d / sigma) if kernel == "laplacian" else math.exp(-(d**2) / (2 * sigma**2))

    n, m = len(x), len(y)
    k_xx = sum(k(x[i], x[j]) for i in range(n) for j in range(n)) / n**2
    k_xy = sum(k(x[i], y[j]) for i in range(n) for j in range(m)) / (n * m)
    k_yy = sum(k(y[i], y[j]) for i in range(m) for j in range(m)) / m**2
    return k_xx - 2 * k_xy + k_yy


def entropic_ot_reference(x: np.ndarray, y: np.ndarray, eps: float) -> float:
    """W_eps of eq. 11: min <D^p, T> + eps sum T (log T - 1), D^p = |u - v|^2 / 2, uniform marginals.
    The plan comes from POT's log-domain Sinkhorn; the objective is evaluated here in float64."""
    a = np.full(len(x), 1.0 / len(x))
    b = np.full(len(y), 1.0 / len(y))
    cost = 0.5 * ot.dist(x, y, metric="sqeuclidean")
    plan = ot.sinkhorn(a, b, cost, eps, method="sinkhorn_log", numItermax=5000, stopThr=1e-8, warn=False)
    entropy = np.where(plan > 0, plan * (np.log(np.where(plan > 0, plan, 1.0)) - 1.0), 0.0)
    return float((cost * plan).sum() + eps * entropy.sum())


def sinkhorn_divergence_reference(x: np.ndarray, y: np.ndarray, eps: float) -> float:
    """Eq. 13."""
    return entropic_ot_reference(x, y, eps) - 0.5 * (
        entropic_ot_reference(x, x, eps) + entropic_ot_reference(y, y, eps)
    )


def class_sets(z: torch.Tensor, labels: torch.Tensor, min_count: int = 2):
    """(k, Z_k+, Z_k-) for the classes DCDL uses (eq. 1), by a plain loop."""
    for k in sorted(set(labels.tolist())):
        members = labels == k
        if members.sum() >= min_count and (~members).sum() >= 1:
            yield k, z[members], z[~members]


# ----------------------------------------------------------------------------- MMD
@pytest.mark.parametrize("kernel", ["laplacian", "gaussian"])
@pytest.mark.parametrize("sigma", [0.05, 0.7])
def test_mmd_matches_double_loop(kernel, sigma):
    x, y = unit_cloud(5, 3, 0), unit_cloud(7, 3, 1, shift=0.3)
    got = mmd(x, y, kernel, sigma).item()
    assert got == pytest.approx(mmd_reference(x.numpy(), y.numpy(), kernel, sigma), rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("kernel", ["laplacian", "gaussian"])
def test_classwise_mmd_matches_per_class_loop(kernel):
    z = unit_cloud(11, 4, 2)
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4])  # classes 2 and 4 are singletons: skipped
    got = classwise_mmd(z, labels, kernel, sigma=0.5)
    expected = [mmd_reference(p.numpy(), n.numpy(), kernel, 0.5) for _, p, n in class_sets(z, labels)]
    assert got.shape == (3,)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-10)


@pytest.mark.parametrize("kernel", ["laplacian", "gaussian"])
def test_classwise_mmd_gradcheck(kernel):
    z = unit_cloud(7, 3, 3).requires_grad_(True)
    labels = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    assert torch.autograd.gradcheck(lambda e: classwise_mmd(e, labels, kernel, sigma=0.5), (z,))


# ----------------------------------------------------------------------------- Sinkhorn
@pytest.mark.parametrize("eps", [2.5e-3, 0.2])
def test_sinkhorn_divergence_matches_pot(eps):
    x, y = unit_cloud(5, 3, 4), unit_cloud(7, 3, 5, shift=0.5)
    expected = sinkhorn_divergence_reference(x.numpy(), y.numpy(), eps)
    assert sinkhorn_divergence(x, y, epsilon=eps).item() == pytest.approx(expected, rel=2e-5, abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sinkhorn_default_is_converged_near_the_papers_values(dtype):
    """Values near 0.7 (one class of 6 against 54 others, eps = 2.5e-3): the default solver reaches POT's
    converged log-domain Sinkhorn within 1e-5 (a fixed annealing with ratio 0.9 stopped ~4e-3 short)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=g, dtype=torch.float64)
    y = torch.randn(54, 8, generator=g, dtype=torch.float64)
    x[:, 0] += 2.4
    x, y = x / x.norm(dim=1, keepdim=True), y / y.norm(dim=1, keepdim=True)
    expected = sinkhorn_divergence_reference(x.numpy(), y.numpy(), 2.5e-3)
    assert 0.6 < expected < 0.8
    assert sinkhorn_divergence(x.to(dtype), y.to(dtype)).item() == pytest.approx(expected, abs=1e-5)


def test_compiled_sinkhorn_iterations_give_the_eager_loss_and_gradient():
    """--compile runs the iterations through torch.compile (fused kernels): the same fixed point, for batches of
    any size (compiled once, for dynamic sizes)."""
    for classes, per_class in ((10, 6), (8, 4)):
        g = torch.Generator().manual_seed(classes)
        labels = torch.arange(classes).repeat_interleave(per_class)
        x = torch.nn.functional.normalize(torch.randn(classes, 32, generator=g)[labels]
                                          + torch.randn(len(labels), 32, generator=g), dim=1)
        results = []
        for loss in (DCDLLoss(phi="sinkhorn"), DCDLLoss(phi="sinkhorn").compile_solver()):
            leaf = x.clone().requires_grad_(True)
            value = loss(leaf, labels)
            value.backward()
            results.append((value.item(), leaf.grad))
        (eager, eager_grad), (fused, fused_grad) = results
        assert fused == pytest.approx(eager, rel=1e-5)
        assert (fused_grad - eager_grad).abs().max() <= 1e-4 * eager_grad.abs().max()


def test_sinkhorn_epsilon_is_the_temperature_of_eq_11():
    """eps multiplies the entropy of eq. 11 as given: the tempting mistake of a blur radius sqrt(eps) taken for
    eps (temperature eps^2) lands far outside the tolerance."""
    x, y = unit_cloud(5, 3, 6), unit_cloud(6, 3, 7, shift=0.4)
    eps = 0.2
    right = sinkhorn_divergence_reference(x.numpy(), y.numpy(), eps)
    got = sinkhorn_divergence(x, y, epsilon=eps).item()
    wrong = sinkhorn_divergence(x, y, epsilon=eps**2).item()
    assert got == pytest.approx(right, rel=2e-5)
    assert abs(wrong - right) > 20 * abs(got - right)


def test_sinkhorn_divergence_is_zero_between_equal_clouds():
    x = unit_cloud(6, 3, 8)
    # W(x, x) and the self-transport terms converge separately, each to the solver's tolerance (1e-6)
    assert abs(sinkhorn_divergence(x, x.clone()).item()) < 1e-6
    assert abs(sinkhorn_divergence(x, x.clone(), tolerance=1e-10).item()) < 1e-9


def test_classwise_sinkhorn_padding_changes_nothing():
    z = unit_cloud(12, 4, 9)
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2, 5, 5, 7])  # unequal sizes -> padded batches
    got = classwise_sinkhorn(z, labels)
    expected = [sinkhorn_divergence(p, n).item() for _, p, n in class_sets(z, labels)]
    assert got.shape == (4,)
    np.testing.assert_allclose(got.detach().numpy(), expected, rtol=1e-4)


def test_classwise_sinkhorn_gradient_matches_finite_differences_of_pot():
    """geomloss's envelope-theorem gradient against a central difference of the POT reference of eq. 13.
    The gradient is taken at approximately converged potentials: ~0.2 % off at scaling 0.995."""
    z = unit_cloud(8, 3, 10)
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    direction = unit_cloud(8, 3, 11)
    eps = 0.2

    def reference(e):
        return sum(
            sinkhorn_divergence_reference(p.numpy(), n.numpy(), eps) for _, p, n in class_sets(e, labels)
        )

    zg = z.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(classwise_sinkhorn(zg, labels, epsilon=eps, tolerance=1e-9).sum(), zg)
    h = 1e-4
    numeric = (reference(z + h * direction) - reference(z - h * direction)) / (2 * h)
    assert (grad * direction).sum().item() == pytest.approx(numeric, rel=3e-3)


# ----------------------------------------------------------------------------- the loss
def clustered_batch(classes: int, per_class: int, dim: int = 16, spread: float = 0.6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=g)
    labels = torch.arange(classes).repeat_interleave(per_class)
    return centres[labels] + spread * torch.randn(len(labels), dim, generator=g), labels


def paper_triplet_reference(z: torch.Tensor, labels: torch.Tensor, tau: float) -> torch.Tensor:
    """dcdl eq. 3 as the paper runs it, by a triple loop: squared distances of the unit embeddings, FaceNet's
    semi-hard triplets (d_ap < d_an < d_ap + tau, Schroff et al. 2015 sec. 3.2), the mean over them."""
    u = z / z.norm(dim=1, keepdim=True)
    terms = []
    for a in range(len(u)):
        for p in range(len(u)):
            if p == a or labels[p] != labels[a]:
                continue
            d_ap = ((u[a] - u[p]) ** 2).sum()
            for n in range(len(u)):
                if labels[n] == labels[a]:
                    continue
                d_an = ((u[a] - u[n]) ** 2).sum()
                if d_ap < d_an < d_ap + tau:
                    terms.append(torch.clamp(d_ap - d_an + tau, min=0.0))
    return torch.stack(terms).mean() if terms else z.sum() * 0.0


def test_paper_triplet_matches_triple_loop_values_and_gradients():
    z, labels = clustered_batch(10, 6, dim=16, spread=0.8)
    z = z.double().requires_grad_(True)
    loss_fn = DCDLLoss(local="triplet", lam=0.0).local  # the local loss DCDL builds by default
    assert (loss_fn.squared, loss_fn.mining, loss_fn.margin, loss_fn.reduction) == (True, "semihard", 0.5, "triplets")
    got = loss_fn(z, labels)
    expected = paper_triplet_reference(z, labels, 0.5)
    assert got.item() == pytest.approx(expected.item(), rel=1e-12)
    assert loss_fn.last_stats["triplets"] > 0
    (g_got,) = torch.autograd.grad(got, z)
    (g_expected,) = torch.autograd.grad(expected, z)
    torch.testing.assert_close(g_got, g_expected, rtol=1e-10, atol=1e-12)
    # the LoOp / Symm form is another, larger loss on the same batch (the lambda balance the paper tuned is off)
    loop_form = DCDLLoss(local="triplet", lam=0.0, local_form="loop").local
    assert (loop_form.squared, loop_form.mining, loop_form.margin) == (False, "all", 0.2)
    assert loop_form(z, labels).item() != pytest.approx(got.item(), rel=0.1)


def test_paper_triplet_degenerate_batches_are_finite():
    loss_fn = DCDLLoss(local="triplet")
    z = torch.randn(6, 8, requires_grad=True)
    for labels in (torch.tensor([0, 0, 1, 1, 2, 2]), torch.tensor([0, 0, 0, 0, 0, 0])):
        value = loss_fn(z, labels)
        value.backward()
        assert torch.isfinite(value) and torch.isfinite(z.grad).all()
    far = torch.eye(4, 8, dtype=torch.float64).repeat_interleave(2, 0).requires_grad_(True)  # no semi-hard triplet
    value = DCDLLoss(local="triplet", lam=0.0)(far, torch.arange(4).repeat_interleave(2))
    value.backward()
    assert value.item() == 0.0 and torch.isfinite(far.grad).all()


@pytest.mark.parametrize("local_form", ["paper", "loop"])
@pytest.mark.parametrize("phi", ["mmd_laplacian", "mmd_gaussian", "sinkhorn"])
def test_dcdl_is_local_plus_lambda_times_minus_sum_over_classes(phi, local_form):
    z, labels = clustered_batch(3, 3, dim=8)
    loss = losses.build(
        "dcdl", phi=phi, local="triplet", local_kwargs={"margin": 0.5}, sigma=0.5, epsilon=0.2, local_form=local_form
    )
    if local_form == "paper":
        local = lambda e, y: paper_triplet_reference(e.double(), y, 0.5)  # noqa: E731
    else:
        local = losses.build("triplet", margin=0.5)
    zn = (z / z.norm(dim=1, keepdim=True)).double()
    if phi == "sinkhorn":
        phis = [
            sinkhorn_divergence_reference(p.numpy(), n.numpy(), 0.2) for _, p, n in class_sets(zn, labels)
        ]
        rel = 2e-5
    else:
        kernel = phi.split("_")[1]
        phis = [mmd_reference(p.numpy(), n.numpy(), kernel, 0.5) for _, p, n in class_sets(zn, labels)]
        rel = 1e-5
    expected_lambda = 0.5 if phi == "sinkhorn" else 0.2  # the paper's values
    assert loss.lam == expected_lambda
    expected = local(z, labels).item() + expected_lambda * -sum(phis)  # eq. 2 and 5
    assert loss(z, labels).item() == pytest.approx(expected, rel=rel, abs=1e-6)
    assert loss.last_stats["dcdl_classes"] == 3


def test_class_reduction_mean_divides_by_classes_used():
    z, labels = clustered_batch(5, 2)
    total = losses.build("dcdl", phi="mmd_gaussian", local=None, lam=1.0, sigma=0.5)
    mean = losses.build("dcdl", phi="mmd_gaussian", local=None, lam=1.0, sigma=0.5, class_reduction="mean")
    assert mean(z, labels).item() == pytest.approx(total(z, labels).item() / 5, rel=1e-6)


@pytest.mark.parametrize("phi", ["mmd_laplacian", "sinkhorn"])
def test_degenerate_batches_are_finite(phi):
    z = torch.randn(6, 8, requires_grad=True)
    one_class = torch.zeros(6, dtype=torch.long)
    singletons = torch.arange(6)
    for labels in (one_class, singletons):
        loss = DCDLLoss(phi=phi, local=None)(z, labels)
        assert torch.isfinite(loss) and loss.item() == 0.0
        (grad,) = torch.autograd.grad(loss, z)
        assert torch.isfinite(grad).all()
    # one class with 2 samples, the rest singletons: only that class counts
    labels = torch.tensor([0, 0, 1, 2, 3, 4])
    loss_fn = DCDLLoss(phi=phi, local=None, lam=1.0)
    value = loss_fn(z, labels)
    assert torch.isfinite(value) and value.item() < 0 and loss_fn.last_stats["dcdl_classes"] == 1
    # with the triplet local loss on a single-class batch the total is finite too
    assert torch.isfinite(DCDLLoss(phi=phi)(z, one_class))


def test_split_classes_skips_small_classes_and_full_batch_class():
    split = split_classes(torch.tensor([3, 3, 3, 8, 9, 9]), min_samples_per_class=2)
    assert split.classes.tolist() == [3, 9]
    np.testing.assert_allclose(split.positive_weights.sum(1).numpy(), 1.0)
    np.testing.assert_allclose(split.negative_weights.sum(1).numpy(), 1.0)
    assert split_classes(torch.zeros(4, dtype=torch.long)).classes.numel() == 0


@pytest.mark.parametrize("phi", ["mmd_laplacian", "mmd_gaussian", "sinkhorn"])
def test_gradients_flow_and_training_separates_classes(phi):
    """A few Adam steps on L_phi alone increase the class-wise discrepancy (the aim of eq. 2)."""
    z0, labels = clustered_batch(3, 4, dim=6, spread=2.0, seed=1)
    z = z0.clone().requires_grad_(True)
    loss_fn = losses.build("dcdl", phi=phi, local=None, lam=1.0, sigma=0.5)
    optimiser = torch.optim.Adam([z], lr=0.05)
    first = None
    for _ in range(15):
        optimiser.zero_grad()
        loss = loss_fn(z, labels)
        loss.backward()
        assert torch.isfinite(z.grad).all() and z.grad.abs().sum() > 0
        first = loss.item() if first is None else first
        optimiser.step()
    assert loss_fn(z, labels).item() < first - 1e-3


@pytest.mark.parametrize("local", ["npair", "angular", "angular_npair"])
def test_paper_local_losses_build(local):
    z, labels = clustered_batch(4, 2)
    value = losses.build("dcdl", phi="mmd_laplacian", local=local)(z.requires_grad_(True), labels)
    value.backward()
    assert torch.isfinite(value)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="phi"):
        DCDLLoss(phi="wasserstein")
    with pytest.raises(ValueError, match="cannot be 'dcdl'"):
        DCDLLoss(local="dcdl")
    with pytest.raises(ValueError, match="epsilon"):
        DCDLLoss(epsilon=0.0)
    with pytest.raises(ValueError, match="class_reduction"):
        DCDLLoss(class_reduction="max")
    with pytest.raises(ValueError, match="embeddings"):
        DCDLLoss(local=None)(torch.randn(4, 3), torch.zeros(5, dtype=torch.long))


# ----------------------------------------------------------------------------- auxiliary CE head
from retrieval.losses.auxiliary import AuxiliaryCrossEntropy  # noqa: E402


@pytest.mark.parametrize("normalized", [False, True])
def test_aux_ce_learns_separable_classes(normalized):
    embeddings, labels = clustered_batch(4, 8, dim=16, spread=0.3, seed=3)
    torch.manual_seed(0)
    aux = AuxiliaryCrossEntropy(16, 4, weight=0.5, normalized=normalized)
    optimiser = torch.optim.SGD(aux.parameters(), lr=0.1 if normalized else 0.5)
    first = aux(embeddings, labels)
    assert torch.isfinite(first)
    # weight * CE, CE checked against the explicit formula -log softmax
    logits = aux.logits(embeddings)
    manual = -(logits.log_softmax(1)[torch.arange(len(labels)), labels]).mean()
    assert first.item() == pytest.approx(0.5 * manual.item(), rel=1e-6)
    for _ in range(30):
        optimiser.zero_grad()
        aux(embeddings, labels).backward()
        optimiser.step()
    last = aux(embeddings, labels)
    assert last.item() < 0.5 * first.item()
    assert aux.last_stats["aux_accuracy"] == 1.0


def test_aux_ce_gradient_reaches_embeddings_and_bad_labels_are_named():
    aux = AuxiliaryCrossEntropy(8, 3, weight=2.0)
    z = torch.randn(5, 8, requires_grad=True)
    aux(z, torch.tensor([0, 1, 2, 0, 1])).backward()
    assert z.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="num_classes"):
        aux(z, torch.tensor([0, 1, 3, 0, 1]))
    with pytest.raises(ValueError, match="embedding_dim"):
        aux(torch.randn(5, 7), torch.zeros(5, dtype=torch.long))
    assert aux(torch.randn(0, 8), torch.zeros(0, dtype=torch.long)).item() == 0.0
    assert AuxiliaryCrossEntropy(8, 3, normalized=True).temperature == 0.05
