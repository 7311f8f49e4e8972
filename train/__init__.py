"""Training: ``retrieval train`` (config, loop, checkpoints, report)."""

from retrieval.train.config import TrainConfig
from retrieval.train.trainer import TrainingDiverged, train

__all__ = ["TrainConfig", "TrainingDiverged", "train"]
