"""What a run trains, built from its config: the seeded start, the model, and around it on the device the sampler,
the loss (with its memory and auxiliary head), the optimizer and its schedule, --compatible-with's old model and
influence term, the feature source and the step (``build_parts`` -> ``TrainParts``)."""

from __future__ import annotations

import random
import sys
from dataclasses import replace

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from retrieval import losses
from retrieval.data import ClassBalancedBatchSampler, DistributedClassBalancedBatchSampler
from retrieval.data.colour import parse_background
from retrieval.distributed import GlobalBatchObjective
from retrieval.errors import parameters_named
from retrieval.models import Embedder, create_embedder
from retrieval.train.config import TrainConfig
from retrieval.train.console import warn_line
from retrieval.train.distributed import DataParallelStep, DistContext
from retrieval.train.features import Embedding, FeatureSource
from retrieval.train.optimizers import OPTIMIZERS, schedule_factor
from retrieval.train.robust import RobustFineTuning, backbone_param_groups
from retrieval.train.state import TrainData, TrainParts


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
    native = model.preprocessing
    chosen = replace(native, input_size=int(cfg.image_size or native.input_size),
                     background=parse_background(cfg.background), resize=cfg.resize)
    model.config = model.config.with_fields(chosen.to_config())  # what the checkpoint and the export write
    return model, native.input_size


def build_parts(cfg: TrainConfig, *, ctx: DistContext, model: Embedder, data: TrainData, robust: RobustFineTuning,
                source: type[FeatureSource], embedding: Embedding, amp_dtype: torch.dtype | None,
                old_model: nn.Module | None = None) -> TrainParts:
    """What trains, around the model on the device: sampler, loss, optimizer and schedule, features, the step;
    ``old_model``: --compatible-with's (``compatible_old_model``), which the influence term compares with."""
    # without labels an image is a class of one: its --per-class views, each augmented with its own seed
    sampling = dict(drop_small=cfg.drop_small, seed=cfg.seed, batches_per_epoch=cfg.batches_per_epoch,
                    repeat_small=cfg.labels == "none")
    if ctx.distributed:  # each rank takes its part of the same global batches
        sampling.update(rank=ctx.rank, world_size=ctx.world_size)
    sampler_cls = DistributedClassBalancedBatchSampler if ctx.distributed else ClassBalancedBatchSampler
    with parameters_named(samples_per_class="per_class", classes_per_batch="`batch_size` / `per_class`"):
        sampler = sampler_cls(data.train_labels, cfg.classes_per_batch, cfg.per_class, **sampling)

    if cfg.labels == "none" and losses.needs_classes(cfg.loss):
        raise ValueError(f"--labels none: --loss {cfg.loss} learns a proxy per class, and without labels the classes "
                         "are the images themselves or clusters that change every epoch: use a pair loss (ntxent, "
                         "ms, contrastive, ...)")
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
                                     projected_dim=int(model.config.compatible_dim or 0),
                                     host_group=ctx.host_group)
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)  # bf16 needs none

    features = source.build(cfg, model, data.train_set, data.train_labels, data.eval_sets, embedding, data.val_set,
                            old_model=old_model)
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
    export writes them into the ONNX metadata). With --freeze-backbone, an old model whose head cannot read the
    cached features embeds each image once instead (said)."""
    if not cfg.compatible_with:
        return None
    from retrieval.train.compatible import OldModel

    # rebuilding the old model draws initial weights it then replaces: the run's random stream stays untouched
    with parameters_named(path="compatible_with"), torch.random.fork_rng(devices=[]):
        old = OldModel(cfg.compatible_with, model.preprocessing, features=cfg.freeze_backbone, device=device,
                       backbone=model.backbone)
    if old.embeds_once and announce:
        what = "an ONNX file" if old.onnx is not None else "not this run's frozen backbone and preprocessing"
        tqdm.write(f"--compatible-with: {cfg.compatible_with} is {what}, so it cannot embed the cached features: "
                   "it embeds each train and evaluation image once, with its own preprocessing, and its embeddings "
                   "are cached beside the features", file=sys.stderr)
    if old.embedding_dim != cfg.embedding_dim:
        model.add_compatible(old.embedding_dim, seed=cfg.seed)
        if announce:
            tqdm.write(f"--compatible-with: {cfg.compatible_with} embeds in {old.embedding_dim} dimensions, this run "
                       f"in {cfg.embedding_dim}: a projection {cfg.embedding_dim} -> {old.embedding_dim} into the old "
                       "space is trained with the model (the influence term compares its output with the old "
                       f"embeddings; the loss stays on the {cfg.embedding_dim}-d embedding)", file=sys.stderr)
    model.config = model.config.with_fields({"compatible_with": list(old.hashes)})
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
