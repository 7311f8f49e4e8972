"""Regularisers for robust fine-tuning: stay near the pretrained weights (L2-SP) or features (distillation).

These are not metric-learning losses and are registered nowhere: the trainer adds them to the loss.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from retrieval.distances import l2_normalize

__all__ = ["L2SPPenalty", "feature_distillation"]

_ANCHOR_PREFIX = "anchor__"


def _anchor_name(param_name: str) -> str:
    # Buffer names may not contain '.'; '__' keeps distinct parameter names distinct in practice (checked below).
    return _ANCHOR_PREFIX + param_name.replace(".", "__")


class L2SPPenalty(nn.Module):
    """L2-SP (Li, Grandvalet, Davoine, ICML 2018), its first term: alpha/2 * sum ||w - w0||^2 over the anchored params.

    The constructor anchors the given (name, parameter) pairs at their current values: a detached float32 copy
    of each is kept as a buffer, so the anchor is part of this module's ``state_dict`` and ``load_state_dict``
    restores it (build the penalty, then load: the loaded anchor replaces the current weights); the trainer instead
    rebuilds it from the pretrained weights on resume.
    The parameters themselves are referenced, not registered: the penalty owns no parameters.

    The paper's second term, beta/2 * ||w_Sbar||^2 on the layers that have no pretrained value (the embedding
    head), is plain L2 shrinkage: leave it to the optimiser's weight decay on the head's param group and do not
    anchor the head here (AdamW's decoupled decay is the usual stand-in, not the same update as this gradient).

    ``forward()`` returns a float32 scalar on the parameters' device (0 for no parameters); its gradient with
    respect to w is alpha * (w - w0). Keep the penalty on the model's device (``penalty.to(device)``): an anchor
    on another device is copied over at every call.
    """

    def __init__(self, named_parameters: Iterable[tuple[str, nn.Parameter]], weight: float) -> None:
        super().__init__()
        if not weight >= 0.0:
            raise ValueError(f"L2-SP weight must be >= 0, got {weight}")
        self.weight = float(weight)
        self._params: list[tuple[str, nn.Parameter]] = []
        for name, param in named_parameters:
            buffer_name = _anchor_name(name)
            if buffer_name in self._buffers:
                raise ValueError(f"parameter {name!r} is given twice or collides with another name's anchor")
            self.register_buffer(buffer_name, param.detach().to(torch.float32, copy=True))
            self._params.append((buffer_name, param))

    def forward(self) -> torch.Tensor:
        """alpha/2 * sum over anchored parameters of ||w - w0||^2, a float32 scalar."""
        if not self._params:
            return torch.zeros((), dtype=torch.float32)
        terms = []
        for buffer_name, param in self._params:
            anchor = self._buffers[buffer_name]
            # .to() is a no-op when the model and the anchor share a device; it follows a model moved alone.
            diff = param.to(torch.float32) - anchor.to(param.device)
            terms.append((diff * diff).sum())
        return 0.5 * self.weight * torch.stack(terms).sum()

    def extra_repr(self) -> str:
        return f"weight={self.weight}, parameters={len(self._params)}"


def feature_distillation(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """LwF-style feature term: mean_i || s_i/||s_i|| - t_i/||t_i|| ||^2 (= 2 - 2 cos) for [B, F] features.

    The teacher is detached. A zero row normalises to the zero vector (the project's eps in ``l2_normalize``),
    so its term is ||other||^2 in {0, 1} and every value and gradient stays finite; an empty batch gives 0.
    Computed in at least float32.
    """
    if student.ndim != 2 or student.shape != teacher.shape:
        raise ValueError(
            f"student and teacher must both be [B, F], got {tuple(student.shape)} and {tuple(teacher.shape)}"
        )
    dtype = torch.promote_types(torch.promote_types(student.dtype, teacher.dtype), torch.float32)
    if student.shape[0] == 0:
        return student.to(dtype).sum() * 0.0  # keeps the graph: a mean over no rows would be NaN
    s = l2_normalize(student.to(dtype), dim=1)
    t = l2_normalize(teacher.detach().to(dtype), dim=1)
    # The difference form (not 2 - 2 cos) is exactly 0 when student == teacher.
    return ((s - t) ** 2).sum(dim=1).mean()
