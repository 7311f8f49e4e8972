"""`retrieval analyze`: weight-vs-similarity plots (unified paper, Fig. 1), triplet diagrams (SCT paper)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import numpy as np

from retrieval.cli.config_options import parse_params, shared_option
from retrieval.cli.errors import OptionGroup, option_message
from retrieval.cli.options import apply_options
from retrieval.options import TRUSTED_CHECKPOINT
from retrieval.train.config import TrainConfig

CHECKPOINT_HELP = (f"embed images of --dataset with this checkpoint (default: a synthetic random batch). "
                   f"{TRUSTED_CHECKPOINT}")


@click.group("analyze", cls=OptionGroup)
def analyze_group() -> None:
    """Figures that explain a loss or a trained embedding."""


def checkpoint_options(func):
    options = [
        click.option("--checkpoint", type=click.Path(dir_okay=False), help=CHECKPOINT_HELP),
        click.option("--dataset", help="data set to embed (default: the one the checkpoint was trained on)."),
        click.option("--data", help="dataset root (default: the checkpoint's --data)."),
        click.option("--split", default="test", show_default=True),
        click.option("--max-samples", default=512, show_default=True, type=click.IntRange(min=2)),
        click.option(
            "--per-class",
            default=4,
            show_default=True,
            type=click.IntRange(min=2),
            help="samples per class taken from the data set (pairs need >= 2).",
        ),
        click.option(
            "--classes",
            default=16,
            show_default=True,
            type=click.IntRange(min=2),
            help="synthetic batch: number of classes.",
        ),
        click.option(
            "--dim",
            default=32,
            show_default=True,
            type=click.IntRange(min=2),
            help="synthetic batch: embedding dimension.",
        ),
        click.option(
            "--spread",
            default=1.5,
            show_default=True,
            type=click.FloatRange(min=0),
            help="synthetic batch: within-class noise relative to the class centres (the default gives\n"
            "about 30 % hard triplets).",
        ),
        click.option("--seed", default=0, show_default=True),
        click.option("--device", default="cpu", show_default=True),
        click.option(
            "--workers",
            default=0,
            show_default=True,
            type=click.IntRange(min=0),
            help="data-loader processes for --checkpoint (0: load in this process, best for small sets).",
        ),
    ]
    return apply_options(func, options)


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
    from retrieval.evaluation import checkpoint_dataset
    from retrieval.inference import embed_dataset
    from retrieval.models import load_checkpoint, load_embedder

    try:
        dataset, data, kwargs = checkpoint_dataset(load_checkpoint(checkpoint).train_config, dataset, data)
    except ValueError as exc:
        raise click.UsageError(option_message(click.get_current_context().command, exc)) from None
    model = load_embedder(checkpoint)
    transform = build_transforms(model.config, train=False)
    full = load_dataset(dataset, data, split=split, transform=transform, **kwargs)
    subset = full.subset(class_balanced_indices(np.asarray(full.labels), per_class, max_samples, seed))
    embeddings, labels = embed_dataset(
        model.to(device), subset, device=device, workers=workers, progress=False
    )
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
@click.option(
    "--loss", "loss_name", required=True, help="a registered pair-based loss, e.g. ms, binomial, raw."
)
@shared_option(TrainConfig, "loss_kwargs")
@click.option("--loss-kwargs", "loss_kwargs_json", metavar="JSON",
              help="the loss's hyperparameters as one JSON object, e.g. '{\"margin\": 0.2}' (--loss-param wins).")
@checkpoint_options
@click.option("--title", help="figure title (default: the loss and its settings).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="PNG file to write.")
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
@click.option(
    "--positive",
    type=click.Choice(["easiest", "hardest", "random"]),
    default="easiest",
    show_default=True,
    help="which positive per anchor (the SCT paper's Fig. 7 uses the easiest).",
)
@click.option("--title", help="figure title.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="PNG file to write.")
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
