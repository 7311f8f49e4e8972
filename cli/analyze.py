"""`retrieval analyze weights|triplets`: weight-vs-similarity plots (unified paper, Fig. 1), triplet diagrams (SCT
paper). Their options are declared once, in ``AnalyzeOptions`` (docs/LOSSES.md's table is made from it)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np

from retrieval.cli.config_options import command_options, parse_params, shared_option
from retrieval.cli.errors import OptionGroup, option_message
from retrieval.cli.options import apply_options
from retrieval.options import TRUSTED_CHECKPOINT, option
from retrieval.train.config import TrainConfig

SYNTHETIC = "synthetic batch"  # the section of the options that shape the random batch used without --checkpoint


@dataclass(frozen=True)
class AnalyzeOptions:
    """The options of `retrieval analyze weights` and `triplets`, declared once; --loss-param and --device are
    training's (``TrainConfig``)."""

    loss: str | None = option(None, "loss", "a registered pair-based loss, e.g. ms, binomial, raw.", dest="loss_name",
                              required=True)
    loss_kwargs: str | None = option(None, "loss", "the loss's hyperparameters as one JSON object, e.g. "
                                     "'{\"margin\": 0.2}' (--loss-param wins).", dest="loss_kwargs_json",
                                     metavar="JSON")
    checkpoint: str | None = option(
        None, "embeddings", f"embed images of --dataset with this checkpoint. {TRUSTED_CHECKPOINT}", path="file",
        default_text="a synthetic random batch")
    dataset: str | None = option(None, "embeddings", "the data set to embed.",
                                 default_text="the one the checkpoint was trained on")
    data: str | None = option(None, "embeddings", "the data set's root.", default_text="the checkpoint's --data")
    split: str = option("test", "embeddings", "the split whose images are embedded.")
    max_samples: int = option(512, "embeddings", "the most samples analysed (the synthetic batch's too).", low=2)
    per_class: int = option(4, "embeddings", "samples per class taken from the data set (pairs need >= 2).", low=2)
    workers: int = option(0, "embeddings", "data-loader processes for --checkpoint (0: load in this process, best "
                          "for small sets).", low=0)
    classes: int = option(16, SYNTHETIC, "synthetic batch: number of classes.", low=2)
    dim: int = option(32, SYNTHETIC, "synthetic batch: embedding dimension.", low=2)
    spread: float = option(1.5, SYNTHETIC, "synthetic batch: within-class noise relative to the class centres (the "
                           "default gives about 30 % hard triplets).", low=0)
    seed: int = option(0, SYNTHETIC, "the seed of the sample: the data set's images or the synthetic batch, and "
                       "triplets' random positives.")
    positive: str = option("easiest", "figure", "which positive per anchor (the SCT paper's Fig. 7 uses the "
                           "easiest).", choices=("easiest", "hardest", "random"))
    title: str | None = option(None, "figure", "the figure's title.",
                               default_text="the loss and its settings (weights), the source and --positive "
                                            "(triplets)")
    out: str | None = option(None, "figure", "PNG file to write.", path="file", required=True)


@click.group("analyze", cls=OptionGroup)
def analyze_group() -> None:
    """Figures that explain a loss or a trained embedding."""


# --device as training declares it: auto there too (analyze's default was cpu before)
device_option = shared_option(TrainConfig, "device", default="auto",
                              help="auto, cpu, cuda or cuda:N; auto, as in training, takes a GPU where there is one "
                                   "(the default was cpu before). [default: auto]")


def checkpoint_options(func: Callable) -> Callable:
    """The options that choose the embeddings analysed: a checkpoint's of a data set, or a synthetic batch's."""
    return apply_options(func, [
        command_options(AnalyzeOptions, "checkpoint", "dataset", "data", "split", "max_samples", "per_class",
                        "classes", "dim", "spread", "seed"),
        device_option,
        command_options(AnalyzeOptions, "workers"),
    ])


def synthetic_batch(classes: int, per_class: int, dim: int, spread: float, seed: int):
    """P x N unit vectors with class structure: random class centres plus isotropic noise, normalised."""
    import torch

    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=g)
    labels = torch.arange(classes).repeat_interleave(per_class)
    points = centres[labels] + spread * torch.randn(len(labels), dim, generator=g)
    return torch.nn.functional.normalize(points, dim=1), labels


def class_balanced_indices(labels: np.ndarray, per_class: int, max_samples: int, seed: int) -> list[int]:
    """Up to ``per_class`` samples from classes in a seeded random order, at most ``max_samples`` in all;
    classes with fewer than 2 samples are skipped (they form no positive pair)."""
    rng = np.random.default_rng(seed)
    chosen: list[int] = []
    for label in rng.permutation(np.unique(labels)):
        members = np.flatnonzero(labels == label)
        if len(members) < 2:
            continue
        take = min(per_class, len(members), max_samples - len(chosen))
        if take < 2:
            break
        chosen.extend(rng.choice(members, size=take, replace=False).tolist())
    if not chosen:
        raise ValueError("no class has 2 or more samples in this split; nothing to analyse")
    return sorted(chosen)


def embed_checkpoint_samples(
    checkpoint: str,
    dataset: str | None,
    data: str | None,
    split: str,
    max_samples: int,
    per_class: int,
    seed: int,
    device: str,
    workers: int = 0,
):
    """Embeddings [n, D] and labels [n] of a class-balanced subset of ``split``, through the checkpoint."""
    import torch

    from retrieval.data import build_transforms, load_dataset
    from retrieval.inference import embed_dataset, resolve_device
    from retrieval.metrics.evaluation import checkpoint_dataset
    from retrieval.models import load_checkpoint, load_embedder

    try:
        dataset, data, kwargs = checkpoint_dataset(load_checkpoint(checkpoint).train_config, dataset, data)
    except ValueError as exc:
        raise click.UsageError(option_message(click.get_current_context().command, exc)) from None
    model = load_embedder(checkpoint)
    transform = build_transforms(model.preprocessing, train=False)
    full = load_dataset(dataset, data, split=split, transform=transform, **kwargs)
    subset = full.subset(class_balanced_indices(np.asarray(full.labels), per_class, max_samples, seed))
    dev = resolve_device(device)  # auto: a GPU where there is one, as training
    embeddings, labels = embed_dataset(model.to(dev), subset, device=dev, workers=workers, progress=False)
    return torch.from_numpy(embeddings), torch.from_numpy(labels)


def analysis_inputs(
    checkpoint, dataset, data, split, max_samples, per_class, classes, dim, spread, seed, device, workers
):
    if checkpoint:
        return embed_checkpoint_samples(
            checkpoint, dataset, data, split, max_samples, per_class, seed, device, workers
        )
    classes = min(classes, max(2, max_samples // per_class))
    return synthetic_batch(classes, per_class, dim, spread, seed)


def parse_loss_kwargs(raw: str | None) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(
            f"not valid JSON ({exc}); e.g. '{{\"margin\": 0.2}}'", param_hint="--loss-kwargs"
        ) from exc
    if not isinstance(value, dict):
        raise click.BadParameter(
            "must be a JSON object, e.g. '{\"margin\": 0.2}'", param_hint="--loss-kwargs"
        )
    return value


@analyze_group.command("weights", needs="train")
@command_options(AnalyzeOptions, "loss")
@shared_option(TrainConfig, "loss_kwargs")
@command_options(AnalyzeOptions, "loss_kwargs")
@checkpoint_options
@command_options(AnalyzeOptions, "title", "out")
def weights_command(
    loss_name,
    loss_kwargs,
    loss_kwargs_json,
    checkpoint,
    dataset,
    data,
    split,
    max_samples,
    per_class,
    classes,
    dim,
    spread,
    seed,
    device,
    workers,
    title,
    out,
) -> None:
    """Plot the weight each pair gets from a loss against the pair's cosine similarity."""
    import torch

    from retrieval import losses
    from retrieval.analysis.plots import plot_pair_weights
    from retrieval.losses.weights import pair_weights

    kwargs = {**parse_loss_kwargs(loss_kwargs_json), **parse_params(loss_kwargs, "--loss-param")}
    loss = losses.build(loss_name, **kwargs)
    embeddings, labels = analysis_inputs(
        checkpoint, dataset, data, split, max_samples, per_class, classes, dim, spread, seed, device, workers
    )
    try:
        similarity, weights = pair_weights(loss, embeddings, labels)
    except TypeError as exc:  # not a pair-based loss (e.g. dcdl, npair on raw dot products)
        raise click.ClickException(str(exc)) from exc
    source = f"checkpoint {Path(checkpoint).name}" if checkpoint else "random batch"
    title = title or f"{loss_name} {json.dumps(kwargs) if kwargs else ''} ({source}, {len(labels)} samples)"
    path = plot_pair_weights(similarity, weights, labels, out, title)
    off_diagonal = ~torch.eye(len(labels), dtype=torch.bool)
    click.echo(
        json.dumps(
            {
                "out": str(path),
                "samples": len(labels),
                "nonzero_fraction": round(float((weights[off_diagonal] != 0).float().mean()), 4),
            }
        )
    )


@analyze_group.command("triplets", needs="train")
@checkpoint_options
@command_options(AnalyzeOptions, "positive", "title", "out")
def triplets_command(
    checkpoint,
    dataset,
    data,
    split,
    max_samples,
    per_class,
    classes,
    dim,
    spread,
    seed,
    device,
    workers,
    positive,
    title,
    out,
) -> None:
    """Triplet diagram: anchor-negative against anchor-positive similarity, hard triplets in red."""
    from retrieval.analysis.plots import plot_triplet_diagram
    from retrieval.analysis.triplet_diagram import triplet_diagram

    embeddings, labels = analysis_inputs(
        checkpoint, dataset, data, split, max_samples, per_class, classes, dim, spread, seed, device, workers
    )
    diagram = triplet_diagram(embeddings, labels, positive=positive, seed=seed)
    source = f"checkpoint {Path(checkpoint).name}" if checkpoint else "random batch"
    path = plot_triplet_diagram(diagram, out, title or f"{source}, {positive} positive")
    click.echo(
        json.dumps(
            {"out": str(path), "anchors": len(diagram), "hard_fraction": round(diagram.hard_fraction, 4)}
        )
    )
