"""The training loop behind ``retrieval train``."""

from __future__ import annotations

import copy
import json
import math
import random
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from retrieval import losses
from retrieval.data import (
    BadImageLog,
    ClassBalancedBatchSampler,
    DistributedClassBalancedBatchSampler,
    asymmetric_transitions,
    build_transforms,
    inject_label_noise,
    load_dataset,
)
from retrieval.data.colour import parse_background
from retrieval.distributed import GlobalBatchObjective, embed_sharded
from retrieval.evaluation import (
    eval_set_pictures,
    evaluate_embeddings,
    leave_one_out_metrics,
    load_eval_sets,
    load_extra_set,
    present_class_names,
)
from retrieval.inference import default_workers
from retrieval.io import atomic_write
from retrieval.models import (
    BEST_CHECKPOINT,
    LAST_CHECKPOINT,
    WISE_CHECKPOINT,
    Checkpoint,
    Embedder,
    config_hash,
    create_embedder,
    load_checkpoint,
)
from retrieval.reports import STEPS_LOG
from retrieval.train.config import TrainConfig, new_run_folder
from retrieval.train.distributed import DataParallelStep, env_world_size, gpu_options, init_distributed, restarted
from retrieval.train.features import Embedding, EvalEmbeddings, FeatureSource, cached_features, feature_source_class
from retrieval.train.report import write_report
from retrieval.train.robust import WISE_ALPHAS, RobustFineTuning, backbone_param_groups, choose_alpha, snapshot
from retrieval.train.state import (
    EpochProgress,
    RunRecord,
    TrainData,
    TrainParts,
    restore_rng_states,
    rng_states,
)
from retrieval.train.tracking import Tracking, mlflow_uri_from

BAD_IMAGE_FIX = "fix or remove the file, or pass --on-bad-image skip to train without it"
BEST_METRIC = "recall@1"  # the evaluation metric whose highest value makes best.pt
MAX_LISTED_CLASSES = 1000  # the report lists the class names of a split up to this many


class TrainingDiverged(RuntimeError):
    """Raised after ``max_bad_steps`` consecutive non-finite losses."""


def warn_line(message: str) -> None:
    """One warning line on stderr, above any progress bar."""
    tqdm.write(f"warning: {message}", file=sys.stderr)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def atomic_save(obj: Any, path: Path) -> None:
    """Save a checkpoint whole or not at all: a crash never leaves half a checkpoint."""
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def with_memory(cfg: TrainConfig, loss_fn: nn.Module, steps_per_epoch: int) -> nn.Module:
    """--memory xbm: the loss with a cross-batch memory (warm-up: --memory-warmup steps, else one epoch)."""
    from retrieval.losses.memory import CrossBatchMemory

    if losses.needs_classes(cfg.loss):
        raise ValueError(f"--memory xbm with --loss {cfg.loss}: a proxy loss compares each sample with the class "
                         "proxies, not with other samples, so a memory of past samples changes nothing; leave it out")
    warmup = steps_per_epoch if cfg.memory_warmup is None else cfg.memory_warmup
    return CrossBatchMemory(loss_fn, cfg.memory_size, cfg.embedding_dim, warmup)


def loss_lr(cfg: TrainConfig, loss_fn: nn.Module) -> float:
    """The learning rate of the loss's own parameters (proxies): --loss-lr, else its paper's, else --lr."""
    if cfg.loss_lr is not None:
        return cfg.loss_lr
    return getattr(loss_fn, "proxy_lr", None) or cfg.lr


def build_optimizer(cfg: TrainConfig, model: Embedder, loss_fn: nn.Module,
                    extra: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Groups: the head (and ``extra``, the auxiliary head) at --lr, the loss's proxies, the backbone's layers."""
    groups = [{"params": list(model.head.parameters()) + extra, "lr": cfg.lr, "name": "head"}]
    if proxies := list(loss_fn.parameters()):
        groups.append({"params": proxies, "lr": loss_lr(cfg, loss_fn), "name": "loss"})
    groups += backbone_param_groups(cfg, model)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, momentum=0.9, weight_decay=cfg.weight_decay, nesterov=True)
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return cls(groups, weight_decay=cfg.weight_decay)


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int):
    total = cfg.epochs * steps_per_epoch
    warmup = cfg.warmup_epochs * steps_per_epoch

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "cosine":
            progress = (step - warmup) / max(1, total - warmup)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        if cfg.schedule == "step":  # x0.1 at 2/3 of training
            return 0.1 if step >= warmup + (total - warmup) * 2 // 3 else 1.0
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Trainer:
    """Holds the state of one run; ``run()`` trains, evaluates, checkpoints and writes the report."""

    # built by setup()
    data: TrainData
    parts: TrainParts
    record: RunRecord

    def __init__(self, cfg: TrainConfig, progress: bool = True) -> None:
        if cfg.out is None:  # a new folder per run (the command line resolves it before the processes start)
            if env_world_size() > 1:
                raise ValueError("several processes need the run folder given (--out): each would make its own")
            cfg.out = new_run_folder()
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.last_path = self.out / LAST_CHECKPOINT
        self.ctx = init_distributed(cfg.device, cfg.dist_timeout)  # one process: rank 0 of 1
        self.progress = progress and self.ctx.is_main
        self.amp_dtype = gpu_options(cfg.amp, cfg.channels_last, cfg.compile, self.device)
        self.workers = default_workers() if cfg.workers is None else cfg.workers
        self.bad_images = BadImageLog(cfg.on_bad_image, fix=BAD_IMAGE_FIX, warn=warn_line)
        self.resume_progress: EpochProgress | None = None  # the epoch a mid-epoch checkpoint stopped in
        self.last_eval: EvalEmbeddings | None = None  # the last evaluation's embeddings: the report's plots reuse them
        self.tracking = Tracking([])  # TensorBoard / MLflow, opened by setup() on rank 0

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def main(self) -> bool:
        """Whether this is rank 0, which alone writes the run folder."""
        return self.ctx.is_main

    @property
    def amp(self) -> bool:
        return self.amp_dtype is not None

    # --- set-up -----------------------------------------------------------------------------------
    def setup(self) -> None:
        """Build the model, data, optimizer and sampler (``data``, ``parts``, ``record``); resume if asked."""
        cfg = self.cfg
        # a worker that torchrun restarted (--max-restarts) continues from the last checkpoint
        resume = cfg.resume or (restarted() and self.last_path.exists())
        if self.last_path.exists() and not resume:
            raise FileExistsError(
                f"{self.out} already holds a run ({LAST_CHECKPOINT}); pass --resume to continue it or choose another "
                "--out"
            )
        self.out.mkdir(parents=True, exist_ok=True)
        seed_everything(cfg.seed)

        model = create_embedder(
            cfg.backbone, cfg.embedding_dim, pretrained=cfg.pretrained, normalize=cfg.use_normalize,
            freeze_bn=cfg.freeze_bn, weights=cfg.weights,
        )
        native_size = model.config["input_size"]
        if cfg.image_size:
            model.config["input_size"] = int(cfg.image_size)
        model.config["background"] = list(parse_background(cfg.background))
        source = feature_source_class(cfg)
        source.prepare_model(model)
        model.to(self.device)
        robust = RobustFineTuning.build(cfg, model).to(self.device)
        self.data = data = load_train_data(cfg, model.config, source.train_transform(model.config, cfg.augmentation()))

        sampling = dict(drop_small=cfg.drop_small, seed=cfg.seed, batches_per_epoch=cfg.batches_per_epoch)
        if self.ctx.distributed:  # each rank takes its part of the same global batches
            sampling.update(rank=self.ctx.rank, world_size=self.ctx.world_size)
        sampler_cls = DistributedClassBalancedBatchSampler if self.ctx.distributed else ClassBalancedBatchSampler
        sampler = sampler_cls(data.train_labels, cfg.classes_per_batch, cfg.per_class, **sampling)

        loss_fn = losses.build(cfg.loss, negatives=cfg.negatives, num_classes=data.num_classes,
                               embedding_dim=cfg.embedding_dim, **cfg.loss_kwargs).to(self.device)
        step_loss = loss_fn  # its parameters train inside the step (DDP keeps them equal); the memory stays outside
        if cfg.memory == "xbm":
            loss_fn = with_memory(cfg, loss_fn, len(sampler)).to(self.device)
        extra = []
        aux = None
        if cfg.aux_ce > 0:
            from retrieval.losses.auxiliary import AuxiliaryCrossEntropy

            aux = AuxiliaryCrossEntropy(cfg.embedding_dim, data.num_classes, weight=cfg.aux_ce).to(self.device)
            extra += list(aux.parameters())
        optimizer = build_optimizer(cfg, model, step_loss, extra)
        scheduler = build_scheduler(cfg, optimizer, len(sampler))
        objective = GlobalBatchObjective(loss_fn, gather=cfg.gather)
        scaler = torch.amp.GradScaler("cuda", enabled=self.amp_dtype == torch.float16)  # bf16 needs none

        self.embedding = embedding = Embedding(self.device, cfg.eval_batch_size, self.workers, self.amp, self.progress,
                                               self.bad_images)
        features: FeatureSource = source.build(cfg, model, data.train_set, data.train_labels, data.eval_sets,
                                               embedding)
        # what a step runs: through DDP when there are several processes
        step = DataParallelStep(model, features.forward, aux, step_loss, self.ctx, sync_bn=cfg.sync_bn,
                                channels_last=cfg.channels_last, compile_step=cfg.compile, teacher=robust.teacher,
                                distill=cfg.distill, phases=cfg.lp_epochs > 0)
        self.parts = TrainParts(model, loss_fn, aux, optimizer, scheduler, scaler, objective, sampler, features, step,
                                robust)

        self.record = RunRecord()
        if data.extra_sets and not resume:  # resuming: the checkpoint has it
            self.record.reference = self.reference_metrics(native_size)
        if resume:
            self._load_resume_state()
        if self.main:
            self.tracking = Tracking.open(self.out, self.run_config(), cfg.tensorboard,
                                          mlflow_uri_from(cfg.mlflow_uri, cfg.mlflow, self.out),
                                          resume_step=self.parts.scheduler.last_epoch + 1 if resume else None)
            (self.out / "config.json").write_text(json.dumps(self.run_config(), indent=2))

    def run_config(self) -> dict[str, Any]:
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

    # --- checkpoints -------------------------------------------------------------------------------
    def checkpoint(self, epoch: int, metrics: dict[str, Any], progress: EpochProgress | None = None) -> dict[str, Any]:
        """The on-disk checkpoint: model and everything a resume needs; ``epoch`` epochs are complete, ``progress``
        is the one under way."""
        parts, record = self.parts, self.record
        evaluated = parts.robust.eval_model(parts.model)
        return Checkpoint(
            model_config=parts.model.config,
            state_dict=evaluated.state_dict(),  # the model people use: the EMA when there is one
            train_config=self.cfg.to_dict(),
            config_hash=config_hash(self.cfg.to_dict()),
            epoch=epoch,
            metrics=metrics,
            class_names=list(self.data.train_set.class_names),
            optimizer=parts.optimizer.state_dict(),
            scheduler=parts.scheduler.state_dict(),
            scaler=parts.scaler.state_dict(),
            loss_state=parts.loss_fn.state_dict(),
            aux_state=parts.aux.state_dict() if parts.aux is not None else None,
            best_recall=record.best_recall,
            history=record.history,
            baseline=record.baseline,
            bad_images=self.bad_images.records(),
            steps_per_epoch=parts.steps_per_epoch,
            in_epoch=asdict(progress) if progress is not None else None,
            rng=rng_states(),
            training_weights=parts.model.state_dict() if evaluated is not parts.model else None,
            robust=parts.robust.state_dict(),
            reference=record.reference,
        ).to_dict()

    def _save(self, name: str, epoch: int, metrics: dict[str, Any], progress: EpochProgress | None = None) -> None:
        atomic_save(self.checkpoint(epoch, metrics, progress), self.out / name)

    def _load_resume_state(self) -> None:
        path = self.last_path
        if not path.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint to resume at {path}; start without --resume")
        ckpt = load_checkpoint(path, map_location=self.device)
        if not ckpt.resumable:
            raise ValueError(f"--resume: {path} holds a model only, no training state; start without --resume")
        parts = self.parts
        parts.model.load_state_dict(ckpt.training_weights or ckpt.state_dict)
        if ckpt.robust is not None:
            parts.robust.load_state_dict(ckpt.robust)
        parts.optimizer.load_state_dict(ckpt.optimizer)
        parts.scheduler.load_state_dict(ckpt.scheduler)
        parts.scaler.load_state_dict(ckpt.scaler)
        parts.loss_fn.load_state_dict(ckpt.loss_state)
        if parts.aux is not None and ckpt.aux_state:
            parts.aux.load_state_dict(ckpt.aux_state)
        self.record = RunRecord(ckpt.epoch, ckpt.best_recall, ckpt.history, ckpt.baseline, ckpt.reference)
        self.bad_images.restore(ckpt.bad_images)
        if ckpt.in_epoch:
            if ckpt.steps_per_epoch != parts.steps_per_epoch:
                raise ValueError(
                    f"--resume: {path} stopped inside an epoch of {ckpt.steps_per_epoch} batches but this "
                    f"configuration has {parts.steps_per_epoch}; resume with the run's own options (config.json)"
                )
            self.resume_progress = EpochProgress(**ckpt.in_epoch)
        restore_rng_states(ckpt.rng)
        # metrics.jsonl and steps.jsonl keep exactly the epochs and steps the checkpoint has seen
        if self.main:
            self._rewrite_metrics_log()
            self._rewrite_steps_log()

    def _log_step(self, epoch: float, loss: float) -> None:
        """One optimizer step's loss: steps.jsonl (the report's per-step curve) and the trackers (rank 0)."""
        step = self.parts.scheduler.last_epoch
        self.tracking.step(step, loss)
        if self.main:
            with (self.out / STEPS_LOG).open("a") as f:
                f.write(json.dumps({"step": step, "epoch": round(epoch, 6), "loss": loss}) + "\n")

    def _rewrite_steps_log(self) -> None:
        """A resumed run's steps.jsonl keeps the steps its checkpoint has taken (the later ones are taken again)."""
        path, done = self.out / STEPS_LOG, self.parts.scheduler.last_epoch
        if path.is_file():
            kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= done]
            atomic_write(path, "".join(line + "\n" for line in kept))

    def _rewrite_metrics_log(self) -> None:
        atomic_write(self.out / "metrics.jsonl", "".join(json.dumps(row) + "\n" for row in self.record.history))

    def _mid_epoch_checkpoint_due(self) -> bool:
        """--checkpoint-every: rank 0 saves last.pt every that many optimizer steps of the run."""
        every = self.cfg.checkpoint_every
        return bool(every) and self.main and self.parts.scheduler.last_epoch % every == 0  # counts optimizer steps

    def _save_epoch_end(self, epoch: int, row: dict[str, Any], evaluated: bool) -> None:
        """After an epoch: best.pt when its recall@1 is the best yet (every rank tracks it), then last.pt."""
        if evaluated and row[BEST_METRIC] > self.record.best_recall:
            self.record.best_recall = row[BEST_METRIC]
            if self.main:
                self._save(BEST_CHECKPOINT, epoch + 1, row)
        if self.main:
            self._save(LAST_CHECKPOINT, epoch + 1, row)

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
        bar = tqdm(parts.features.batches(parts.sampler, epoch, state.batch), total=parts.steps_per_epoch,
                   initial=state.batch, desc=f"epoch {epoch + 1}/{self.cfg.epochs}", disable=not self.progress,
                   leave=False)
        for inputs, labels, unreadable in bar:
            state.batch += 1
            # counts of the global batch (summed over the ranks)
            usable, images, unreadable = parts.step.batch_counts(labels, unreadable, self.cfg.gather)
            state.skipped_images += unreadable
            if not usable:  # (almost) every image of the batch failed to load
                state.skipped_steps += 1
                continue
            inputs = inputs.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            replay = None  # --chunks: re-runs the chunks with their part of the gradient after the backward
            if cfg.chunks > 1:
                embeddings, replay = parts.step.chunked(inputs, labels, self.amp_dtype, cfg.chunks)
                local_terms = {}
            else:  # float32 embeddings: losses run in float32
                embeddings, local_terms = parts.step(inputs, labels, self.amp_dtype)
            # the global batch's loss (gathered over the ranks) plus the per-sample terms (auxiliary head, distillation)
            objective = parts.objective(embeddings, labels, local_terms)
            loss, backward = objective.total, objective.backward
            penalty = None if head_only else parts.robust.penalty_term()  # the same on every rank
            terms = dict(objective.local_terms)
            if penalty is not None:
                loss, backward = loss + penalty.detach(), backward + penalty
                terms["l2sp"] = penalty.detach()
            if not torch.isfinite(loss):  # the same value on every rank: all skip together
                self._skip_non_finite(state)
                continue
            state.bad_in_row = 0
            for name, value in terms.items():  # the logged terms of the steps taken
                state.add(name, float(value))
            self._optimizer_step(backward, replay)
            parts.robust.after_step(parts.model)
            state.steps += 1
            state.seen += images
            state.add("loss", float(loss))
            self._log_step(epoch + state.batch / parts.steps_per_epoch, float(loss))
            for key, value in (getattr(parts.loss_fn, "last_stats", None) or {}).items():
                state.stats.setdefault(key, []).append(float(value))
            state.elapsed = time.perf_counter() - start
            bar.set_postfix(loss=f"{state.totals['loss'] / state.steps:.4f}",
                            img_s=f"{state.seen / max(state.elapsed, 1e-9):.0f}")
            if self._mid_epoch_checkpoint_due():  # the metrics of the last epoch complete
                last_row = self.record.history[-1] if self.record.history else {}
                self._save(LAST_CHECKPOINT, epoch, last_row, progress=state)
        self.bad_images.restore(parts.step.all_records(self.bad_images.records()))  # the report lists every rank's
        if state.seen == 0 and state.skipped_images:
            raise ValueError(
                f"no training image of epoch {epoch + 1} could be read ({state.skipped_images} failed; the warnings "
                "above name them): check the data folder"
            )
        return self._epoch_row(state, time.perf_counter() - start)

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
            "lr": self.parts.optimizer.param_groups[0]["lr"],
        }
        # the per-sample and penalty terms (aux_ce, distill, l2sp), each a mean over the epoch's steps
        row.update({key: total / max(steps, 1) for key, total in state.totals.items() if key != "loss"})
        row.update({f"loss_{k}": float(np.mean(v)) for k, v in state.stats.items()})
        if self.device.type == "cuda":
            row["cuda_max_memory_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        return row

    # --- evaluation --------------------------------------------------------------------------------
    def embed_eval(self):
        """(query, query_labels, gallery, gallery_labels) embeddings of the evaluation split."""
        return self.parts.features.embed_eval(self.eval_model)

    @property
    def eval_model(self) -> Embedder:
        """The weights evaluated and saved: the EMA of the weights when --ema is on, else the model itself."""
        return self.parts.robust.eval_model(self.parts.model)

    def _embed(self, model: nn.Module, dataset, desc: str) -> tuple[np.ndarray, np.ndarray]:
        """(embeddings, labels) of a data set's images that load, sharded over the ranks."""
        run = self.embedding
        result = embed_sharded(model, dataset, run.batch_size, run.device, run.workers, run.amp, desc, run.progress,
                               run.bad_images)
        return result.embeddings, result.labels

    def _recall_at_1(self, model: nn.Module, dataset, desc: str) -> dict[str, float]:
        """Leave-one-out Recall@K and MAP@R of ``model`` on one data set (computed on rank 0, shared)."""
        emb, labels = self._embed(model, dataset, desc)
        return self.ctx.from_main(leave_one_out_metrics(emb, labels) if self.main else None)

    def extra_metrics(self, model: nn.Module, part: str = "test") -> dict[str, dict[str, float]]:
        """Metrics of every --eval-extra set's ``part`` (test or val), by set name."""
        return {extra.name: self._recall_at_1(model, getattr(extra, part), f"embed {extra.name} ({part})")
                for extra in self.data.extra_sets}

    def reference_metrics(self, native_size: int) -> dict[str, Any]:
        """What a user would otherwise take: the pretrained backbone's pooled features at its own resolution, on
        each extra set's test part (features cached: every run of the same backbone shares them)."""
        with torch.random.fork_rng(devices=[]):  # loaders draw seeds: a cache hit must not change the training
            return self._reference_metrics(native_size)

    def _reference_metrics(self, native_size: int) -> dict[str, Any]:
        cfg, run = self.cfg, self.embedding
        native = {**self.parts.model.config, "input_size": native_size}
        sets = {}
        for extra in self.data.extra_sets:
            dataset = copy.copy(extra.test)
            dataset.transform = build_transforms(native, train=False)
            key = {"reference": extra.source, "part": "test", "limit": cfg.eval_extra_limit, "backbone": cfg.backbone,
                   "pretrained": cfg.pretrained, "weights": cfg.weights, "input_size": native_size,
                   "background": native["background"], "amp": run.amp, "images": len(dataset)}
            features = cached_features(self.parts.model.backbone, dataset, key, cfg.feature_cache, run.device,
                                       run.batch_size, run.workers, run.amp, f"reference {extra.name}", run.bad_images,
                                       run.progress)
            sets[extra.name] = {"test": self.ctx.from_main(
                leave_one_out_metrics(features.embeddings, features.labels) if self.main else None)}
        return {"input_size": native_size, "sets": sets}

    def train_embeddings_sample(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Embeddings of a fixed train subset (for the hard-triplet fraction); None when too costly."""
        sample = self.parts.features.train_sample(self.eval_model, self.cfg.seed)
        if sample is None:
            return None
        emb, indices = sample
        return emb, self.data.train_labels[indices]

    def evaluate(self, final: bool = False) -> dict[str, float]:
        """Metrics of the evaluation split: embedded sharded over the ranks, computed once (rank 0), shared."""
        q, ql, g, gl = self.embed_eval()
        self.last_eval = (q, ql, g, gl)  # the report's plots reuse them instead of embedding again
        metrics = self.ctx.from_main(self._metrics(q, ql, g, gl, final) if self.main else None)
        if self.data.extra_sets:
            metrics["extra"] = self.extra_metrics(self.eval_model)
        return metrics

    def _metrics(self, q: np.ndarray, ql: np.ndarray, g: np.ndarray | None, gl: np.ndarray | None,
                 final: bool) -> dict[str, float]:
        metrics = evaluate_embeddings(q, ql, g, gl)
        # unreadable images lose both their embedding and their label: say how many were left
        evaluated = len(ql) + (len(gl) if gl is not None else 0)
        metrics["eval_images"] = evaluated
        metrics["eval_skipped_images"] = self.data.eval_sets.num_images - evaluated
        metrics.update(hard_fractions(q, ql, self.train_embeddings_sample()))
        if self.cfg.linear_probe and (final or not self.record.history):  # before and after training: it is slow
            metrics["linear_probe"] = self.linear_probe(q, ql)
        return metrics

    @torch.no_grad()
    def linear_probe(self, q: np.ndarray, ql: np.ndarray) -> float:
        """Logistic regression on train embeddings (clean labels), accuracy on the evaluation split."""
        from retrieval.metrics import linear_probe

        train_emb, loaded = self.parts.features.train_embeddings(self.eval_model)
        return linear_probe(train_emb, self.data.clean_train_labels[loaded], q, ql, seed=self.cfg.seed)

    # --- the run -----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        try:
            return self._run()
        except BaseException as exc:
            self.tracking.fail("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
            raise

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
        log_path = self.out / "metrics.jsonl"
        if record.baseline is None and cfg.eval_before:
            record.baseline = self.evaluate()
            record.history.append({"epoch": 0, **record.baseline})
            self._track_epoch(record.history[-1])
            if self.main:
                self._rewrite_metrics_log()
        for epoch in range(record.start_epoch, cfg.epochs):
            progress, self.resume_progress = self.resume_progress, None  # a mid-epoch resume's epoch comes first
            row: dict[str, Any] = {"epoch": epoch + 1, **self.train_epoch(epoch, progress)}
            evaluated = (epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs
            if evaluated:
                row.update(self.evaluate(final=epoch + 1 == cfg.epochs))
            record.history.append(row)
            self._track_epoch(row)
            if self.main:
                with log_path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            self._save_epoch_end(epoch, row, evaluated)
            if self.progress:
                shown = {k: round(v, 4) for k, v in row.items() if k in ("loss", "recall@1", "map@r")}
                tqdm.write(f"epoch {epoch + 1}: {shown}")
        return self.finish()

    def finish(self) -> dict[str, Any]:
        history = self.record.history
        final = [r for r in history if "recall@1" in r and r["epoch"] > 0]
        best = max(final, key=lambda r: r[BEST_METRIC]) if final else None
        if self.last_eval is None:  # e.g. resuming a run that had already finished
            self.last_eval = self.embed_eval()
        wise = self.wise_ft() if self.cfg.wise_alpha is not None else None
        if not self.main:
            return {}
        train_sample = self.train_embeddings_sample()
        report = write_report(self.out, self.run_config(), history, self.record.baseline, best,
                              final[-1] if final else None, self.last_eval[:2], train_sample,
                              bad_images=self.bad_images.records(), with_plots=self.cfg.plots,
                              reference=self.record.reference, wise=wise,
                              pictures=self.evaluation_pictures, class_split=self.class_split(),
                              best_metric=BEST_METRIC)
        self.tracking.finish(self.out, report.get("plots", {}), self.parts.scheduler.last_epoch)
        return report

    def class_split(self) -> dict[str, Any]:
        """Which classes (and how many images) each split holds, and how many class names train and test share
        (0: a class-disjoint protocol)."""
        data = self.data
        parts = {"train": data.train_set, "validation": data.val_set, "test": data.eval_sets.query,
                 "gallery": data.eval_sets.gallery}
        names = {part: present_class_names(dataset) for part, dataset in parts.items() if dataset is not None}
        split: dict[str, Any] = {
            part: {"classes": len(found), "images": len(parts[part]),
                   **({"class_names": found} if len(found) <= MAX_LISTED_CLASSES else {})}
            for part, found in names.items()}
        split["shared_train_test_classes"] = len(set(names["train"]) & set(names["test"]))
        return split

    def evaluation_pictures(self) -> dict[str, str]:
        """The last evaluation's query grid and embedding map, drawn into the run folder (report plot names)."""
        return eval_set_pictures(self.out, self.data.eval_sets, self.last_eval, *self.parts.features.eval_indices(),
                                 seed=self.cfg.seed)

    # --- WiSE-FT -------------------------------------------------------------------------------------
    def validation_point(self, model: nn.Module) -> dict[str, Any]:
        """Recall@1 of ``model`` on the validation data: the held-out train classes and each extra set's val part."""
        point: dict[str, Any] = {"in_domain": None, "out_of_domain": None}
        if self.data.val_set is not None:
            point["in_domain"] = self._recall_at_1(model, self.data.val_set, "embed val")["recall@1"]
        if self.data.extra_sets:
            per_set = {name: m["recall@1"] for name, m in self.extra_metrics(model, "val").items()}
            point["extra"] = per_set
            point["out_of_domain"] = float(np.mean(list(per_set.values())))
        return point

    def wise_ft(self) -> dict[str, Any]:
        """WiSE-FT: mix the start and the fine-tuned weights along WISE_ALPHAS on the validation data, take the
        given or chosen alpha, evaluate that model on the test data and save it as an ordinary checkpoint."""
        cfg, robust = self.cfg, self.parts.robust
        finetuned = self.eval_model
        weights = snapshot(finetuned)
        mixed = copy.deepcopy(finetuned).eval()  # the mixes are loaded into this copy
        curve = []
        if self.data.val_set is not None or self.data.extra_sets:
            for alpha in WISE_ALPHAS:
                mixed.load_state_dict(robust.mix(weights, alpha))
                curve.append({"alpha": alpha, **self.validation_point(mixed)})
        alpha = choose_alpha(curve, cfg.wise_tolerance) if cfg.wise_alpha == "auto" else float(cfg.wise_alpha)
        mixed.load_state_dict(robust.mix(weights, alpha))
        q, ql, g, gl = self.parts.features.embed_eval(mixed)
        metrics = self.ctx.from_main(evaluate_embeddings(q, ql, g, gl) if self.main else None)
        if self.data.extra_sets:
            metrics["extra"] = self.extra_metrics(mixed)
        if self.main:
            checkpoint = Checkpoint(
                model_config={**mixed.config, "wise_alpha": alpha}, state_dict=mixed.state_dict(),
                train_config=cfg.to_dict(), config_hash=config_hash({**cfg.to_dict(), "wise_alpha": alpha}),
                epoch=self.record.history[-1]["epoch"] if self.record.history else 0, metrics=metrics,
                class_names=list(self.data.train_set.class_names),
            )
            atomic_save(checkpoint.to_dict(), self.out / WISE_CHECKPOINT)
        if self.progress:
            tqdm.write(f"WiSE-FT: alpha {alpha:g} ({'chosen on validation' if cfg.wise_alpha == 'auto' else 'given'})"
                       f", recall@1 {metrics['recall@1']:.4f}; model in {self.out / WISE_CHECKPOINT}")
        return {"alpha": alpha, "chosen": "validation" if cfg.wise_alpha == "auto" else "given",
                "tolerance": cfg.wise_tolerance, "curve": curve, "metrics": metrics, "checkpoint": WISE_CHECKPOINT}


def load_train_data(cfg: TrainConfig, model_config: dict[str, Any], train_transform) -> TrainData:
    """The train split (less any --val-fraction of its classes, with any --label-noise injected), the evaluation
    split, the validation classes and the --eval-extra sets, as the model wants them."""
    eval_tf = build_transforms(model_config, train=False)
    train_set = load_dataset(cfg.dataset, cfg.data, split="train", transform=train_transform, **cfg.dataset_kwargs)
    eval_sets = load_eval_sets(cfg.dataset, cfg.data, cfg.eval_split, eval_tf, cfg.eval_limit, cfg.seed,
                               **cfg.dataset_kwargs)
    val_set = None
    if cfg.val_fraction > 0:
        train_set, val_set = hold_out_classes(train_set, cfg.val_fraction, cfg.seed)
        val_set.transform = eval_tf
    extra_sets = [load_extra_set(spec, eval_tf, cfg.eval_extra_limit) for spec in cfg.eval_extra]
    names = [extra.name for extra in extra_sets]
    if len(set(names)) < len(names):
        raise ValueError(f"--eval-extra: two sets have the same name ({names}); each set is reported under its "
                         "folder's name: give each set once, or rename one of the folders")
    labels = np.asarray(train_set.labels, dtype=np.int64)
    clean = labels.copy()
    noise_info = None
    if cfg.label_noise:
        mode, _, rate = cfg.label_noise.partition(":")
        transitions, chosen = None, {}
        if mode == "asymmetric":  # per data set, by class name (retrieval.data.noise)
            transitions, chosen = asymmetric_transitions(cfg.dataset, train_set.class_names,
                                                         cfg.label_noise_transitions)
        labels, noise_info = inject_label_noise(
            labels, mode=mode, rate=float(rate), num_classes=len(train_set.class_names),
            transitions=transitions, seed=cfg.seed,
        )
        noise_info.update(chosen)
        train_set.labels = labels
    return TrainData(train_set, eval_sets, labels, clean, noise_info, val_set, extra_sets)


def hold_out_classes(dataset, fraction: float, seed: int):
    """(train, validation): a seeded ``fraction`` of the classes (at least 2) moves to the validation split."""
    classes = np.unique(dataset.labels)
    count = max(2, round(fraction * len(classes)))
    if len(classes) - count < 2:
        raise ValueError(f"--val-fraction {fraction}: the train split has {len(classes)} classes, too few to hold "
                         f"{count} out and train on the rest; lower it or leave it out")
    held = np.random.default_rng(seed).choice(classes, count, replace=False)
    is_val = np.isin(dataset.labels, held)
    return dataset.subset(np.flatnonzero(~is_val)), dataset.subset(np.flatnonzero(is_val))


def hard_fractions(q: np.ndarray, ql: np.ndarray, train_sample) -> dict[str, float]:
    """Fraction of anchors whose hardest negative is closer than their positive (SCT paper, Figure 6)."""
    try:
        from retrieval.analysis.triplet_diagram import triplet_diagram
    except ImportError:
        return {}
    out = {"hard_fraction_test": float(triplet_diagram(q, ql).hard_fraction)}
    if train_sample is not None:
        out["hard_fraction_train"] = float(triplet_diagram(*train_sample).hard_fraction)
    return out


def train(cfg: TrainConfig, progress: bool = True) -> dict[str, Any]:
    """Train one run as configured; returns the report (also written to RUN_DIR/report.json; {} on ranks > 0).

    Under torchrun (WORLD_SIZE > 1) it joins the process group, and leaves it at the end if it joined it."""
    joined = torch.distributed.is_initialized()
    try:
        return Trainer(cfg, progress=progress).run()
    finally:
        if not joined and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
