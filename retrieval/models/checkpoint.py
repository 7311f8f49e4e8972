"""The training checkpoint (``retrieval-checkpoint/1``): one definition of its keys, for its writer and its readers.

On disk a checkpoint is a flat dict saved with ``torch.save``: ``format`` and the fields below, by name, the two
configs as their JSON objects (plain dicts: a ``weights_only`` load takes no class of ours). The model fields are all a
reader needs to rebuild the embedder; the resume fields (None in a model-only file) are what ``retrieval train
--resume`` restores.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from retrieval.records.model_config import ModelConfig
from retrieval.records.run_config import RunConfig
from retrieval.reports import BEST_CHECKPOINT, LAST_CHECKPOINT

CHECKPOINT_FORMAT = "retrieval-checkpoint/1"
# keys added to retrieval-checkpoint/1 after its first release: written only when a run has them, so a file
# from a run without them reads back and writes the same dict
_WRITTEN_WHEN_SET = frozenset({"training_weights", "robust", "reference"})


@dataclass
class Checkpoint:
    """The contents of a checkpoint file; ``to_dict``/``from_dict`` give and read its on-disk form."""

    # the model
    model_config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    train_config: RunConfig = field(default_factory=RunConfig)
    config_hash: str | None = None
    epoch: int = 0  # epochs complete
    metrics: dict[str, Any] = field(default_factory=dict)
    class_names: list[str] = field(default_factory=list)
    # what a resume needs
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    scaler: dict[str, Any] | None = None
    loss_state: dict[str, Any] | None = None
    aux_state: dict[str, Any] | None = None
    best_recall: float | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    baseline: dict[str, float] | None = None
    bad_images: list[dict[str, Any]] = field(default_factory=list)
    steps_per_epoch: int | None = None
    in_epoch: dict[str, Any] | None = None  # the epoch under way (a mid-epoch checkpoint), as EpochProgress fields
    rng: dict[str, Any] | None = None  # "torch", "numpy", "python" and, on CUDA, "cuda" generator states
    training_weights: dict[str, torch.Tensor] | None = None  # --ema: the trained weights (state_dict is the EMA)
    robust: dict[str, Any] | None = None  # the fine-tuning start and the EMA state (train/robust.py)
    reference: dict[str, Any] | None = None  # --eval-extra: the pretrained backbone's metrics at its resolution

    @property
    def resumable(self) -> bool:
        """Whether the file holds the training state a resume needs (a model-only file does not)."""
        return self.optimizer is not None and self.rng is not None

    def to_dict(self) -> dict[str, Any]:
        """The on-disk form (no copies: tensors are shared with the model and optimizer; the configs as JSON)."""
        written = (f.name for f in fields(self) if f.name not in _WRITTEN_WHEN_SET or getattr(self, f.name) is not None)
        configs = {"model_config": self.model_config.to_json(), "train_config": self.train_config.to_json()}
        return {"format": CHECKPOINT_FORMAT, **{name: configs.get(name, getattr(self, name)) for name in written}}

    @classmethod
    def from_dict(cls, data: Any, source: str = "checkpoint") -> Checkpoint:
        """Read the on-disk form; keys it does not hold take their default, a foreign file is refused."""
        if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{source} is not a retrieval checkpoint (expected format {CHECKPOINT_FORMAT!r})")
        read = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        for name, record in (("model_config", ModelConfig), ("train_config", RunConfig)):
            if name in read and not isinstance(read[name], record):
                try:
                    read[name] = record.from_json(read[name])
                except ValueError as exc:
                    raise ValueError(f"{source}'s {name}: {exc}") from None
        return cls(**read)


def config_hash(train_config: RunConfig) -> str:
    """Short hash of a training configuration: names the run a checkpoint (and its ONNX export) came from."""
    return hashlib.sha256(json.dumps(train_config.to_json(), sort_keys=True).encode()).hexdigest()[:16]


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> Checkpoint:
    """Read a checkpoint file written by ``retrieval train`` (or any file of the same format)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path} (a training run writes RUN_DIR/{BEST_CHECKPOINT} and "
                                f"{LAST_CHECKPOINT})")
    return Checkpoint.from_dict(torch.load(path, map_location=map_location, weights_only=False), source=str(path))
