"""The optimizer and schedule registries: every registered name builds, and the schedules follow their formulas."""

from __future__ import annotations

import math

import pytest
import torch

from retrieval.train.optimizers import OPTIMIZERS, SCHEDULES, schedule_factor


def reference_factor(schedule: str, step: int, warmup: int, total: int) -> float:
    """Linear warmup, then half a cosine, a x0.1 step at two thirds, or a constant, written out plainly."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    if schedule == "step":
        return 0.1 if step >= warmup + (total - warmup) * 2 // 3 else 1.0
    return 1.0


@pytest.mark.parametrize("name", SCHEDULES.names())
@pytest.mark.parametrize("warmup,total", [(0, 1), (0, 10), (3, 10), (5, 5), (2, 7), (0, 100)])
def test_every_schedule_follows_its_formula_after_a_linear_warmup(name, warmup, total):
    factor = schedule_factor(name, warmup, total)
    for step in range(total + 3):  # a resumed schedule may be asked past its end
        assert factor(step) == pytest.approx(reference_factor(name, step, warmup, total), abs=1e-12), step


@pytest.mark.parametrize("name", OPTIMIZERS.names())
def test_every_optimizer_builds_with_each_groups_own_learning_rate(name):
    head, body = torch.nn.Linear(4, 2), torch.nn.Linear(4, 4)
    groups = [{"params": list(head.parameters()), "lr": 0.1, "name": "head"},
              {"params": list(body.parameters()), "lr": 0.01, "name": "backbone"}]
    optimizer = OPTIMIZERS.build(name, param_groups=groups, weight_decay=1e-4)
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.01]
    assert all(g["weight_decay"] == 1e-4 for g in optimizer.param_groups)
    loss = head(body(torch.ones(1, 4))).sum()
    loss.backward()
    before = head.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(before, head.weight)


def test_an_unknown_schedule_names_the_registered_ones():
    with pytest.raises(KeyError, match="available: constant, cosine, step"):
        schedule_factor("linear", 0, 10)


@pytest.mark.parametrize("name", OPTIMIZERS.names())
def test_optimizers_of_cpu_parameters_keep_torchs_default_kernels(name):
    groups = [{"params": list(torch.nn.Linear(4, 2).parameters()), "lr": 0.1}]
    assert not OPTIMIZERS.build(name, param_groups=groups, weight_decay=0.0).defaults.get("fused")
