"""Training: ``retrieval train`` (config, loop, checkpoints, report).

- ``config``: ``TrainConfig``: a run's options, declared once; TOML or JSON, overridden by command-line options.
- ``optimizers``: the optimizer and learning-rate schedule registries (no torch on import).
- ``trainer``: ``train``: the run: set-up or resume, epochs, evaluation, checkpoints, WiSE-FT, the report.
- ``state``: the trainer's state, declared: what set-up builds and what a checkpoint carries.
- ``building``: what a run trains, built from its config: the model, sampler, loss, optimizer and schedule.
- ``epochs``: one training epoch of optimizer steps (``TrainingDiverged`` when it cannot go on).
- ``data``: the run's data (``TrainData``): train, validation, evaluation and out-of-domain sets.
- ``features``: the trainer's inputs: cached backbone features (frozen backbone) or images (fine-tuning).
- ``feature_cache``: the frozen-backbone feature cache: what a split's features depend on, where they are kept.
- ``compatible``: ``--compatible-with OLD``: the frozen old model, and the hashes the new model declares.
- ``robust``: robust fine-tuning: the weights it starts from and what keeps the model near them.
- ``head_start``: where a run's head starts (``--head-start``).
- ``head_start_options``: ``--head-start``'s choices and help (no torch: the configuration declares it).
- ``pretrained_export``: the pretrained export a labelled run is measured against, and whether to keep it.
- ``evaluating``: evaluation during training, WiSE-FT's choice of the mix, the run's report.
- ``checkpointing``: checkpoints and logs: ``last.pt``, ``best.pt``, ``--resume``, metrics.jsonl, steps.jsonl.
- ``report``: the run report: report.json and its pictures.
- ``console``: what a run says to people as it goes, above any progress bar.
- ``tracking``: TensorBoard event files, and MLflow when asked (``--mlflow``).
- ``distributed``: several training processes (torchrun): the process group, the rank's device, the launcher.
- ``pseudo_labelling``: training without labels, the positives refreshed each epoch (``--pseudo-labels``).
- ``label_free_check``: whether a run without labels can tell its trained model from its start.
- ``label_free_report``: the report of a run without labels.
- ``grid_runner``: the results grid runner (``retrieval results run``).
- ``text_config``: ``TextTrainConfig``: ``retrieval text train``'s options, declared once (no torch).
- ``text_start``: where ``retrieval text train`` starts.
- ``text_tower``: ``train_text_tower``: LiT onto a locked image model.
- ``zero_shot_tower``: ``train_zero_shot_tower``: a text tower with no captions, onto an ImageNet classifier.

``train`` and ``TrainingDiverged`` are imported on first use (PEP 562): the command line reads ``TrainConfig`` for
every command and imports torch only when it trains.
"""

from retrieval.train.config import TrainConfig
from retrieval.utils.lazy import lazy_exports

# public name -> the submodule that defines it (torch)
_SOURCES = {"epochs": ("TrainingDiverged",), "trainer": ("train",)}
__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)

__all__ = ["TrainConfig", *_SOURCES["epochs"], *_SOURCES["trainer"]]
