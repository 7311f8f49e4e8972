"""Training configuration: one dataclass, loadable from TOML and overridable by command-line options."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from retrieval.data.augment import (
    AUGMENTATIONS,
    DEFAULT_AUGMENTATION,
    Augmentation,
    AugmentationError,
    augmentation_names,
    resolve_augmentation,
)
from retrieval.data.colour import parse_background

AMP_CHOICES = (True, False, "auto", "fp16", "bf16", "off")
RUNS_ROOT = "runs"  # where a run without --out goes


def new_run_folder(root: str | Path = RUNS_ROOT) -> str:
    """A run folder that does not exist yet: ROOT/YYYYmmdd-HHMMSS, then -2, -3, ... within the same second."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate, number = Path(root) / stamp, 2
    while candidate.exists():
        candidate, number = Path(root) / f"{stamp}-{number}", number + 1
    return str(candidate)


@dataclass
class TrainConfig:
    # data
    dataset: str = "emoji"
    data: str | None = None
    dataset_kwargs: dict[str, Any] = field(default_factory=dict)
    eval_split: str = "test"  # inshop: "query" (the gallery split is then "gallery")
    label_noise: str | None = None  # "symmetric:0.3" | "asymmetric:0.2" (retrieval.data.noise transitions)
    label_noise_transitions: str | None = None  # asymmetric: a JSON / CSV table of class names, from -> to
    drop_small: bool = False
    # model
    backbone: str = "efficientnet_lite0"
    pretrained: bool = True
    weights: str | None = None
    embedding_dim: int = 512
    normalize: bool | None = None  # None: chosen by the loss (retrieval.losses.wants_normalized)
    freeze_bn: bool = True
    freeze_backbone: bool = False
    image_size: int | None = None  # None: the backbone's own
    background: str = "white"  # transparent pixels are composited onto this colour (recorded with the model)
    # augmentation (retrieval.data.augment): a preset; the fields below override its values when not None
    augment: str = DEFAULT_AUGMENTATION  # crop-flip | light | strong | none (AUGMENTATIONS)
    crop_scale: list[float] | None = None  # [min, max] fraction of the image's area a random crop keeps
    crop_ratio: list[float] | None = None  # [min, max] width / height of a random crop
    color_jitter: float | None = None  # brightness = contrast = saturation = value, hue = value / 4; 0 = off
    auto_augment: str | None = None  # none | trivial (TrivialAugmentWide) | rand (RandAugment)
    # loss
    loss: str = "ms"
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    negatives: str | None = None
    aux_ce: float = 0.0
    memory: str | None = None  # "xbm": a cross-batch memory of past embeddings (retrieval/losses/memory.py)
    memory_size: int = 4096  # embeddings the memory holds
    memory_warmup: int | None = None  # optimizer steps before the loss sees the memory; None: one epoch
    chunks: int = 1  # gradient cache: embed each (rank's) batch in this many chunks, exact large batches
    # robust fine-tuning: keep what the pretrained backbone knew (docs/ROBUST.md)
    lp_epochs: int = 0  # LP-FT: train the head alone (backbone fixed) for this many epochs, then everything
    l2sp: float = 0.0  # L2-SP: weight of the penalty toward the starting backbone weights (replaces its decay)
    distill: float = 0.0  # weight of feature distillation toward the frozen starting backbone
    layer_decay: float = 1.0  # layer-wise learning-rate decay of the backbone (1 = one learning rate)
    ema: float = 0.0  # decay of an exponential moving average of the weights (0 = off); the EMA is evaluated
    wise_alpha: float | str | None = None  # WiSE-FT: mix (1 - a) start + a fine-tuned; a number, "auto" or None
    wise_tolerance: float = 0.02  # "auto": the largest in-domain Recall@1 whose out-of-domain loss is within this
    # optimisation
    batch_size: int = 64
    per_class: int = 4
    batches_per_epoch: int | None = None
    epochs: int = 10
    optimizer: str = "adamw"
    lr: float = 1e-3
    backbone_lr: float | None = None  # None: lr / 10
    loss_lr: float | None = None  # a proxy loss's proxies; None: its paper's (the loss class's proxy_lr), else lr
    weight_decay: float = 1e-4
    schedule: str = "cosine"  # cosine | step | constant
    warmup_epochs: int = 0
    grad_clip: float | None = 10.0
    max_bad_steps: int = 5
    # runtime
    seed: int = 0
    device: str = "auto"
    amp: bool | str = True  # True/"auto": fp16 on CUDA, none on CPU; "fp16" | "bf16": CUDA only; False/"off"
    channels_last: bool = False  # NHWC memory format for convolutions (CUDA only)
    compile: bool = False  # torch.compile the training step (CUDA only)
    workers: int | None = None
    eval_every: int = 1
    eval_before: bool = True
    eval_batch_size: int = 128
    eval_limit: int | None = None  # evaluate on at most this many test images (seeded subset)
    eval_extra: list[str] = field(default_factory=list)  # out-of-domain sets: data set names or image folders
    eval_extra_limit: int | None = 1000  # images of each extra set (half val, half test)
    val_fraction: float = 0.0  # train classes held out as an in-domain validation split (WiSE-FT "auto")
    linear_probe: bool = False  # DCDL protocol: logistic regression on train embeddings (before/after training)
    feature_cache: str | None = None  # where --freeze-backbone caches features (default ~/.cache/retrieval)
    out: str | None = None  # the run folder; None: a new one, runs/YYYYmmdd-HHMMSS (new_run_folder)
    resume: bool = False
    checkpoint_every: int | None = None  # also write last.pt every this many optimizer steps (mid-epoch resume)
    on_bad_image: str = "skip"  # skip | fail: what an image that cannot be read does to the run
    plots: bool = True  # the report's PNG plots (seconds of matplotlib per run)
    tensorboard: bool = True  # TensorBoard event files in RUN/tensorboard (train/tracking.py)
    mlflow: bool = False  # also track in MLflow (mlflow_uri, else MLFLOW_TRACKING_URI, else RUN/../mlflow.db)
    mlflow_uri: str | None = None  # an MLflow tracking URI; implies mlflow
    # several processes (torchrun; see train/distributed.py)
    gather: bool = True  # the loss sees the global batch (all ranks' embeddings); False: each rank's own part
    sync_bn: bool = False  # SyncBatchNorm over the ranks, for backbones trained with BN (--no-freeze-bn); CUDA only
    dist_timeout: float = 1800.0  # seconds a rank waits for the others in a collective before it fails

    def __post_init__(self) -> None:
        self.validate()

    @property
    def classes_per_batch(self) -> int:
        return self.batch_size // self.per_class

    @property
    def use_normalize(self) -> bool:
        """Whether the model L2-normalises its embeddings: ``normalize`` if given, else what the loss wants."""
        if self.normalize is not None:
            return self.normalize
        from retrieval.losses import wants_normalized  # torch: only when a run is built

        return wants_normalized(self.loss)

    def augmentation(self) -> Augmentation:
        """The training augmentation: the ``augment`` preset with the fields that are set replacing its values."""
        return resolve_augmentation(self.augment, crop_scale=self.crop_scale, crop_ratio=self.crop_ratio,
                                    color_jitter=self.color_jitter, auto_augment=self.auto_augment)

    def _augmentation_errors(self) -> list[str]:
        """What is wrong with the augmentation fields, each naming its option."""
        if self.augment not in AUGMENTATIONS:
            return [f"--augment must be one of {', '.join(augmentation_names())}, got {self.augment!r}"]
        try:
            augmentation = self.augmentation()
        except AugmentationError as exc:
            return [f"--{name.replace('_', '-')} {problem}" for name, problem in exc.problems.items()]
        # cached features are one forward pass per image: no augmentation other than "none" can reach them
        unaugmented = (AUGMENTATIONS.build(DEFAULT_AUGMENTATION), AUGMENTATIONS.build("none"))
        if self.freeze_backbone and augmentation not in unaugmented:
            return ["--freeze-backbone trains on backbone features computed once, without augmentation, so it "
                    f"cannot use the augmentation asked for ({augmentation.describe()}): leave out --augment, "
                    "--crop-scale, --crop-ratio, --color-jitter and --auto-augment, or fine-tune without "
                    "--freeze-backbone"]
        return []

    def validate(self) -> None:
        errors = []
        if self.per_class < 2:
            errors.append(f"--per-class must be >= 2 (a class needs a positive pair), got {self.per_class}")
        elif self.batch_size % self.per_class or self.batch_size // self.per_class < 2:
            errors.append(
                f"--batch-size ({self.batch_size}) must be a multiple of --per-class ({self.per_class}) with at "
                "least 2 classes per batch"
            )
        if self.optimizer not in {"adam", "adamw", "sgd"}:
            errors.append(f"--optimizer must be adam, adamw or sgd, got {self.optimizer!r}")
        if self.schedule not in {"cosine", "step", "constant"}:
            errors.append(f"--schedule must be cosine, step or constant, got {self.schedule!r}")
        if self.epochs < 1:
            errors.append(f"--epochs must be >= 1, got {self.epochs}")
        for name in ("eval_every", "eval_batch_size", "batch_size", "embedding_dim"):
            if getattr(self, name) < 1:
                errors.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.batches_per_epoch is not None and self.batches_per_epoch < 1:
            errors.append(f"--batches-per-epoch must be >= 1, got {self.batches_per_epoch}")
        if self.resume and not self.out:
            errors.append("--resume continues a run: give its folder with --out")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            errors.append(f"--checkpoint-every must be >= 1 (optimizer steps), got {self.checkpoint_every}")
        try:
            parse_background(self.background)
        except ValueError as exc:
            errors.append(f"--background: {exc}")
        errors += self._augmentation_errors()
        if self.on_bad_image not in {"skip", "fail"}:
            errors.append(f"--on-bad-image must be skip or fail, got {self.on_bad_image!r}")
        if self.amp not in AMP_CHOICES:
            errors.append(f"--amp must be one of auto, fp16, bf16, off, got {self.amp!r}")
        if not self.dist_timeout > 0:
            errors.append(f"--dist-timeout must be > 0 seconds, got {self.dist_timeout}")
        if self.sync_bn and (self.freeze_bn or self.freeze_backbone):
            errors.append("--sync-bn synchronises BatchNorm that trains: it needs --no-freeze-bn and no "
                          "--freeze-backbone (frozen BatchNorm needs nothing)")
        if self.warmup_epochs < 0:
            errors.append(f"--warmup-epochs must be >= 0, got {self.warmup_epochs}")
        if self.lr <= 0:
            errors.append(f"--lr must be > 0, got {self.lr}")
        if self.loss_lr is not None and not self.loss_lr > 0:
            errors.append(f"--loss-lr must be > 0, got {self.loss_lr}")
        if self.label_noise:
            mode, _, rate = self.label_noise.partition(":")
            try:
                ok = mode in {"symmetric", "asymmetric"} and 0 <= float(rate) < 1
            except ValueError:
                ok = False
            if not ok:
                errors.append(f"--label-noise must look like symmetric:0.3 or asymmetric:0.2, got {self.label_noise!r}")
        errors += self._robust_errors()
        errors += self._memory_errors()
        if errors:
            raise ValueError("; ".join(errors))

    def _robust_errors(self) -> list[str]:
        """What is wrong with the robust fine-tuning and extra-evaluation options."""
        errors = []
        if isinstance(self.lp_epochs, bool) or not isinstance(self.lp_epochs, int):
            errors.append(f"--lp-epochs must be a whole number of epochs, got {self.lp_epochs!r}")
        elif not 0 <= self.lp_epochs < self.epochs:
            errors.append(f"--lp-epochs must be >= 0 and below --epochs ({self.epochs}) so that fine-tuning follows, "
                          f"got {self.lp_epochs}")
        for name in ("l2sp", "distill", "aux_ce"):
            if not getattr(self, name) >= 0:
                errors.append(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.layer_decay <= 1:
            errors.append(f"--layer-decay must be in (0, 1] (1 = off), got {self.layer_decay}")
        if not 0 <= self.ema < 1:
            errors.append(f"--ema must be in [0, 1) (0 = off; e.g. 0.999), got {self.ema}")
        if not 0 <= self.val_fraction < 0.5:
            errors.append(f"--val-fraction must be in [0, 0.5), got {self.val_fraction}")
        if self.eval_extra_limit is not None and self.eval_extra_limit < 8:
            errors.append(f"--eval-extra-limit must be >= 8 images, got {self.eval_extra_limit}")
        if not 0 <= self.wise_tolerance <= 1:
            errors.append(f"--wise-tolerance must be in [0, 1] (Recall@1 it may lose), got {self.wise_tolerance}")
        if isinstance(self.eval_extra, str):  # a TOML/JSON string where a list was meant
            self.eval_extra = [self.eval_extra]
        if any(not str(spec).strip() for spec in self.eval_extra):
            errors.append("--eval-extra needs a data set name or an image folder, got an empty value")
        if self.val_fraction > 0 and self.wise_alpha is None:
            errors.append("--val-fraction holds train classes out for WiSE-FT's validation only; give --wise-alpha "
                          "too, or leave --val-fraction out (the classes would be lost to training for nothing)")
        if isinstance(self.wise_alpha, bool):
            errors.append(f"--wise-alpha must be a number in [0, 1] or auto, got {self.wise_alpha!r}")
        elif self.wise_alpha is not None and self.wise_alpha != "auto":
            try:
                self.wise_alpha = float(self.wise_alpha)
                ok = 0 <= self.wise_alpha <= 1
            except (TypeError, ValueError):
                ok = False
            if not ok:
                errors.append(f"--wise-alpha must be a number in [0, 1] or auto, got {self.wise_alpha!r}")
        if self.wise_alpha == "auto" and not (self.val_fraction > 0 or self.eval_extra):
            errors.append("--wise-alpha auto chooses on validation data: give --val-fraction (e.g. 0.1) and/or "
                          "--eval-extra, or a number")
        fine_tuning = [f"--{name.replace('_', '-')}" for name, on in (
            ("lp_epochs", self.lp_epochs), ("l2sp", self.l2sp), ("distill", self.distill),
            ("layer_decay", self.layer_decay != 1), ("wise_alpha", self.wise_alpha is not None)) if on]
        if self.freeze_backbone and fine_tuning:
            errors.append(f"{', '.join(fine_tuning)} act(s) on the backbone while it fine-tunes; leave out "
                          "--freeze-backbone")
        return errors

    def _memory_errors(self) -> list[str]:
        """What is wrong with --memory and --chunks."""
        errors = []
        if self.memory not in (None, "none", "xbm"):
            errors.append(f"--memory must be xbm (cross-batch memory) or none, got {self.memory!r}")
        if self.memory_size < 1:
            errors.append(f"--memory-size must be >= 1 embeddings, got {self.memory_size}")
        if self.memory_warmup is not None and self.memory_warmup < 0:
            errors.append(f"--memory-warmup must be >= 0 optimizer steps, got {self.memory_warmup}")
        if self.memory == "xbm" and self.negatives not in (None, "none", "batch"):
            errors.append(f"--memory xbm with --negatives {self.negatives}: the hard-negative methods solve a problem "
                          "per pair of positive pairs, so a memory of thousands of rows makes millions of them; use "
                          "the memory with the plain pair losses")
        if self.memory == "xbm" and not self.gather:
            errors.append("--memory xbm needs --gather (the default): the memory takes the global batch, so that "
                          "every process holds the same queue")
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
            errors.append(f"--chunks must be a whole number >= 1, got {self.chunks!r}")
        elif self.chunks > 1:
            if self.aux_ce or self.distill:
                errors.append("--chunks re-runs the model chunk by chunk with the gradient of the embeddings only; "
                              "the per-sample terms --aux-ce and --distill are not covered: leave them out")
            if not (self.freeze_bn or self.freeze_backbone):
                errors.append("--chunks with --no-freeze-bn: BatchNorm in training mode normalises each chunk by its "
                              "own statistics, so the step would not be the whole batch's; keep --freeze-bn")
        return errors

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_sources(cls, file: str | Path | None = None, **overrides: Any) -> TrainConfig:
        """Defaults < TOML/JSON file < explicit overrides (command-line options)."""
        values: dict[str, Any] = {}
        if file is not None:
            values.update(load_config_file(file))
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - cls.field_names()
        if unknown:
            raise ValueError(f"unknown training option(s) {sorted(unknown)}; known: {sorted(cls.field_names())}")
        return cls(**values)


def load_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    # `[loss]` table in TOML: name + hyperparameters.
    loss = data.pop("loss", None)
    if isinstance(loss, dict):
        loss = dict(loss)
        if "name" in loss:
            data["loss"] = loss.pop("name")
        data.setdefault("loss_kwargs", {}).update(loss)
    elif loss is not None:
        data["loss"] = loss
    return {k.replace("-", "_"): v for k, v in data.items()}
