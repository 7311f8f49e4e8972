"""The training loop behind ``retrieval train``: set-up, epochs of optimizer steps (AMP, gradient clipping, skipped
non-finite steps), then the report. Checkpoints and logs are ``checkpointing.py``'s, evaluation ``evaluating.py``'s,
the data ``data.py``'s."""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from retrieval import losses
from retrieval.data import BadImageLog, ClassBalancedBatchSampler, DistributedClassBalancedBatchSampler
from retrieval.data.colour import parse_background
from retrieval.distributed import GlobalBatchObjective
from retrieval.errors import parameters_named
from retrieval.heap import kept_heap
from retrieval.inference import default_workers
from retrieval.loss_reads import deferred_checks, known_on_host, read_checks, read_numbers, stat_tensors, to_device
from retrieval.models import LAST_CHECKPOINT, Embedder, create_embedder
from retrieval.progress import progress_bar
from retrieval.train.checkpointing import VALIDATION, Checkpointer, resuming
from retrieval.train.config import TrainConfig
from retrieval.train.data import load_train_data
from retrieval.train.distributed import DataParallelStep, DistContext, ensure_run_folder, gpu_options, init_distributed
from retrieval.train.evaluating import Evaluator, no_validation_sentence
from retrieval.train.features import Embedding, FeatureSource, feature_source_class
from retrieval.train.optimizers import OPTIMIZERS, schedule_factor
from retrieval.train.robust import RobustFineTuning, backbone_param_groups
from retrieval.train.state import (
    INPUT_BOUND_SHARE,
    READ_BACK_SECONDS,
    EpochProgress,
    RunRecord,
    StepValues,
    TrainData,
    TrainParts,
    WaitTimer,
)
from retrieval.train.tracking import Tracking, mlflow_uri_from

BAD_IMAGE_FIX = "fix or remove the file, or pass --on-bad-image skip to train without it"


def epoch_line(row: dict[str, Any]) -> str:
    """An epoch's row for people: its loss, the evaluation's headline metrics, its speed and its wait for batches."""
    parts = [f"loss {row['loss']:.4f}"]
    parts += [f"validation {key} {row[VALIDATION][key]:.4f}" for key in ("recall@1", "map@r")
              if key in row.get(VALIDATION, {})]
    parts += [f"test {key} {row[key]:.4f}" for key in ("recall@1", "map@r") if key in row]
    parts.append(f"{row['images_per_s']:,.0f} images/s")
    parts.append(f"{row['data_wait_s'] / max(row['epoch_time_s'], 1e-9):.0%} of the time waiting for batches")
    return f"epoch {row['epoch']}: " + ", ".join(parts)


def split_line(split: dict[str, Any], recorded: Path) -> str:
    """The run's class split for people: classes and images per split, and the file that lists them."""
    named = {"train": "train", "validation": "validation (held out of train)", "test": "test", "gallery": "gallery"}
    parts = [f"{label} {split[part]['classes']:,} classes, {split[part]['images']:,} images"
             for part, label in named.items() if part in split]
    shared = split.get("shared_train_test_classes", 0)
    overlap = f"{shared:,} classes in both train and test" if shared else "no class in both train and test"
    return f"data: {'; '.join(parts)} ({overlap}); the split is recorded in {recorded} (class_split)"


class TrainingDiverged(RuntimeError):
    """Raised after ``max_bad_steps`` consecutive non-finite losses."""


def warn_line(message: str) -> None:
    """One warning line on stderr, above any progress bar."""
    tqdm.write(f"warning: {message}", file=sys.stderr)


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def with_memory(cfg: TrainConfig, loss_fn: nn.Module, steps_per_epoch: int) -> nn.Module:
    """--memory xbm: the loss with a cross-batch memory (warm-up: --memory-warmup steps, else one epoch)."""
    from retrieval.losses.memory import CrossBatchMemory

    if losses.needs_classes(cfg.loss):
        raise ValueError(f"--memory xbm with --loss {cfg.loss}: a proxy loss compares each sample with the class "
                         "proxies, not with other samples, so a memory of past samples changes nothing; leave it out")
    warmup = steps_per_epoch if cfg.memory_warmup is None else cfg.memory_warmup
    with parameters_named(size="memory_size", warmup="memory_warmup"):
        return CrossBatchMemory(loss_fn, cfg.memory_size, cfg.embedding_dim, warmup)


def loss_lr(cfg: TrainConfig, loss_fn: nn.Module) -> float:
    """The learning rate of the loss's own parameters (proxies): --loss-lr, else its paper's, else --lr."""
    if cfg.loss_lr is not None:
        return cfg.loss_lr
    return getattr(loss_fn, "proxy_lr", None) or cfg.lr


def build_optimizer(cfg: TrainConfig, model: Embedder, loss_fn: nn.Module,
                    extra: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Groups: the head (with the projection into an old space, if any, and ``extra``, the auxiliary head) at --lr,
    the loss's proxies, the backbone's layers."""
    projection = list(model.compatible.parameters()) if model.compatible is not None else []
    groups = [{"params": list(model.head.parameters()) + projection + extra, "lr": cfg.lr, "name": "head"}]
    if proxies := list(loss_fn.parameters()):
        groups.append({"params": proxies, "lr": loss_lr(cfg, loss_fn), "name": "loss"})
    groups += backbone_param_groups(cfg, model)
    return OPTIMIZERS.build(cfg.optimizer, param_groups=groups, weight_decay=cfg.weight_decay)


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer,
                    steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate per optimizer step: --warmup-epochs of linear warmup, then the --schedule."""
    factor = schedule_factor(cfg.schedule, cfg.warmup_epochs * steps_per_epoch, cfg.epochs * steps_per_epoch)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_model(cfg: TrainConfig) -> tuple[Embedder, int]:
    """The embedder as configured (--image-size, --background, --resize) and its backbone's own input size."""
    model = create_embedder(
        cfg.backbone, cfg.embedding_dim, pretrained=cfg.pretrained, normalize=cfg.use_normalize,
        freeze_bn=cfg.freeze_bn, weights=cfg.weights,
    )
    native_size = model.config["input_size"]
    if cfg.image_size:
        model.config["input_size"] = int(cfg.image_size)
    model.config["background"] = list(parse_background(cfg.background))
    model.config["resize"] = cfg.resize
    return model, native_size


def build_parts(cfg: TrainConfig, *, ctx: DistContext, model: Embedder, data: TrainData, robust: RobustFineTuning,
                source: type[FeatureSource], embedding: Embedding, amp_dtype: torch.dtype | None,
                old_model: nn.Module | None = None) -> TrainParts:
    """What trains, around the model on the device: sampler, loss, optimizer and schedule, features, the step;
    ``old_model``: --compatible-with's (``compatible_old_model``), which the influence term compares with."""
    sampling = dict(drop_small=cfg.drop_small, seed=cfg.seed, batches_per_epoch=cfg.batches_per_epoch)
    if ctx.distributed:  # each rank takes its part of the same global batches
        sampling.update(rank=ctx.rank, world_size=ctx.world_size)
    sampler_cls = DistributedClassBalancedBatchSampler if ctx.distributed else ClassBalancedBatchSampler
    with parameters_named(samples_per_class="per_class", classes_per_batch="`batch_size` / `per_class`"):
        sampler = sampler_cls(data.train_labels, cfg.classes_per_batch, cfg.per_class, **sampling)

    loss_fn = losses.build(cfg.loss, negatives=cfg.negatives, num_classes=data.num_classes,
                           embedding_dim=cfg.embedding_dim, **cfg.loss_kwargs).to(ctx.device)
    if cfg.compile:  # the solvers bound by kernel launches on a GPU: LoOp's pair problems, DCDL's Sinkhorn
        for part in (loss_fn, getattr(loss_fn, "method", None)):
            if hasattr(part, "compile_solver"):
                part.compile_solver()
    step_loss = loss_fn  # its parameters train inside the step (DDP keeps them equal); the memory stays outside
    if cfg.memory == "xbm":
        loss_fn = with_memory(cfg, loss_fn, len(sampler)).to(ctx.device)
    extra = []
    aux = None
    if cfg.aux_ce > 0:
        from retrieval.losses.auxiliary import AuxiliaryCrossEntropy

        with parameters_named(weight="aux_ce"):
            aux = AuxiliaryCrossEntropy(cfg.embedding_dim, data.num_classes, weight=cfg.aux_ce).to(ctx.device)
        extra += list(aux.parameters())
    optimizer = build_optimizer(cfg, model, step_loss, extra)
    scheduler = build_scheduler(cfg, optimizer, len(sampler))
    influence = compatible_influence(cfg, ctx.device) if old_model is not None else None
    # a projection into the old space: its output rides behind the embedding's columns (TrainStep)
    objective = GlobalBatchObjective(loss_fn, gather=cfg.gather, influence=influence,
                                     projected_dim=int(model.config.get("compatible_dim") or 0),
                                     host_group=ctx.host_group)
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)  # bf16 needs none

    features = source.build(cfg, model, data.train_set, data.train_labels, data.eval_sets, embedding, data.val_set)
    # what a step runs: through DDP when there are several processes
    step = DataParallelStep(model, features.forward, aux, step_loss, ctx, sync_bn=cfg.sync_bn,
                            channels_last=cfg.channels_last, compile_step=cfg.compile, teacher=robust.teacher,
                            distill=cfg.distill, phases=cfg.lp_epochs > 0)
    return TrainParts(model=model, loss_fn=loss_fn, aux=aux, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                      objective=objective, sampler=sampler, features=features, step=step, robust=robust,
                      old_model=old_model)


def compatible_old_model(cfg: TrainConfig, model: Embedder, device: torch.device,
                         announce: bool = True) -> nn.Module | None:
    """--compatible-with: the frozen old model. Where it embeds in another size than this run, the model gets a
    projection into the old space, trained with it (made before the EMA and the fine-tuning start copy the
    model, so that they hold it too). The model records the hashes it will be declared compatible with (its
    export writes them into the ONNX metadata)."""
    if not cfg.compatible_with:
        return None
    from retrieval.train.compatible import OldModel

    # rebuilding the old model draws initial weights it then replaces: the run's random stream stays untouched
    with parameters_named(path="compatible_with"), torch.random.fork_rng(devices=[]):
        old = OldModel(cfg.compatible_with, model.config, features=cfg.freeze_backbone, device=device)
    if old.embedding_dim != cfg.embedding_dim:
        model.add_compatible(old.embedding_dim, seed=cfg.seed)
        if announce:
            tqdm.write(f"--compatible-with: {cfg.compatible_with} embeds in {old.embedding_dim} dimensions, this run "
                       f"in {cfg.embedding_dim}: a projection {cfg.embedding_dim} -> {old.embedding_dim} into the old "
                       "space is trained with the model (the influence term compares its output with the old "
                       f"embeddings; the loss stays on the {cfg.embedding_dim}-d embedding)", file=sys.stderr)
    model.config["compatible_with"] = list(old.hashes)
    return old


def compatible_influence(cfg: TrainConfig, device: torch.device) -> nn.Module:
    """--compatible-with's influence term on the training loss, or on ``ms`` (said) where it has no query x gallery
    form."""
    from retrieval.train.compatible import build_influence

    with parameters_named(weight="compatible_weight"):
        influence, used = build_influence(cfg.loss, cfg.loss_kwargs, cfg.compatible_weight, device)
    if used != cfg.loss:
        warn_line(f"--compatible-with: --loss {cfg.loss} has no query x gallery form, so the influence term uses "
                  f"{used}")
    return influence


class Trainer:
    """Holds the state of one run; ``run()`` trains, evaluates, checkpoints and writes the report."""

    # built by setup()
    data: TrainData
    parts: TrainParts
    record: RunRecord
    checkpoints: Checkpointer
    evaluation: Evaluator

    def __init__(self, cfg: TrainConfig, progress: bool = True) -> None:
        ensure_run_folder(cfg)
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.last_path = self.out / LAST_CHECKPOINT
        self.ctx = init_distributed(cfg.device, cfg.dist_timeout)  # one process: rank 0 of 1
        self.progress = progress and self.ctx.is_main
        self.amp_dtype = gpu_options(cfg.amp, cfg.channels_last, cfg.compile, self.device)
        self.workers = default_workers() if cfg.workers is None else cfg.workers
        self.bad_images = BadImageLog(cfg.on_bad_image, fix=BAD_IMAGE_FIX, warn=warn_line)
        self.resume_progress: EpochProgress | None = None  # the epoch a mid-epoch checkpoint stopped in
        self.tracking = Tracking([])  # TensorBoard / MLflow, opened by setup() on rank 0

    @property
    def device(self) -> torch.device:
        """The device this process trains on."""
        return self.ctx.device

    @property
    def main(self) -> bool:
        """Whether this is rank 0, which alone writes the run folder."""
        return self.ctx.is_main

    @property
    def amp(self) -> bool:
        """Whether the steps run under autocast (--amp)."""
        return self.amp_dtype is not None

    # --- set-up -----------------------------------------------------------------------------------
    def setup(self) -> None:
        """Build the model, data, optimizer and sampler (``data``, ``parts``, ``record``); resume if asked."""
        cfg = self.cfg
        resume = resuming(cfg, self.out)
        self.out.mkdir(parents=True, exist_ok=True)
        seed_everything(cfg.seed)

        model, native_size = build_model(cfg)
        source = feature_source_class(cfg)
        source.prepare_model(model)
        model.to(self.device)
        old_model = compatible_old_model(cfg, model, self.device, announce=self.main)
        robust = RobustFineTuning.build(cfg, model).to(self.device)
        train_transform = source.train_transform(model.config, cfg.augmentation(), self.device)
        self.data = data = load_train_data(cfg, model.config, train_transform)
        embedding = Embedding(self.device, cfg.eval_batch_size, self.workers, self.amp, self.progress, self.bad_images)
        self.parts = build_parts(cfg, ctx=self.ctx, model=model, data=data, robust=robust, source=source,
                                 embedding=embedding, amp_dtype=self.amp_dtype, old_model=old_model)
        self.checkpoints = Checkpointer(cfg, self.out, self.main, self.parts, data, self.bad_images)
        self.evaluation = Evaluator(cfg, self.ctx, self.out, self.parts, data, embedding, self.progress, native_size)
        class_split = self.evaluation.class_split() if self.main else None
        if self.progress:  # which classes train and which are held out, before any work on them
            tqdm.write(split_line(class_split, self.out / "config.json"), file=sys.stderr)

        self.record = RunRecord()
        if data.extra_sets:  # before a resume loads fine-tuned weights: the reference is the pretrained backbone
            reference = self.evaluation.reference_metrics()
            if not resume:  # resuming: the checkpoint has it
                self.record.reference = reference
        if resume:
            self.record, self.resume_progress = self.checkpoints.resume(self.device)
        if self.main:
            self.tracking = Tracking.open(self.out, self.run_config(), cfg.tensorboard,
                                          mlflow_uri_from(cfg.mlflow_uri, cfg.mlflow, self.out),
                                          resume_step=self.parts.scheduler.last_epoch + 1 if resume else None)
            (self.out / "config.json").write_text(json.dumps({**self.run_config(), "class_split": class_split},
                                                             indent=2))

    def run_config(self) -> dict[str, Any]:
        """config.json: the training options, the model, the data and where the run ran."""
        return {
            "train": self.cfg.to_dict(),
            "model": self.parts.model.config,
            "label_noise": self.data.noise_info,
            "train_size": len(self.data.train_labels),
            "num_train_classes": self.data.num_classes,
            "steps_per_epoch": self.parts.steps_per_epoch,
            "device": str(self.device),
            "world_size": self.ctx.world_size,
            "amp": self.amp,
            "torch": torch.__version__,
            "tracking": self.tracking.where(),
        }

    def checkpoint(self, epoch: int, metrics: dict[str, Any], progress: EpochProgress | None = None) -> dict[str, Any]:
        """The on-disk checkpoint of the run as it stands: ``epoch`` epochs complete, ``progress`` the one under way."""
        return self.checkpoints.checkpoint(self.record, epoch, metrics, progress)

    def evaluate(self, final: bool = False) -> dict[str, Any]:
        """Metrics of the evaluation split (and the extra sets); the linear probe before and after training only."""
        return self.evaluation.evaluate(probe=final or not self.record.history)

    def validate(self) -> dict[str, Any]:
        """{"validation": metrics} of the validation split, which best.pt is chosen on; {} without one."""
        return {VALIDATION: self.evaluation.validate()} if self.data.val_set is not None else {}

    # --- the run -----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Set up, train every epoch (evaluating and checkpointing), then write the report; returns it."""
        try:
            return self._run()
        except BaseException as exc:
            self.tracking.fail("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
            raise
        finally:
            parts = getattr(self, "parts", None)  # set up, or the run failed before
            if parts is not None:  # the data workers stop with the run, however it ends
                parts.features.close()

    def _track_epoch(self, row: dict[str, Any]) -> None:
        optimizer = self.parts.optimizer
        self.tracking.epoch(row, self.parts.scheduler.last_epoch,
                            {group.get("name", str(i)): group["lr"] for i, group in enumerate(optimizer.param_groups)})

    def _set_up(self) -> None:
        """``setup()``; a folder it made for a run that then fails before training is removed again (with what it
        had written: nothing a later run needs), so a mistyped option leaves no empty run behind."""
        made = not self.out.exists()
        try:
            self.setup()
        except BaseException:
            if made and self.main:
                shutil.rmtree(self.out, ignore_errors=True)
            raise

    def _run(self) -> dict[str, Any]:
        self._set_up()
        cfg, record = self.cfg, self.record
        if self.main and self.data.no_validation is not None:  # before any work: the run's "best" will be optimistic
            warn_line(no_validation_sentence(self.data.no_validation))
        if record.baseline is None and cfg.eval_before:
            record.baseline = self.evaluate()
            record.history.append({"epoch": 0, **record.baseline, **self.validate()})
            self._track_epoch(record.history[-1])
            self.checkpoints.rewrite_metrics_log(record.history)
        hinted = False  # the input-bound advice is given once a run
        for epoch in range(record.start_epoch, cfg.epochs):
            progress, self.resume_progress = self.resume_progress, None  # a mid-epoch resume's epoch comes first
            row: dict[str, Any] = {"epoch": epoch + 1, **self.train_epoch(epoch, progress)}
            if epoch + 1 == cfg.epochs:  # the train workers are done: the final evaluation starts its own
                self.parts.features.close()
            evaluated = (epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs
            if evaluated:
                row.update(self.validate())
            # the test split: every evaluation where best.pt is chosen on it, else once, after the last epoch
            if evaluated and (self.data.val_set is None or epoch + 1 == cfg.epochs):
                row.update(self.evaluate(final=epoch + 1 == cfg.epochs))
            record.history.append(row)
            self._track_epoch(row)
            self.checkpoints.append_metrics(row)
            self.checkpoints.save_epoch_end(record, epoch, row, evaluated)
            if self.progress:
                tqdm.write(epoch_line(row))
                hinted = hinted or self._hint_input_bound(row)
        return self.finish()

    def _hint_input_bound(self, row: dict[str, Any]) -> bool:
        """Say once what speeds up an epoch that waited for its batches (``INPUT_BOUND_SHARE`` of its time or
        more); returns whether it was said."""
        share = row["data_wait_s"] / max(row["epoch_time_s"], 1e-9)
        if share < INPUT_BOUND_SHARE or row["data_wait_s"] < 1.0:  # not a second's start-up of a short epoch
            return False
        remedies = [f"more --workers (now {self.workers})"]
        if self.cfg.decode_on == "workers" and self.device.type == "cuda":
            remedies.append("decoding on the GPU (--decode-on device)")
        if not self.cfg.freeze_backbone:
            remedies.append("image files stored near the training size (a large photo costs most of its decoding)")
        tqdm.write(f"epoch {row['epoch']} waited for its batches {share:.0%} of its time "
                   f"({row['data_wait_s']:.1f} s of {row['epoch_time_s']:.1f} s): the input limits training speed, "
                   f"not the model; try {', '.join(remedies)}")
        return True

    def finish(self) -> dict[str, Any]:
        """After the last epoch: WiSE-FT if asked, then (rank 0) the report; returns it ({} on other ranks)."""
        evaluation, history = self.evaluation, self.record.history
        if evaluation.last_eval is None:  # e.g. resuming a run that had already finished
            evaluation.last_eval = evaluation.embed_eval()
        wise = None
        if self.cfg.wise_alpha is not None:
            wise = evaluation.wise_ft(history[-1]["epoch"] if history else 0)
        best_test = evaluation.best_test_metrics(history)  # on every rank: embedding the test split is collective
        if not self.main:
            return {}
        report = evaluation.write_report(self.run_config(), self.record, wise, self.bad_images.records(), best_test)
        self.tracking.finish(self.out, report.get("plots", {}), self.parts.scheduler.last_epoch)
        return report

    # --- training ----------------------------------------------------------------------------------
    def train_epoch(self, epoch: int, progress: EpochProgress | None = None) -> dict[str, float]:
        """Train one epoch (from where ``progress`` stopped, if given); returns its metrics row."""
        parts, cfg = self.parts, self.cfg
        state = progress or EpochProgress(epoch)
        head_only = epoch < cfg.lp_epochs  # LP-FT: the head learns on the pretrained features first
        if cfg.lp_epochs and epoch == cfg.lp_epochs and state.batch == 0:
            parts.robust.restart_from(parts.model)  # fine-tuning starts from the trained head
        parts.step.fix_backbone(head_only)
        parts.features.train_mode(parts.model)
        if head_only:
            parts.model.backbone.eval()
        start = time.perf_counter() - state.elapsed
        batches = WaitTimer(parts.features.batches(parts.sampler, epoch, state.batch), state.data_wait)
        bar = progress_bar(batches, total=parts.steps_per_epoch, initial=state.batch,
                           desc=f"epoch {epoch + 1}/{self.cfg.epochs}", disable=not self.progress, leave=False)
        pending: list[StepValues] = []  # the steps taken whose loss is not yet read back from the device
        read_at = state.elapsed
        try:
            for inputs, labels, unreadable in bar:
                state.batch += 1
                step = self._train_step(state, inputs, labels, unreadable, head_only)
                if step is None:
                    continue
                pending.append(step)
                state.elapsed, state.data_wait = time.perf_counter() - start, batches.waited
                checkpoint_due = self.checkpoints.mid_epoch_due()
                if checkpoint_due or state.elapsed - read_at >= READ_BACK_SECONDS:
                    self._read_back(state, pending)
                    read_at = state.elapsed
                    bar.set_postfix(loss=f"{state.totals['loss'] / state.steps:.4f}",
                                    img_s=f"{state.seen / max(state.elapsed, 1e-9):.0f}",
                                    data=f"{state.data_wait / max(state.elapsed, 1e-9):.0%}")
                if checkpoint_due:
                    self.checkpoints.save_mid_epoch(self.record, epoch, state)
            self._read_back(state, pending)
        except BaseException:
            with contextlib.suppress(Exception):  # the losses of the steps taken before the error are logged
                self._read_back(state, pending)
            raise
        self.bad_images.restore(parts.step.all_records(self.bad_images.records()))  # the report lists every rank's
        if state.seen == 0 and state.skipped_images:
            raise ValueError(
                f"no training image of epoch {epoch + 1} could be read ({state.skipped_images} failed; the warnings "
                "above name them): check the data folder"
            )
        state.data_wait = batches.waited
        return self._epoch_row(state, time.perf_counter() - start)

    def _train_step(self, state: EpochProgress, inputs: torch.Tensor, labels: torch.Tensor, unreadable: int,
                    head_only: bool) -> StepValues | None:
        """One batch: the forward pass, the loss and (when it is finite) the optimizer step; returns the step's
        values, still on the device, or None when the step was skipped."""
        parts, cfg = self.parts, self.cfg
        # counts of the global batch (summed over the ranks)
        usable, images, unreadable = parts.step.batch_counts(labels, unreadable, cfg.gather)
        state.skipped_images += unreadable
        if not usable:  # (almost) every image of the batch failed to load
            state.skipped_steps += 1
            return None
        inputs = inputs.to(self.device, non_blocking=True)
        host_labels, labels = labels, to_device(labels, self.device)  # from pinned memory: no wait
        replay = None  # --chunks: re-runs the chunks with their part of the gradient after the backward
        # the loss's batch checks are read with the finiteness check below; a hard-negative method pairs the batch
        # from the host labels instead of copying the device's back
        with deferred_checks() as checks, known_on_host(labels, host_labels):
            if cfg.chunks > 1:
                embeddings, replay = parts.step.chunked(inputs, labels, self.amp_dtype, cfg.chunks)
                local_terms = {}
            else:  # float32 embeddings: losses run in float32
                embeddings, local_terms = parts.step(inputs, labels, self.amp_dtype)
            # the global batch's loss (gathered over the ranks) plus the per-sample terms (auxiliary head,
            # distillation)
            old = None if parts.old_model is None else parts.old_model(inputs)  # --compatible-with
            objective = parts.objective(embeddings, labels, local_terms, old=old)
        loss, backward = objective.total, objective.backward
        penalty = None if head_only else parts.robust.penalty_term()  # the same on every rank
        terms = {name: value.detach() for name, value in objective.local_terms.items()}
        if penalty is not None:
            loss, backward = loss + penalty.detach(), backward + penalty
            terms["l2sp"] = penalty.detach()
        # the trainer's one read-back a step: the loss's batch checks, and whether the loss is finite (a skipped step
        # must not reach the weights; the same on every rank)
        (finite,), failed = read_checks(checks, torch.isfinite(loss))
        if failed is not None:
            raise failed
        if not finite:
            self._skip_non_finite(state)
            return None
        state.bad_in_row = 0
        self._optimizer_step(backward, replay)
        parts.robust.after_step(parts.model)
        state.steps += 1
        state.seen += images
        stats = dict(getattr(parts.loss_fn, "last_stats", None) or {})  # read back with the loss
        return StepValues(parts.scheduler.last_epoch, state.epoch + state.batch / parts.steps_per_epoch,
                          loss.detach(), terms, stats)

    def _read_back(self, state: EpochProgress, pending: list[StepValues]) -> None:
        """The losses (and the loss's statistics) of the ``pending`` steps, copied from the device in one transfer:
        added to the epoch's sums and logged (steps.jsonl, the report's per-step curve, and the trackers on rank 0);
        ``pending`` is emptied.

        Reading a step's loss waits for the device to finish it; read every step, the next batch could not be
        prepared while the device still works on this one."""
        if not pending:
            return
        values = [step.loss for step in pending] + [value for step in pending for value in step.terms.values()]
        values += [value for step in pending for value in stat_tensors(step.stats)]
        numbers = read_numbers(values)
        read = iter(numbers[len(pending):])
        step_terms = [[(name, next(read)) for name in step.terms] for step in pending]
        step_stats = [[(name, next(read) if isinstance(value, torch.Tensor) else float(value))
                       for name, value in step.stats.items()] for step in pending]
        for loss, named, stats in zip(numbers[:len(pending)], step_terms, step_stats, strict=True):
            step = pending[0]
            self.tracking.step(step.step, loss)
            self.checkpoints.log_step(step.step, step.epoch, loss)
            for name, value in named:
                state.add(name, value)
            for name, value in stats:
                state.stats.setdefault(name, []).append(value)
            state.add("loss", loss)
            pending.pop(0)  # logged and counted: a failure after this step does not take it again

    def _optimizer_step(self, backward: torch.Tensor, replay=None) -> None:
        """One optimizer step on ``backward``'s gradients (and ``replay()``'s, the chunks of --chunks): loss scaling,
        --grad-clip, then the schedule."""
        optimizer, scaler = self.parts.optimizer, self.parts.scaler
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(backward).backward()
        if replay is not None:
            replay()
        if self.cfg.grad_clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], self.cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        self.parts.scheduler.step()

    def _skip_non_finite(self, state: EpochProgress) -> None:
        """A NaN/inf loss: skip the step, and stop the run after --max-bad-steps of them in a row."""
        state.skipped_steps += 1
        state.bad_in_row += 1
        self.parts.optimizer.zero_grad(set_to_none=True)
        if state.bad_in_row >= self.cfg.max_bad_steps:
            raise TrainingDiverged(
                f"loss was NaN/inf for {state.bad_in_row} steps in a row (epoch {state.epoch + 1}); lower --lr "
                f"(now {self.cfg.lr}) or check the loss hyperparameters; last good checkpoint: "
                f"{self.last_path}"
            )

    def _epoch_row(self, state: EpochProgress, elapsed: float) -> dict[str, float]:
        """The epoch's metrics row: mean loss (and loss statistics), step and image counts, speed, learning rate."""
        steps = state.steps
        row = {
            "loss": state.totals.get("loss", 0.0) / max(steps, 1),
            "steps": steps,
            "skipped_steps": state.skipped_steps,
            "skipped_images": state.skipped_images,
            "images_per_s": state.seen / max(elapsed, 1e-9),
            "epoch_time_s": elapsed,
            "data_wait_s": state.data_wait,
            "lr": self.parts.optimizer.param_groups[0]["lr"],
        }
        # the per-sample and penalty terms (aux_ce, distill, l2sp), each a mean over the epoch's steps
        row.update({key: total / max(steps, 1) for key, total in state.totals.items() if key != "loss"})
        row.update({f"loss_{k}": float(np.mean(v)) for k, v in state.stats.items()})
        if self.device.type == "cuda":
            row["cuda_max_memory_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        return row


def train(cfg: TrainConfig, progress: bool = True) -> dict[str, Any]:
    """Train one run as configured; returns the report (also written to RUN_DIR/report.json; {} on ranks > 0).

    Under torchrun (WORLD_SIZE > 1) it joins the process group, and leaves it at the end if it joined it."""
    joined = torch.distributed.is_initialized()
    try:
        with kept_heap():  # every step frees and allocates the same large tensors again
            return Trainer(cfg, progress=progress).run()
    finally:
        if not joined and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
