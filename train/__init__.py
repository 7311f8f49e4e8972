"""Training: ``retrieval train`` (config, loop, checkpoints, report)."""

from train.config import TrainConfig
from train.trainer import TrainingDiverged, train

__all__ = ["TrainConfig", "TrainingDiverged", "train"]
