"""Hard-negative methods composed with the losses' pair-level forms: every combination the factory offers, the
rule that decides which exist, a new method added as one class and its name, the leaf registry, and the methods
importing nothing of the losses (no import cycle)."""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from retrieval.losses import available_negatives, build, composable
from retrieval.losses.base import PairLoss
from retrieval.losses.registry import LOSSES, NEGATIVES
from retrieval.negatives import base as negatives_base
from retrieval.negatives.base import HardNegativeMethod

F64 = torch.float64
PAIR_LOSSES = sorted(
    name
    for name in LOSSES.names()
    if isinstance(LOSSES.get(name), type)
    and issubclass(LOSSES.get(name), PairLoss)
    and LOSSES.get(name).from_pair_terms is not PairLoss.from_pair_terms
)


def batch(seed: int = 0, classes: int = 4, per_class: int = 4, dim: int = 6):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(classes).repeat_interleave(per_class)
    labels = labels[torch.randperm(len(labels), generator=g)]
    emb = torch.randn(len(labels), dim, dtype=F64, generator=g)
    return emb + 1.5 * torch.nn.functional.one_hot(labels, dim).to(F64), labels  # clustered: mining keeps some


def test_every_pair_loss_and_method_is_composed_or_refused_for_a_reason() -> None:
    assert {"triplet", "hphn_triplet", "lifted", "lifted_min", "ms", "npair", "angular"} <= set(PAIR_LOSSES)
    assert {"loop", "loop-linear", "symm"} <= set(NEGATIVES.names())
    for name in PAIR_LOSSES:
        loss_cls = LOSSES.get(name)
        for method in NEGATIVES.names():
            method_cls = NEGATIVES.get(method)
            unit_ok = loss_cls.cosine_similarity or not method_cls.unit_only
            rows_ok = loss_cls.positive_rows is None or method_cls.supports_rows
            assert composable(name, method) == (unit_ok and rows_ok), (name, method)
    # LoOp is defined on the unit sphere: the losses on raw inner products take Symm only
    assert ("npair", "loop") not in available_negatives() and ("npair", "symm") in available_negatives()
    assert not composable("contrastive", "symm")  # no pair-level form


@pytest.mark.parametrize("name,method", available_negatives())
def test_every_composed_loss_has_a_finite_value_and_gradient(name: str, method: str) -> None:
    loss = build(name, negatives=method)
    emb, labels = batch(seed=5)
    emb = emb * 0.3 if not loss.loss.cosine_similarity else emb  # raw features: moderate logits
    e = emb.clone().requires_grad_(True)
    value = loss(e, labels)
    value.backward()
    assert value.dim() == 0 and torch.isfinite(value) and value.item() > 0
    assert torch.isfinite(e.grad).all() and e.grad.abs().sum() > 0
    assert 0.0 <= loss.last_stats["synthetic_negative_share"] <= 1.0
    one_class = e.detach()[:4].clone().requires_grad_(True)
    zero = loss(one_class, torch.zeros(4, dtype=torch.long))
    zero.backward()
    assert zero.item() == 0.0 and (one_class.grad == 0).all()


@pytest.mark.parametrize("name,method", [("lifted", "loop"), ("ms", "symm"), ("hphn_triplet", "symm")])
def test_new_combinations_pass_gradcheck(name: str, method: str) -> None:
    emb, labels = batch(seed=6, classes=3, per_class=4, dim=4)
    loss = build(name, negatives=method)
    assert torch.autograd.gradcheck(lambda e: loss(e, labels), (emb.requires_grad_(True),), eps=1e-6, atol=1e-6)


LOOP_COMBINATIONS = [pytest.param(name, method, {}, id=f"{name}-{method}")
                     for name, method in available_negatives() if method.startswith("loop")]


@pytest.mark.parametrize("name,method,hparams", [
    *LOOP_COMBINATIONS, pytest.param("lifted_min", "loop", {"negative_pairs": "all"}, id="lifted_min-loop-all")])
def test_a_loop_loss_under_torch_compile_is_one_graph_after_the_host_pairing(name: str, method: str,
                                                                            hparams: dict) -> None:
    # the NumPy pairing runs outside the graph (traced, it becomes torch ops with data-dependent shapes: several
    # graph breaks); everything after it, the solver and the loss's pair-level form, is one graph
    loss = build(name, negatives=method, **hparams)
    emb, labels = batch(seed=7, dim=8)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(loss)(emb.float().requires_grad_(True), labels)
    assert explained.graph_break_count == 1 and explained.graph_count == 2, explained.break_reasons


@pytest.mark.parametrize("name,method,hparams", [
    pytest.param("ms", "loop", {}, id="ms-loop"),  # arcs, each problem solved once (symmetric grid)
    pytest.param("lifted_min", "loop-linear", {"negative_pairs": "all"}, id="lifted_min-loop-linear-all"),
])
def test_a_compiled_loop_solver_gives_the_eager_results_and_is_compiled_for_fixed_sizes_first(
        name: str, method: str, hparams: dict) -> None:
    # retrieval train --compile: the solver and its grid run through torch.compile (Inductor's C++ on a CPU),
    # compiled for the first batch's sizes (the fast kernels a class-balanced sampler reuses), then once more, for
    # dynamic sizes, when the second batch brings new ones; the third reuses that
    eager_loss = build(name, negatives=method, **hparams)
    compiled_loss = build(name, negatives=method, **hparams)
    compiled_loss.method.compile_solver()
    torch._dynamo.reset()
    graphs = [counters["stats"]["unique_graphs"]]
    for seed, classes in ((8, 5), (9, 6), (10, 7)):
        emb, labels = batch(seed=seed, classes=classes, per_class=4, dim=16)
        results = []
        for loss in (eager_loss, compiled_loss):
            e = emb.float().requires_grad_(True)
            value = loss(e, labels)
            value.backward()
            results.append((value.item(), e.grad, {key: float(v) for key, v in loss.last_stats.items()}))
        (eager, eager_grad, eager_stats), (fused, fused_grad, fused_stats) = results
        assert eager > 0 and eager_grad.abs().sum() > 0
        assert fused == pytest.approx(eager, rel=1e-5)
        torch.testing.assert_close(fused_grad, eager_grad, rtol=1e-4, atol=1e-4 * eager_grad.abs().max().item())
        assert fused_stats == pytest.approx(eager_stats, rel=1e-5)
        assert eager_stats["synthetic_negative_share"] > 0  # the statistic compared is not a trivial 0
        graphs.append(counters["stats"]["unique_graphs"])
    assert [after - before for before, after in itertools.pairwise(graphs)] == [1, 1, 0]


def test_paper_defaults_apply_and_explicit_hparams_win() -> None:
    assert build("triplet", negatives="symm").loss.squared  # Symm eq. 4: squared distances
    assert not build("triplet", negatives="symm", squared=False).loss.squared
    assert not build("triplet", negatives="loop").loss.squared  # LoOp eq. 15: distances
    with pytest.raises(ValueError, match="no pair-level form"):
        build("triplet", negatives="loop", mining="hard")(*batch())


class RealPairsOnly(HardNegativeMethod):
    """A method in one class: the hardest negative of pairs p, q is the most similar of their 4 real pairs."""

    def gram(self, embeddings: torch.Tensor, unit: bool) -> torch.Tensor:
        x = torch.nn.functional.normalize(embeddings, dim=1) if unit else embeddings
        return x @ x.T

    def hardest(self, gram, pairs, negative, rows, *, columns=None, combinations=None):
        ends = (pairs.first, pairs.second)
        hardest = torch.stack([gram[a][:, b] for a in ends for b in ends]).amax(dim=0)
        return hardest, {"synthetic_negative_share": 0.0}


@pytest.fixture
def real_pairs_method(monkeypatch) -> str:
    monkeypatch.setitem(NEGATIVES._factories, "real-pairs", RealPairsOnly)
    return "real-pairs"


def test_a_new_method_is_one_class_and_works_with_every_pair_loss(real_pairs_method: str) -> None:
    assert {name for name, method in available_negatives() if method == real_pairs_method} == set(PAIR_LOSSES) - {
        "angular"  # its positive side sums two points: only a method that supports rows feeds it
    }
    emb, labels = batch(seed=7)
    triplet = build("triplet", negatives=real_pairs_method, margin=0.5)
    x = torch.nn.functional.normalize(emb, dim=1)
    members = [(labels == c).nonzero().flatten().tolist() for c in range(4)]
    pairs = [(m[t], m[t + 1]) for m in members for t in range(0, len(m) - 1, 2)]  # in order of appearance
    expected = sum(
        torch.relu((x[i] - x[j]).norm() - min((x[a] - x[b]).norm() for a in (i, j) for b in (k, l)) + 0.5)
        for i, j in pairs
        for k, l in pairs  # noqa: E741
        if labels[i] != labels[k]
    ) / len(pairs)
    assert triplet(emb, labels).item() == pytest.approx(float(expected), rel=1e-9)


def test_registry_module_imports_no_losses_and_no_methods() -> None:
    code = (
        "import sys, retrieval.losses.registry as r; "
        "names = r.LOSSES.names(), r.NEGATIVES.names(), r.available(), 'dcdl' in r.LOSSES; "
        "loaded = [m for m in sys.modules if m.startswith(('retrieval.losses.', 'retrieval.negatives', 'torch')) "
        "and m != 'retrieval.losses.registry']; "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_methods_import_nothing_of_the_losses() -> None:
    """The losses import the methods (``PairTerms``); what both need is ``retrieval.utils.reads``, so no import of
    ``retrieval.negatives``, function-level ones included, points back into ``retrieval.losses``."""
    back = []
    for path in sorted(Path(negatives_base.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                named = [node.module or "", *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            back += [f"{path.name}:{node.lineno}" for name in named if name.split(".")[:2] == ["retrieval", "losses"]]
    assert not back, back
