"""The optimizer and learning-rate schedule registries (timm style): adding one is one decorated function.

Importing this module imports no torch: ``TrainConfig`` reads the names from here to check ``optimizer`` and
``schedule``; an optimizer factory imports torch when it builds one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from retrieval.utils.registry import Registry

# name -> factory(param_groups, weight_decay) -> torch.optim.Optimizer; each group carries its own "lr"
OPTIMIZERS: Registry[Any] = Registry("optimizer")
# name -> factor(step, steps) -> float: the learning rate's multiplier at ``step`` of the ``steps`` after warmup
SCHEDULES: Registry[float] = Registry("schedule")


def fused_on_cuda(param_groups: list[dict]) -> bool | None:
    """True (torch's fused kernels) when every parameter is on a CUDA device, else None (torch's default).

    Fused, an fp16 step skipped for an overflow is skipped on the GPU (GradScaler hands the optimizer its found-inf
    flag) instead of the host reading that flag back and waiting for the GPU every step; and it is fewer kernels.
    Adam's state starts at zeros, so a skipped first step leaves it as it was."""
    params = [p for group in param_groups for p in group["params"]]
    return True if params and all(p.is_cuda for p in params) else None


@OPTIMIZERS.register("adamw")
def adamw(param_groups: list[dict], weight_decay: float) -> Any:
    """AdamW (decoupled weight decay)."""
    import torch

    return torch.optim.AdamW(param_groups, weight_decay=weight_decay, fused=fused_on_cuda(param_groups))


@OPTIMIZERS.register("adam")
def adam(param_groups: list[dict], weight_decay: float) -> Any:
    """Adam (weight decay added to the gradient)."""
    import torch

    return torch.optim.Adam(param_groups, weight_decay=weight_decay, fused=fused_on_cuda(param_groups))


@OPTIMIZERS.register("sgd")
def sgd(param_groups: list[dict], weight_decay: float) -> Any:
    """SGD with Nesterov momentum 0.9 (torch's default kernels: fused SGD makes its momentum buffers uninitialised, and
    an fp16 overflow on the first step, common while GradScaler's scale settles, would keep that garbage)."""
    import torch

    return torch.optim.SGD(param_groups, momentum=0.9, weight_decay=weight_decay, nesterov=True)


@SCHEDULES.register("cosine")
def cosine_schedule(step: int, steps: int) -> float:
    """Half a cosine from 1 to 0."""
    return 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, steps))))


@SCHEDULES.register("step")
def step_schedule(step: int, steps: int) -> float:
    """1, then 0.1 from two thirds of training on."""
    return 0.1 if step >= steps * 2 // 3 else 1.0


@SCHEDULES.register("constant")
def constant_schedule(step: int, steps: int) -> float:
    """1 throughout."""
    return 1.0


def schedule_factor(name: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The multiplier of the base learning rate at each optimizer step: linear warmup, then schedule ``name``."""
    shape = SCHEDULES.get(name)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return shape(step - warmup_steps, total_steps - warmup_steps)

    return factor
