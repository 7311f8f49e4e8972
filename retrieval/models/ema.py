"""An exponential moving average of a model's weights, kept by torch's own ``AveragedModel``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

__all__ = ["WeightEMA"]


class WeightEMA:
    """ema = decay * ema + (1 - decay) * w after each ``update(model)``, over parameters AND buffers.

    Semantics of ``torch.optim.swa_utils.AveragedModel`` that matter:

    - the constructor deep-copies ``model``; the FIRST ``update`` then copies the model's current values
      (n_averaged == 0) and only later updates average, so after k >= 1 updates with weights w_1..w_k the
      average is the EMA started at w_1 (the weights at construction time are forgotten);
    - ``use_buffers=True`` averages buffers too (BatchNorm running statistics; frozen ones, which never change,
      stay equal to the model's). Integer buffers such as num_batches_tracked are averaged and truncated, so
      they lag the model's count: nothing reads them unless BatchNorm's momentum is None;
    - parameters and buffers are paired by position (``zip`` without strict): update with the same architecture
      the EMA was built from (the unwrapped model under DDP, ``ddp.module``);
    - the float update is ``torch._foreach_lerp_(ema, w, 1 - decay)``: equal to the formula above up to rounding.

    ``module`` is the averaged model (its parameters do not require grad; put it in eval mode to evaluate).
    ``state_dict()`` holds the averaged weights and buffers and ``n_averaged``; ``load_state_dict`` resumes
    exactly.
    """

    def __init__(self, model: nn.Module, decay: float, device: torch.device | str | None = None) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must be in [0, 1], got {decay}")
        self.decay = float(decay)
        self.averaged = AveragedModel(
            model, device=device, multi_avg_fn=get_ema_multi_avg_fn(self.decay), use_buffers=True
        )
        self.averaged.requires_grad_(False)

    @property
    def module(self) -> nn.Module:
        """The averaged copy of the model."""
        return self.averaged.module

    @property
    def n_averaged(self) -> int:
        """How many updates have been applied (the first one copies)."""
        return int(self.averaged.n_averaged.item())

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Fold the model's current parameters and buffers into the average."""
        self.averaged.update_parameters(model)

    def state_dict(self) -> dict[str, Any]:
        """The averaged weights ('module.*'), 'n_averaged' and the decay, for a checkpoint."""
        return {"decay": self.decay, "averaged": self.averaged.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned; a different decay is refused (the run would not be the same)."""
        if float(state["decay"]) != self.decay:
            raise ValueError(f"EMA checkpoint has decay {state['decay']}, this EMA has {self.decay}")
        self.averaged.load_state_dict(state["averaged"])
