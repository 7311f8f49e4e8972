"""Every registered loss: builds with defaults, finite on a normal batch, backward, float32, degenerate
batches (finite, connected, no NaN) and clear errors for batches the sampler should not produce; the registry's
table names every loss and method class, each where it lives."""

from __future__ import annotations

import importlib
import math
import pkgutil

import pytest
import torch
from reads_back import ReadsBack

from retrieval.losses import available, available_negatives, build, needs_classes, wants_normalized
from retrieval.losses.registry import LOSSES, NEGATIVES
from retrieval.negatives.base import HardNegativeMethod
from retrieval.utils.reads import deferred_checks, read_checks, read_stats

PAIR_LOSSES = [
    "contrastive",
    "triplet",
    "hphn_triplet",
    "nca_triplet",
    "sct",
    "lifted",
    "lifted_min",
    "generalized_lifted",
    "npair",
    "angular",
    "angular_npair",
    "binomial",
    "raw",
    "ms",
]
# losses whose every term needs a positive and a negative of the same anchor (no triplet -> nothing to learn)
TRIPLET_LIKE = [n for n in PAIR_LOSSES if n not in {"contrastive", "binomial", "raw"}]


def normal_batch(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(8).repeat_interleave(4)
    labels = labels[torch.randperm(len(labels), generator=g)]
    x = torch.randn(len(labels), 16, generator=g).to(dtype)
    return x.requires_grad_(True), labels


def test_every_paper_loss_is_registered():
    assert set(PAIR_LOSSES) <= set(available())


@pytest.mark.parametrize("name", available())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_builds_with_defaults_and_trains(name, dtype):
    x, labels = normal_batch(dtype)
    loss = build(name, num_classes=8, embedding_dim=16)  # the pair losses ignore both; the proxy losses need them
    value = loss(x, labels)
    assert value.dim() == 0 and value.dtype == dtype
    assert torch.isfinite(value)
    value.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert x.grad.abs().sum() > 0
    stats = getattr(loss, "last_stats", {})
    assert all(isinstance(v, float) or (v.dim() == 0 and not v.requires_grad) for v in stats.values())
    numbers = read_stats(stats)
    assert numbers.keys() == stats.keys() and all(isinstance(v, float) and math.isfinite(v) for v in numbers.values())


# DCDL reads back as it solves: its classes' sizes and Sinkhorn's convergence
LOSSES_READING_AT_MOST_ONE_VALUE = [(name, None) for name in available() if name != "dcdl"] + available_negatives()


def batch_checks(negatives: str | None) -> int:
    """The values a forward pass reads for its batch check: one (a positive pair, the labels within the classes),
    none with a hard-negative method, which pairs the batch on the host (on a GPU it copies the labels there: a
    wait, counted by the CUDA tests) and so knows at once whether a pair exists."""
    return int(negatives is None)


@pytest.mark.parametrize(("name", "negatives"), LOSSES_READING_AT_MOST_ONE_VALUE, ids=lambda v: str(v))
def test_a_forward_pass_reads_back_its_batch_check_only_never_a_statistic(name, negatives):
    # on a GPU each value read waits for the kernels queued before it; the statistics stay on the device
    x, labels = normal_batch()
    loss = build(name, negatives=negatives, num_classes=8, embedding_dim=16)
    with ReadsBack() as reads:
        value = loss(x, labels)
    assert reads.scalars + reads.lists == batch_checks(negatives)
    with ReadsBack() as reads:
        read_stats(loss.last_stats)
        value.backward()
    assert reads.scalars == 0 and reads.lists <= 1  # every statistic in one transfer, nothing in the backward
    with ReadsBack() as reads, deferred_checks() as checks:
        loss(x, labels)
    assert reads.scalars + reads.lists == 0
    assert len(checks) == batch_checks(negatives)


# the losses whose sums run over a data-dependent set (the triplet losses' pair rows, N-pair's anchors with a
# positive, DCDL's classes): on a GPU each such set's size is read back (nonzero)
WAIT_FOR_A_SHAPE = {"angular", "angular_npair", "dcdl", "nca_triplet", "npair", "sct", "triplet"}


@pytest.mark.parametrize(("name", "negatives"), [(name, None) for name in available()] + available_negatives(),
                         ids=lambda v: str(v))
def test_only_the_losses_summing_over_a_data_dependent_set_wait_for_a_shape(name, negatives):
    x, labels = normal_batch()
    loss = build(name, negatives=negatives, num_classes=8, embedding_dim=16)
    with ReadsBack() as reads, deferred_checks():
        loss(x, labels).backward()
    # with a hard-negative method every size comes from the pairing on the host
    assert (reads.shapes > 0) == (negatives is None and name in WAIT_FOR_A_SHAPE)


BAD_BATCHES = {"no positive pair": torch.arange(8),
               "an anchor without a positive": torch.tensor([0, 0, 1, 1, 2, 3, 3, 4])}


@pytest.mark.parametrize("batch", BAD_BATCHES)
@pytest.mark.parametrize(("name", "negatives"), LOSSES_READING_AT_MOST_ONE_VALUE, ids=lambda v: str(v))
def test_a_deferred_batch_check_fails_with_the_error_it_raises_at_once(name, negatives, batch):
    x, labels = normal_batch()[0][:8].detach(), BAD_BATCHES[batch]
    loss = build(name, negatives=negatives, num_classes=8, embedding_dim=16)
    try:
        loss(x, labels)
        eager = None
    except ValueError as error:
        eager = str(error)
    try:  # the loss runs to its end on the bad batch: its caller reads the checks
        with deferred_checks() as checks:
            value = loss(x, labels)
        deferred = read_checks(checks)[1]
        assert not torch.isinf(value)
        deferred = None if deferred is None else str(deferred)
    except ValueError as error:  # a check kept at once
        deferred = str(error)
    assert deferred == eager
    if batch == "no positive pair" and not needs_classes(name):  # a proxy loss learns from every label
        assert eager is not None


def test_the_loss_class_says_whether_it_wants_normalised_embeddings():
    # N-pair keeps raw norms (symm section 4.2); every other loss, DCDL included, trains on unit embeddings
    assert [n for n in available() if not wants_normalized(n)] == ["npair"]
    from retrieval.train.config import TrainConfig

    assert not TrainConfig(loss="npair").use_normalize and TrainConfig(loss="angular").use_normalize
    assert TrainConfig(loss="npair", normalize=True).use_normalize  # an explicit --normalize wins


def test_requested_early_builds():
    assert build("triplet", margin=0.2).margin == 0.2
    ms = build("ms")
    assert (ms.alpha, ms.beta, ms.gamma, ms.vthm_margin, ms.miner) == (2.0, 50.0, 0.5, 0.1, "vthm")


# --- degenerate batches ------------------------------------------------------------------------------------
def _finite_and_connected(loss, x, labels):
    value = loss(x, labels)
    assert torch.isfinite(value), float(value)
    assert value.requires_grad
    (grad,) = torch.autograd.grad(value, x)
    assert torch.isfinite(grad).all()
    return value, grad


@pytest.mark.parametrize("name", PAIR_LOSSES)
def test_single_class_batch(name):
    x = torch.randn(6, 8).requires_grad_(True)
    labels = torch.zeros(6, dtype=torch.long)
    loss = build(name)
    value, grad = _finite_and_connected(loss, x, labels)
    if name in TRIPLET_LIKE:  # no negative: no triplet, nothing to learn but the raw-feature norm penalty
        l2_reg = getattr(loss, "l2_reg", 0.0)
        assert value.item() == pytest.approx(l2_reg * (x.detach() ** 2).sum(1).mean().item(), abs=1e-7)
        assert torch.allclose(grad, 2 * l2_reg * x.detach() / len(x), atol=1e-7)


@pytest.mark.parametrize("name", PAIR_LOSSES)
@pytest.mark.parametrize("value_of_all", [0.0, 0.3])
def test_all_embeddings_equal(name, value_of_all):
    x = torch.full((8, 4), value_of_all).requires_grad_(True)
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    _finite_and_connected(build(name), x, labels)


def _separated_batch():
    """Four tight, orthogonal clusters: every triplet is easy, VTHM mines nothing, SHN has no violations."""
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    x = torch.eye(4)[labels] + 1e-3 * torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    return x.requires_grad_(True), labels


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("ms", {}),
        ("raw", {"miner": "vthm"}),
        ("binomial", {"miner": "vthm"}),
        ("triplet", {"mining": "semihard"}),
        ("triplet", {"mining": "hard"}),
        ("hphn_triplet", {}),
        ("lifted_min", {}),
        ("generalized_lifted", {"margin": -3.0}),
    ],
)
def test_nothing_mined_gives_zero_connected_loss(name, kwargs):
    x, labels = _separated_batch()
    loss = build(name, **kwargs)
    value, grad = _finite_and_connected(loss, x, labels)
    assert value.item() == 0.0
    assert (grad == 0).all()


def test_vthm_mines_nothing_on_separated_batch():
    x, labels = _separated_batch()
    loss = build("ms")
    loss(x, labels)
    assert loss.last_stats == {"positive_pairs_kept": 0.0, "negative_pairs_kept": 0.0}


def test_semihard_nca_without_semihard_negative():
    # each anchor's positive is opposite to it (s = -1), every negative is orthogonal (s = 0): no SHN
    x = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]]).requires_grad_(True)
    labels = torch.tensor([0, 0, 1, 1])
    loss = build("nca_triplet", mining="semihard")
    value, grad = _finite_and_connected(loss, x, labels)
    assert value.item() == 0.0 and (grad == 0).all()
    assert loss.last_stats["triplets"] == 0.0


# --- errors ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", PAIR_LOSSES)
def test_batch_without_positive_pairs_names_the_sampler_setting(name):
    x = torch.randn(5, 8)
    with pytest.raises(ValueError, match="2 or more images per class"):
        build(name)(x, torch.arange(5))


@pytest.mark.parametrize("name", ["npair", "angular", "angular_npair"])
def test_npair_family_needs_a_positive_for_every_anchor(name):
    x = torch.randn(5, 8)
    with pytest.raises(ValueError, match="positive for every anchor.*2 or more images per class"):
        build(name)(x, torch.tensor([0, 0, 1, 1, 2]))


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("triplet", {"mining": "batch-all"}),
        ("nca_triplet", {"mining": "all"}),
        ("sct", {"hard_rule": "threshold"}),
        ("contrastive", {"form": "hinge"}),
        ("binomial", {"miner": "semihard"}),
        ("angular", {"alpha": 90.0}),
    ],
)
def test_bad_hyperparameters_are_refused(name, kwargs):
    with pytest.raises(ValueError, match="must be|degrees"):
        build(name, **kwargs)


def test_bad_shapes_are_refused():
    loss = build("triplet")
    with pytest.raises(ValueError, match=r"\[batch, dim\]"):
        loss(torch.randn(4), torch.tensor([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="labels must be"):
        loss(torch.randn(4, 3), torch.tensor([0, 0, 1]))


def test_pairs_come_from_labels_not_positions():
    x, labels = normal_batch(torch.float64)
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(5))
    for name in PAIR_LOSSES:
        loss = build(name)
        assert torch.allclose(loss(x, labels), loss(x[perm], labels[perm]), atol=1e-10), name


def test_losses_listing_prints_equation_defaults_and_readings():
    """`retrieval losses` reads each loss class's own equation, signature defaults and readings."""
    from click.testing import CliRunner

    from retrieval.cli.main import main
    from retrieval.losses import describe

    for name in PAIR_LOSSES + ["dcdl"]:
        assert describe(name)["equation"], name  # every loss names its paper equation
    dcdl = describe("dcdl")
    assert dcdl["defaults"]["local_form"] == "paper" and "tau = 0.5" in dcdl["readings"]["local_form"]
    assert describe("npair")["defaults"]["l2_reg"] == 0.002
    assert describe("hphn_triplet")["defaults"]["negative_pairs"] == "consecutive"
    assert describe("ms")["defaults"]["positive_rule"] == "batch"
    out = CliRunner().invoke(main, ["losses"]).output
    assert "dcdl: dcdl eq. 2 and 5" in out and "local_form=paper" in out and "negative_pairs:" in out
    assert "with --negatives: " in out


def defined_classes(package: str) -> list[type]:
    """Every class defined (not imported) in a module of ``package``."""
    found = []
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__, package + "."):
        namespace = vars(importlib.import_module(module.name))
        found += [obj for obj in namespace.values() if isinstance(obj, type) and obj.__module__ == module.name]
    return found


@pytest.mark.parametrize("registry", [LOSSES, NEGATIVES], ids=["losses", "negatives"])
def test_each_table_entry_is_the_class_it_names(registry):
    for name in registry.names():
        module, attribute = registry._paths[name].split(":")
        cls = registry.get(name)
        assert isinstance(cls, type) and (cls.__module__, cls.__qualname__) == (module, attribute), name


def test_every_loss_and_method_is_in_the_table():
    """A loss class (it names its paper equation) or a method class that the table leaves out cannot be built."""
    losses = {cls for cls in defined_classes("retrieval.losses") if getattr(cls, "paper_equation", "")}
    methods = {cls for cls in defined_classes("retrieval.negatives")
               if issubclass(cls, HardNegativeMethod) and cls is not HardNegativeMethod}
    assert losses == {LOSSES.get(name) for name in LOSSES.names()}
    assert methods == {NEGATIVES.get(name) for name in NEGATIVES.names()}
