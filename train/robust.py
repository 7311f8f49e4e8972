"""Robust fine-tuning in a run: the weights fine-tuning starts from, and what keeps the model near them.

``RobustFineTuning`` holds the start (the pretrained backbone, and the head LP-FT trained on it), the L2-SP
penalty toward it, the frozen teacher of feature distillation, the EMA of the weights, and WiSE-FT's mix of start
and end. The maths lives in the core (``retrieval.models.weight_space``, ``.ema``, ``.layer_decay``,
``retrieval.losses.regularizers``); docs/ROBUST.md says which paper and equation each follows.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from retrieval.losses.regularizers import L2SPPenalty
from retrieval.models import Embedder
from retrieval.models.ema import WeightEMA
from retrieval.models.layer_decay import layerwise_param_groups
from retrieval.models.weight_space import interpolate_weights
from retrieval.train.config import TrainConfig
from retrieval.train.head_start import starts_at_baseline

WISE_ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)  # the curve drawn in the report; "auto" chooses among them


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the model's weights (on the CPU: it waits until the end of the run)."""
    return {key: value.detach().to("cpu", copy=True) for key, value in model.state_dict().items()}


@dataclass
class RobustFineTuning:
    """The start of fine-tuning and the terms built on it; ``state_dict`` is what a checkpoint keeps of it."""

    start: dict[str, torch.Tensor]  # the model fine-tuning started from (after LP-FT's head phase)
    head_trained_at_start: bool  # LP-FT: the start's head is meaningful, so WiSE-FT mixes it too
    keep_start: bool  # WiSE-FT will mix toward the start: checkpoints keep it
    penalty: L2SPPenalty | None = None
    teacher: nn.Module | None = None
    ema: WeightEMA | None = None

    @classmethod
    def build(cls, cfg: TrainConfig, model: Embedder) -> RobustFineTuning:
        """Everything the configuration asks for, anchored at ``model``'s current (pretrained) weights."""
        penalty = teacher = ema = None
        if cfg.l2sp > 0:
            penalty = L2SPPenalty(model.backbone.named_parameters(), cfg.l2sp)
        if cfg.distill > 0:
            teacher = copy.deepcopy(model.backbone).eval().requires_grad_(False)
        if cfg.ema > 0:
            ema = WeightEMA(model, cfg.ema)
        # a head that starts at the baseline is meaningful from the start (a resume does not start it again)
        return cls(snapshot(model), cfg.lp_epochs > 0 or starts_at_baseline(cfg), cfg.wise_alpha is not None,
                   penalty, teacher, ema)

    def to(self, device: torch.device) -> RobustFineTuning:
        for module in (self.penalty, self.teacher):
            if module is not None:
                module.to(device)
        return self

    def eval_model(self, model: Embedder) -> Embedder:
        """The weights that are evaluated and saved as the model: the EMA when there is one."""
        return self.ema.module if self.ema is not None else model

    def penalty_term(self) -> torch.Tensor | None:
        return self.penalty() if self.penalty is not None else None

    def after_step(self, model: nn.Module) -> None:
        if self.ema is not None:
            self.ema.update(model)

    def restart_from(self, model: nn.Module) -> None:
        """LP-FT's second phase begins: the head it trained becomes part of the start (WiSE-FT mixes toward it)."""
        self.start = snapshot(model)

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs: the start when WiSE-FT will mix toward it (the L2-SP anchor and the teacher are
        the pretrained weights, which set-up rebuilds), and the EMA."""
        return {"start": self.start if self.keep_start else None,
                "ema": self.ema.state_dict() if self.ema is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("start") is not None:
            self.start = {key: value.cpu() for key, value in state["start"].items()}
        if self.ema is not None and state.get("ema") is not None:
            self.ema.load_state_dict(state["ema"])

    def mix(self, finetuned: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
        """WiSE-FT: (1 - alpha) * start + alpha * finetuned; a head that started random stays fine-tuned, and so
        does a projection into an old space (--compatible-with an old model of another size), trained with it."""

        def keep(key: str) -> bool:
            return key.startswith(("head.", "compatible.")) and not self.head_trained_at_start

        return interpolate_weights(self.start, {k: v.detach().cpu() for k, v in finetuned.items()}, alpha, keep)


def backbone_param_groups(cfg: TrainConfig, model: Embedder) -> list[dict[str, Any]]:
    """The backbone's optimizer groups: one learning rate, or one per layer (--layer-decay); L2-SP replaces the
    backbone's weight decay (a pull toward zero) by its pull toward the start."""
    lr = cfg.backbone_lr or cfg.lr / 10
    decay = {"weight_decay": 0.0} if cfg.l2sp > 0 else {}
    if cfg.layer_decay < 1:
        return layerwise_param_groups(model.backbone, lr, cfg.layer_decay, **decay)
    params = [p for p in model.backbone.parameters() if p.requires_grad]
    return [{"params": params, "lr": lr, "name": "backbone", **decay}] if params else []


def choose_alpha(curve: list[dict[str, Any]], tolerance: float) -> float:
    """WiSE-FT "auto": the alpha of the best in-domain validation Recall@1 among those whose out-of-domain
    validation Recall@1 (mean over the extra sets) is within ``tolerance`` of the start's (alpha 0). Without
    out-of-domain data, the best in-domain; without in-domain validation, the best out-of-domain. Ties go to the
    smaller alpha (nearer the start)."""
    points = sorted(curve, key=lambda p: p["alpha"])
    if points[0].get("out_of_domain") is None:
        return max(points, key=lambda p: (p["in_domain"], -p["alpha"]))["alpha"]
    if points[0].get("in_domain") is None:
        return max(points, key=lambda p: (p["out_of_domain"], -p["alpha"]))["alpha"]
    floor = points[0]["out_of_domain"] - max(tolerance, 0.0)
    allowed = [p for p in points if p["out_of_domain"] >= floor]  # alpha 0 always is
    return max(allowed, key=lambda p: (p["in_domain"], -p["alpha"]))["alpha"]


def choose_kept_alpha(curve: list[dict[str, Any]], floor: float) -> float:
    """WiSE-FT "auto" without labels: the largest alpha (the most fine-tuned mix) whose images keep at least
    ``floor`` of their pretrained neighbours (``kept``); 0, the start, where none does."""
    allowed = [p["alpha"] for p in curve if p.get("kept") is not None and p["kept"] >= floor]
    return max(allowed, default=0.0)
