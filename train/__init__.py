"""Training: ``retrieval train`` (config, loop, checkpoints, report).

``train`` and ``TrainingDiverged`` are imported on first use (PEP 562): the command line reads ``TrainConfig`` for
every command and imports torch only when it trains.
"""

from retrieval.train.config import TrainConfig
from retrieval.utils.lazy import lazy_exports

# public name -> the submodule that defines it (torch)
_SOURCES = {"epochs": ("TrainingDiverged",), "trainer": ("train",)}
__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)

__all__ = ["TrainConfig", *_SOURCES["epochs"], *_SOURCES["trainer"]]
