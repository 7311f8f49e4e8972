"""LoOp and Symm losses against slow references: Python loops over the papers' formulas, float64."""

from __future__ import annotations

import math

import pytest
import torch

from retrieval.losses import build
from retrieval.losses.registry import NEGATIVES
from retrieval.negatives.loop import optimal_arc_distance, optimal_segment_distance
from retrieval.negatives.symm import reflect, synthetic_share, synthetic_share_on_device

F64 = torch.float64


def batch(seed: int = 0, classes: int = 4, per_class: int = 4, dim: int = 6):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(classes).repeat_interleave(per_class)
    labels = labels[torch.randperm(len(labels), generator=g)]
    return torch.randn(len(labels), dim, dtype=F64, generator=g), labels


def ref_pairs(labels: torch.Tensor) -> list[tuple[int, int, int]]:
    """Members of each class paired in order of appearance (the documented rule), by explicit loops."""
    members: dict[int, list[int]] = {}
    for idx, c in enumerate(labels.tolist()):
        members.setdefault(c, []).append(idx)
    return [(m[t], m[t + 1], c) for c, m in members.items() for t in range(0, len(m) - 1, 2)]


def value_and_grad(fn, emb: torch.Tensor):
    e = emb.clone().requires_grad_(True)
    v = fn(e)
    (g,) = torch.autograd.grad(v, e)
    return v.detach(), g


def assert_matches_reference(loss_module, reference, emb, labels) -> None:
    v, g = value_and_grad(lambda e: loss_module(e, labels), emb)
    v_ref, g_ref = value_and_grad(lambda e: reference(e, labels), emb)
    assert v.item() > 0
    assert v.item() == pytest.approx(v_ref.item(), rel=1e-9, abs=1e-12)
    assert torch.allclose(g, g_ref, atol=1e-9), (g - g_ref).abs().max()
    assert g.abs().sum() > 0


# --- LoOp references -----------------------------------------------------------------------------------


def loop_d(x, i, j, k, l, linear=False):  # noqa: E741
    fn = optimal_segment_distance if linear else optimal_arc_distance
    return fn(x[i : i + 1], x[j : j + 1], x[k : k + 1], x[l : l + 1])[0]


def ref_loop_triplet(emb, labels, margin=0.2, linear=False):
    x = emb / emb.norm(dim=1, keepdim=True)
    pairs = ref_pairs(labels)
    total = emb.new_zeros(())
    for i, j, c in pairs:
        for k, l, c2 in pairs:  # noqa: E741
            if c2 != c:  # eq. 15
                total = total + torch.relu((x[i] - x[j]).norm() - loop_d(x, i, j, k, l, linear) + margin)
    return total / len(pairs)


def _hardest_negative(x, pairs, i, j, c, linear=False):
    return torch.stack([loop_d(x, i, j, k, l, linear) for k, l, c2 in pairs if c2 != c]).min()  # noqa: E741


def ref_all_pairs(labels: torch.Tensor) -> list[tuple[int, int, int]]:
    """Every same-class pair k < l: the min over c[i] != c[k] = c[l] of LoOp section 3.3 read literally."""
    y = labels.tolist()
    return [(k, l, y[k]) for k in range(len(y)) for l in range(k + 1, len(y)) if y[k] == y[l]]  # noqa: E741


def _negative_pairs(labels, negative_pairs):
    return ref_pairs(labels) if negative_pairs == "consecutive" else ref_all_pairs(labels)


def ref_loop_hphn(emb, labels, margin=0.2, negative_pairs="consecutive"):
    x = emb / emb.norm(dim=1, keepdim=True)
    pairs, others = ref_pairs(labels), _negative_pairs(labels, negative_pairs)
    total = emb.new_zeros(())
    for i, j, c in pairs:
        same = [k for k in range(len(labels)) if labels[k] == c]
        hp = torch.stack([(x[a] - x[k]).norm() for a in (i, j) for k in same if k != a]).max()
        total = total + torch.relu(hp + margin - _hardest_negative(x, others, i, j, c))
    return total / len(pairs)


def ref_loop_lifted_min(emb, labels, margin=1.0, negative_pairs="consecutive"):
    x = emb / emb.norm(dim=1, keepdim=True)
    pairs, others = ref_pairs(labels), _negative_pairs(labels, negative_pairs)
    total = emb.new_zeros(())
    for i, j, c in pairs:
        total = total + torch.relu((x[i] - x[j]).norm() + margin - _hardest_negative(x, others, i, j, c))
    return total / len(pairs)


def ref_loop_ms(emb, labels, alpha=2.0, beta=50.0, gamma=0.5, eps=0.1, positive_rule="batch"):
    """LoOp section 3.3.4: negatives s_{i,k,j,l} kept by s > min_pos - eps; positives kept by the rule that
    "remains unchanged", s < max over the batch negatives + eps ("batch"), or against the LoOp ones ("loop")."""
    x = emb / emb.norm(dim=1, keepdim=True)
    pairs = ref_pairs(labels)
    terms = []
    for i, j, c in pairs:
        neg = [1 - loop_d(x, i, j, k, l) ** 2 / 2 for k, l, c2 in pairs if c2 != c]  # s_{i,k,j,l}  # noqa: E741
        for a in (i, j):
            pos = [x[a] @ x[k] for k in range(len(labels)) if labels[k] == c and k != a]
            batch_neg = [x[a] @ x[k] for k in range(len(labels)) if labels[k] != c]
            min_pos = min(float(s.detach()) for s in pos)
            max_neg = max(float(s.detach()) for s in (batch_neg if positive_rule == "batch" else neg))
            pos_sum = sum((torch.exp(-alpha * (s - gamma)) for s in pos if s < max_neg + eps), emb.new_zeros(()))
            neg_sum = sum((torch.exp(beta * (s - gamma)) for s in neg if s > min_pos - eps), emb.new_zeros(()))
            terms.append(torch.log1p(pos_sum) / alpha + torch.log1p(neg_sum) / beta)
    return torch.stack(terms).mean()


@pytest.mark.parametrize(
    "name,method,kwargs,reference",
    [
        ("triplet", "loop", {}, ref_loop_triplet),
        ("triplet", "loop-linear", {}, lambda e, y: ref_loop_triplet(e, y, linear=True)),
        ("hphn_triplet", "loop", {}, ref_loop_hphn),
        ("hphn_triplet", "loop", {"negative_pairs": "all"}, lambda e, y: ref_loop_hphn(e, y, negative_pairs="all")),
        ("lifted_min", "loop", {}, ref_loop_lifted_min),
        ("lifted_min", "loop", {"negative_pairs": "all"},
         lambda e, y: ref_loop_lifted_min(e, y, negative_pairs="all")),
        ("ms", "loop", {}, ref_loop_ms),
        ("ms", "loop", {"positive_rule": "loop"}, lambda e, y: ref_loop_ms(e, y, positive_rule="loop")),
    ],
    ids=["triplet", "triplet-linear", "hphn", "hphn-all-pairs", "lifted_min", "lifted_min-all-pairs", "ms",
         "ms-loop-positive-rule"],
)
def test_loop_losses_match_reference(name, method, kwargs, reference) -> None:
    emb, labels = batch(seed=1)
    if name == "ms":  # spread similarities so that the mining keeps some pairs and drops others
        emb = emb + 1.5 * torch.nn.functional.one_hot(labels, emb.shape[1]).to(F64)
    assert_matches_reference(build(name, negatives=method, **kwargs), reference, emb, labels)


@pytest.mark.parametrize("name", ["hphn_triplet", "lifted_min"])
def test_loop_negative_pairs_readings_differ_with_more_than_two_per_class(name) -> None:
    """With 4 samples per class Algorithm 1 forms 2 pairs per class, the literal reading 6: the min over more
    pairs is smaller, so the loss is larger; with 2 per class the readings coincide."""
    emb, labels = batch(seed=5, classes=3, per_class=4)
    consecutive = build(name, negatives="loop")(emb, labels)
    every = build(name, negatives="loop", negative_pairs="all")(emb, labels)
    assert every.item() > consecutive.item()
    emb2, labels2 = batch(seed=5, classes=4, per_class=2)
    assert build(name, negatives="loop", negative_pairs="all")(emb2, labels2).item() == pytest.approx(
        build(name, negatives="loop")(emb2, labels2).item(), rel=1e-12)


def test_ms_positive_rule_readings_differ() -> None:
    emb, labels = batch(seed=1)
    emb = emb + 1.5 * torch.nn.functional.one_hot(labels, emb.shape[1]).to(F64)
    batch_rule = build("ms", negatives="loop")(emb, labels)
    loop_rule = build("ms", negatives="loop", positive_rule="loop")(emb, labels)
    assert batch_rule.item() != pytest.approx(loop_rule.item(), rel=1e-6)
    with pytest.raises(ValueError, match="positive_rule"):
        build("ms", positive_rule="both")
    with pytest.raises(ValueError, match="negative_pairs"):
        build("hphn_triplet", negative_pairs="some")
    with pytest.raises(ValueError, match="consecutive"):  # Symm has no literal reading to offer
        NEGATIVES.build("symm").pair_terms(emb, labels, True, None, "all")


def test_loop_triplet_gradient_matches_finite_differences() -> None:
    emb, labels = batch(seed=4, classes=3, per_class=2, dim=4)
    loss = build("triplet", negatives="loop", margin=1.0)
    assert torch.autograd.gradcheck(lambda e: loss(e, labels), (emb.requires_grad_(True),), eps=1e-6, atol=1e-6)


def test_loop_ms_gradient_matches_finite_differences() -> None:
    emb, labels = batch(seed=6, classes=3, per_class=4, dim=4)
    loss = build("ms", negatives="loop")
    assert torch.autograd.gradcheck(lambda e: loss(e, labels), (emb.requires_grad_(True),), eps=1e-6, atol=1e-6)


# --- Symm references -----------------------------------------------------------------------------------


def points(x, i, j):
    return [x[i], x[j], reflect(x[i][None], x[j][None])[0], reflect(x[j][None], x[i][None])[0]]


def ref_symm_triplet(emb, labels, margin=0.2, stats=None):
    x = emb / emb.norm(dim=1, keepdim=True)
    pairs = ref_pairs(labels)
    total, syn, count = emb.new_zeros(()), 0, 0
    for i, j, c in pairs:
        for k, l, c2 in pairs:  # noqa: E741
            if c2 == c:
                continue
            cands = [
                (((a - b) ** 2).sum(), ia, ib)
                for ia, a in enumerate(points(x, i, j))
                for ib, b in enumerate(points(x, k, l))
            ]
            best = min(cands, key=lambda t: float(t[0].detach()))
            syn, count = syn + (best[1] >= 2) + (best[2] >= 2), count + 2
            total = total + torch.relu(((x[i] - x[j]) ** 2).sum() - best[0] + margin)  # eq. 4
    if stats is not None:
        stats["share"] = syn / count
    return total / len(pairs)


def ref_symm_lifted(emb, labels, margin=1.0):
    x = emb / emb.norm(dim=1, keepdim=True)
    pairs = ref_pairs(labels)
    total = emb.new_zeros(())
    for i, j, c in pairs:
        exps = []
        for k, l, c2 in pairs:  # noqa: E741
            if c2 != c:
                d = torch.stack([(a - b).norm() for a in points(x, i, j) for b in points(x, k, l)]).min()
                exps.append(torch.exp(margin - d))
        total = total + torch.relu(torch.log(sum(exps)) + (x[i] - x[j]).norm()) ** 2  # eq. 6
    return total / len(pairs)


def ref_symm_npair(emb, labels):
    pairs = ref_pairs(labels)
    terms = []
    for i, j, c in pairs:
        s = [
            torch.stack([a @ b for a in points(emb, i, j) for b in points(emb, k, l)]).max()
            for k, l, c2 in pairs
            if c2 != c
        ]  # noqa: E501, E741
        terms.append(torch.log1p(sum(torch.exp(v - emb[i] @ emb[j]) for v in s)))  # eq. 8
    return torch.stack(terms).mean() + norm_penalty(emb)


def norm_penalty(emb, l2_reg=0.002):
    """Sohn 2016's embedding-norm regulariser (lambda = 0.002), which symm section 3.1 relies on."""
    return l2_reg * sum((emb[i] ** 2).sum() for i in range(len(emb))) / len(emb)


def ref_symm_angular(emb, labels, alpha=30.0):
    t2 = math.tan(math.radians(alpha)) ** 2
    pairs = ref_pairs(labels)
    terms = []
    for i, j, c in pairs:
        xi, xj, xi_s, xj_s = points(emb, i, j)
        f_p = 2 * (1 + t2) * (xi @ xj)
        f_n = []
        for k, l, c2 in pairs:  # noqa: E741
            if c2 != c:
                f_n.append(
                    torch.stack(
                        [4 * t2 * (a + b) @ r for a, b in ((xi, xj), (xi_s, xj), (xi, xj_s)) for r in points(emb, k, l)]
                    ).max()
                )  # noqa: E501
        terms.append(torch.log1p(sum(torch.exp(v - f_p) for v in f_n)))  # eq. 10
    return torch.stack(terms).mean() + norm_penalty(emb)


@pytest.mark.parametrize(
    "name,reference",
    [
        ("triplet", ref_symm_triplet),
        ("lifted", ref_symm_lifted),
        ("npair", ref_symm_npair),
        ("angular", ref_symm_angular),
    ],
)
def test_symm_losses_match_reference(name, reference) -> None:
    emb, labels = batch(seed=2)
    emb = emb * 0.3 if name in ("npair", "angular") else emb  # raw features: keep the logits moderate
    assert_matches_reference(build(name, negatives="symm"), reference, emb, labels)


def test_symm_synthetic_share_matches_brute_force() -> None:
    emb, labels = batch(seed=8, classes=5, per_class=4)
    emb = emb + 2.0 * torch.nn.functional.one_hot(labels, emb.shape[1]).to(F64)  # clustered: synthetics win
    loss = build("triplet", negatives="symm")
    loss(emb, labels)
    stats: dict = {}
    ref_symm_triplet(emb, labels, stats=stats)
    assert 0 < stats["share"] < 1
    assert loss.last_stats["synthetic_negative_share"] == pytest.approx(stats["share"])
    selected = torch.randint(0, 16, (7, 7), generator=torch.Generator().manual_seed(1))
    used = torch.rand(7, 7, generator=torch.Generator().manual_seed(2)) > 0.3
    assert float(synthetic_share(selected, used)) == pytest.approx(float(synthetic_share_on_device(selected, used)))


# --- registry and degenerate batches -------------------------------------------------------------------


def test_undefined_combination_lists_the_existing_ones() -> None:
    with pytest.raises(ValueError, match=r"triplet\+loop.*") as info:
        build("npair", negatives="loop")
    assert "npair+symm" in str(info.value) and "ms+loop-linear" in str(info.value)
    with pytest.raises(ValueError, match="combinations that exist"):
        build("triplet", negatives="mixup")


ALL = [
    ("triplet", "loop"), ("triplet", "loop-linear"), ("hphn_triplet", "loop"), ("lifted_min", "loop"),
    ("ms", "loop"), ("ms", "loop-linear"), ("triplet", "symm"), ("lifted", "symm"), ("npair", "symm"),
    ("angular", "symm"),
]  # fmt: skip


@pytest.mark.parametrize("name,method", ALL)
def test_degenerate_batches_are_finite(name, method) -> None:
    loss = build(name, negatives=method)
    emb, labels = batch(seed=3)
    emb[labels == 1] = emb[labels == 1][0]  # a class collapsed to one point: zero-length arcs
    emb[labels == 2] = -emb[labels == 0][0]  # antipodal to another class
    e = emb.float().requires_grad_(True)
    value = loss(e, labels)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(e.grad).all()
    assert 0.0 <= loss.last_stats["synthetic_negative_share"] <= 1.0
    # one class only: nothing to push apart, a zero loss connected to the graph
    e1 = emb[:4].clone().requires_grad_(True)
    zero = loss(e1, torch.zeros(4, dtype=torch.long))
    zero.backward()
    assert zero.item() == 0.0 and (e1.grad == 0).all()
    with pytest.raises(ValueError, match="2 or more images per class"):
        loss(emb, torch.arange(len(labels)))
