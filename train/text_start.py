"""Where ``retrieval text train`` starts: the zero-shot tower an image model names beside it (``retrieval export
--pretrained`` writes one), its projection and class bridge read back from the tower's graph, or, where there is none
(or ``start`` is ridge), the ridge regression ``TowerTrainer`` fits itself."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from retrieval.errors import ParameterError
from retrieval.text.tower import TextTower
from retrieval.train.text_config import TextTrainConfig

if TYPE_CHECKING:
    from retrieval.text.text_onnx import TowerFile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ZeroShotStart:
    """The zero-shot tower training starts from: its file, its projection ([dim, width] and [dim]) and the class
    names it was trained on (the anchors)."""

    path: Path
    weight: np.ndarray
    bias: np.ndarray
    classes: list[str]
    bridge: dict[str, Any] | None = None  # its class bridge's buffers, temperature and top (None: it has none)

    def apply(self, tower: TextTower) -> None:
        """Put the start's projection (and class bridge) into ``tower``."""
        from retrieval.text.tower import ClassBridge

        with torch.no_grad():
            tower.projection.weight.copy_(torch.from_numpy(self.weight))
            tower.projection.bias.copy_(torch.from_numpy(self.bias))
        if self.bridge is not None:
            tower.bridge = ClassBridge(**{k: torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray) else v
                                          for k, v in self.bridge.items()})


def zero_shot_start(config: TextTrainConfig, model_hash: str, encoder_name: str) -> ZeroShotStart | None:
    """The zero-shot tower ``config.model`` names beside it, as training's start (``config.start``: auto takes it
    where there is a usable one, zero-shot insists, ridge never takes it)."""
    from retrieval.text.sibling_text import named_text_model, read_model_metadata

    if config.start == "ridge":
        return None
    tower, problem = named_text_model(config.model, read_model_metadata(config.model))
    if tower is None:
        return _no_start(config, problem)
    try:
        return _loaded_start(tower, model_hash, encoder_name)
    except ZeroShotStartError as exc:
        problem = str(exc)
    except Exception as exc:  # a damaged tower: onnx's, JSON's and the record's own errors
        problem = f"{tower.path} cannot be read as a zero-shot tower ({type(exc).__name__}: {str(exc)[:200]})"
    return _no_start(config, problem)


class ZeroShotStartError(ValueError):
    """A tower named beside the model that is no zero-shot start for this training."""


def _no_start(config: TextTrainConfig, problem: str | None) -> None:
    """No zero-shot start: refused where ``config.start`` insists on one, else said in one line."""
    why = problem or f"{config.model} names no text tower beside it"
    if config.start == "zero-shot":
        raise ParameterError("start", f"is zero-shot, but {why}; a pretrained export (`retrieval export "
                                      "--pretrained`) writes the zero-shot tower, or start from the ridge instead")
    log.info("training starts from the ridge regression: no zero-shot start (%s)", why)
    return None


def _loaded_start(tower: TowerFile, model_hash: str, encoder_name: str) -> ZeroShotStart:
    """The zero-shot tower ``tower`` (its bytes as hashed) as a start for a training for ``model_hash`` with
    ``encoder_name``."""
    import onnx
    from onnx import numpy_helper

    from retrieval.text.gallery_adapt import zero_shot_classes
    from retrieval.text.text_onnx import TextTowerRecord

    proto = onnx.load_model_from_string(tower.data)
    metadata = {entry.key: entry.value for entry in proto.metadata_props}
    weights = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer
               if i.name in ("projection.weight", "projection.bias", *BRIDGE_BUFFERS)}
    record = TextTowerRecord.from_metadata(metadata)
    classes = zero_shot_classes(metadata)
    problem = (
        "it is not a zero-shot tower" if classes is None else
        f"it was trained for image model {record.image_model_hash}, not {model_hash}"
        if record.image_model_hash != model_hash else
        f"its encoder is {record.encoder.get('name')!r}, this training's {encoder_name!r}"
        if record.encoder.get("name") != encoder_name or record.encoder.get("layers_tuned") else
        "its projection is not the tower's linear map" if not {"projection.weight", "projection.bias"} <= set(
            weights) else None)
    if problem is not None:
        raise ZeroShotStartError(problem)
    return ZeroShotStart(tower.path, weights["projection.weight"].astype(np.float32),
                         weights["projection.bias"].astype(np.float32), list(classes or []),
                         _bridge(weights, metadata))


BRIDGE_BUFFERS = ("bridge.text_features_t", "bridge.class_index", "bridge.rows")


def _bridge(weights: dict[str, np.ndarray], metadata: dict[str, str]) -> dict[str, Any] | None:
    """A zero-shot tower's class bridge, from its graph's buffers and its training record (None: it has none)."""
    if not set(BRIDGE_BUFFERS) <= set(weights):
        return None
    training = json.loads(metadata.get("zero_shot_training") or "{}")
    return {"text_features_t": weights["bridge.text_features_t"], "class_index": weights["bridge.class_index"],
            "rows": weights["bridge.rows"], "temperature": float(training.get("bridge_temperature", 0.1)),
            "top": None if training.get("bridge_top") is None else int(training["bridge_top"])}
