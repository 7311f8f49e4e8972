"""Cross-batch memory: the cost of a full memory, concatenated to the batch or as the batch anchors' gallery, on CPU.

    .venv/bin/python benchmarks/xbm_step.py [--batch 60] [--per-class 12] [--dim 512] [--memory 4096]
                                            [--losses ms contrastive triplet:mining=hard] [--repeats 20]
                                            [--train-steps 8] [--image-size 32] [--threads 1] [--no-train]

Loss rows: forward + backward of each loss on a batch of --batch random embeddings (--per-class a class, so 5
classes at the defaults, Fashion-MNIST's disjoint training classes) with no memory, with a full memory of --memory
rows (labels from the batch's classes) in the concatenated form ``loss(cat(E, M), cat(y, y_M))`` (the memory's
form before), and in the rectangular form ``loss.query_gallery(E, y, (E, M), ..., self_index=arange(B))`` (XBM eq. 5
and 7, ``CrossBatchMemory`` now), the three interleaved run by run in one process (median of --repeats after a
warm-up).

Training rows: one optimizer step of EfficientNet-Lite0 (random init: the weights do not change the time) at
--image-size px on Fashion-MNIST batches (disjoint protocol, class-balanced, decoded before timing), MS loss,
AdamW, frozen BatchNorm, through ``DataParallelStep`` as the trainer runs it; the same three losses interleaved
step by step (median of --train-steps). Every round of either table rotates the order of the three. The memories
are filled first and never enqueue while timed. One torch thread by default (the CPUs are shared). Prints Markdown
tables.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from retrieval.losses import build
from retrieval.losses.memory import CrossBatchMemory

if TYPE_CHECKING:
    from retrieval.data.preprocessing import ModelPreprocessing


class ConcatenatedMemory(CrossBatchMemory):
    """The memory's form before the rectangular one: the loss on the batch and the memory concatenated."""

    batch_anchors = False


def parse_loss(spec: str) -> tuple[str, dict]:
    """``name[:key=value,...]`` -> (name, hyper-parameters)."""
    name, _, options = spec.partition(":")
    kwargs = {}
    for option in filter(None, options.split(",")):
        key, _, value = option.partition("=")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):  # a bare word: a string option
            kwargs[key] = value
    return name, kwargs


def filled(memory: CrossBatchMemory, classes: torch.Tensor, dim: int) -> CrossBatchMemory:
    """The memory full of random rows of ``classes``, never enqueueing (every timed step sees the same rows)."""
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(memory.size, dim, generator=generator)
    labels = classes[torch.randint(len(classes), (memory.size,), generator=generator)]
    memory.enqueue(rows, labels)
    return memory.train(False)


def forms(name: str, kwargs: dict, size: int, dim: int, classes: torch.Tensor) -> dict[str, nn.Module]:
    """The loss with no memory, with the concatenated memory and with the rectangular one."""
    return {
        "no memory": build(name, **kwargs),
        "concatenated": filled(ConcatenatedMemory(build(name, **kwargs), size, dim), classes, dim),
        "rectangular": filled(CrossBatchMemory(build(name, **kwargs), size, dim), classes, dim),
    }


def timed_ms(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) * 1e3


def interleaved(runs: dict[str, Callable[[], None]], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median milliseconds of each run, the runs taking turns so that they share the machine's load; the order
    rotates every round, so that none always follows the (allocator-heavy) concatenated form."""
    times: dict[str, list[float]] = {key: [] for key in runs}
    keys = list(runs)
    for index in range(warmup + repeats):
        for key in keys[index % len(keys):] + keys[:index % len(keys)]:
            elapsed = timed_ms(runs[key])
            if index >= warmup:
                times[key].append(elapsed)
    return {key: statistics.median(values) for key, values in times.items()}


def loss_step(loss: nn.Module, embeddings: torch.Tensor, labels: torch.Tensor) -> Callable[[], None]:
    """Forward + backward of ``loss`` on a fresh leaf copy of ``embeddings``."""

    def run() -> None:
        loss(embeddings.clone().requires_grad_(True), labels).backward()

    return run


def loss_rows(args: argparse.Namespace, labels: torch.Tensor) -> None:
    embeddings = torch.randn(len(labels), args.dim, generator=torch.Generator().manual_seed(0))
    print(f"Loss forward + backward, B = {len(labels)} ({args.per_class} per class), D = {args.dim}, memory "
          f"{args.memory} rows, {args.threads} thread(s), median of {args.repeats} (ms)\n")
    print("| loss | no memory | concatenated | rectangular | concatenated / no memory | rectangular / no memory "
          "| concatenated / rectangular |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for spec in args.losses:
        name, kwargs = parse_loss(spec)
        losses = forms(name, kwargs, args.memory, args.dim, labels.unique())
        ms = interleaved({key: loss_step(loss, embeddings, labels) for key, loss in losses.items()}, args.repeats)
        plain, old, new = ms["no memory"], ms["concatenated"], ms["rectangular"]
        print(f"| {spec} | {plain:.2f} | {old:.1f} | {new:.2f} | {old / plain:.0f} | {new / plain:.2f} "
              f"| {old / new:.0f} |")


def fashion_batches(args: argparse.Namespace, preprocessing: ModelPreprocessing, count: int
                    ) -> list[tuple[torch.Tensor, ...]]:
    """``count`` class-balanced training batches of Fashion-MNIST (disjoint protocol), decoded and stacked."""
    from retrieval.data import load_dataset
    from retrieval.data.sampler import ClassBalancedBatchSampler
    from retrieval.data.transforms import build_transforms

    data = load_dataset("fashion-mnist", split="train", protocol="disjoint",
                        transform=build_transforms(preprocessing, train=True))
    sampler = ClassBalancedBatchSampler(data.labels, args.batch // args.per_class, args.per_class, seed=0)
    batches = []
    for indices in itertools.islice(iter(sampler), count):
        images, labels = zip(*(data[i] for i in indices), strict=True)
        batches.append((torch.stack(images), torch.tensor(labels)))
    return batches


def train_rows(args: argparse.Namespace) -> None:
    from retrieval.models import create_embedder
    from retrieval.train.distributed import DataParallelStep, DistContext

    torch.manual_seed(0)
    model = create_embedder("efficientnet_lite0", args.dim, pretrained=False, normalize=True, freeze_bn=True)
    model.config = model.config.with_fields({"input_size": args.image_size})
    model.train()
    batches = fashion_batches(args, model.preprocessing, 4)
    losses = forms("ms", {}, args.memory, args.dim, batches[0][1].unique())
    context = DistContext(0, 1, 0, torch.device("cpu"))
    step = DataParallelStep(model, lambda net, x: net(x), None, losses["no memory"], context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    turn = itertools.cycle(batches)

    def training_step(loss: nn.Module) -> Callable[[], None]:
        def run() -> None:
            images, labels = next(turn)
            optimizer.zero_grad(set_to_none=True)
            embeddings, _ = step(images, labels, None)
            loss(embeddings, labels).backward()
            optimizer.step()

        return run

    ms = interleaved({key: training_step(loss) for key, loss in losses.items()}, args.train_steps, warmup=1)
    plain = ms["no memory"]
    print(f"\nTraining step, EfficientNet-Lite0 at {args.image_size} px, Fashion-MNIST, B = {args.batch}, ms loss, "
          f"memory {args.memory} rows, {args.threads} thread(s), median of {args.train_steps} steps\n")
    print("| memory | ms per step | x the step without memory |")
    print("| --- | --- | --- |")
    for key, value in ms.items():
        print(f"| {key} | {value:.0f} | {value / plain:.3f} |")


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=60)
    parser.add_argument("--per-class", type=int, default=12)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--memory", type=int, default=4096, help="rows of the cross-batch memory")
    parser.add_argument("--losses", nargs="+", default=["ms", "contrastive", "triplet:mining=hard"],
                        help="name[:key=value,...] of each loss timed")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--train-steps", type=int, default=8, help="timed training steps of each form")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-train", action="store_true", help="the loss rows only")
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables(["xbm-loss", "xbm-step"], args.save)
    torch.set_num_threads(args.threads)
    labels = torch.arange(args.batch // args.per_class).repeat_interleave(args.per_class)
    loss_rows(args, labels)
    if not args.no_train:
        train_rows(args)


if __name__ == "__main__":
    main()
