"""P x N batches: ``classes_per_batch`` classes, ``samples_per_class`` images each, per batch.

Metric losses need positives in every batch; this sampler guarantees them. Classes are visited in
shuffled cycles (every class once per cycle) and each class's images in shuffled cycles too, so an
epoch covers the data evenly. The batches are a function of ``(seed, epoch)`` alone: call ``set_epoch``;
``set_epoch(epoch, start=k)`` skips the first ``k`` batches (a run resumed in the middle of an epoch).

Under torch.distributed, ``DistributedClassBalancedBatchSampler`` draws the very same global batches on every
rank (same ``(seed, epoch)``) and gives each rank its equal, contiguous part of each: the ranks' parts put side by
side in rank order are the one-process batch, and every rank has the same number of batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler


class _CyclicQueue:
    """Draws ``k`` distinct items at a time from shuffled passes over ``items``."""

    def __init__(self, items: np.ndarray, rng: np.random.Generator) -> None:
        self.items = items
        self.rng = rng
        self.queue: list[int] = []

    def take(self, k: int) -> list[int]:
        if len(self.queue) < k:
            left = set(self.queue)
            fresh = [int(x) for x in self.rng.permutation(self.items)]
            # The next draw takes the leftovers plus the first items of a fresh pass: move the leftovers'
            # second copies after that draw so a draw never repeats an item, yet every pass is complete.
            need = k - len(self.queue)
            head = [x for x in fresh if x not in left][:need]
            chosen = set(head)
            self.queue += head + [x for x in fresh if x not in chosen]
        drawn, self.queue = self.queue[:k], self.queue[k:]
        return drawn

    def take_views(self, k: int) -> list[int]:
        """``k`` items, each as often as ``k`` needs and no more: an item twice only when there are fewer than ``k``
        (its second view, augmented with another seed)."""
        drawn: list[int] = []
        while len(drawn) < k:
            drawn += self.take(min(k - len(drawn), len(self.items)))
        return drawn


class ClassBalancedBatchSampler(Sampler[list[int]]):
    """Yields lists of dataset indices: P classes x N samples, one class's samples adjacent.

    Classes with fewer than N samples raise a ValueError unless ``drop_small=True`` drops them, or
    ``repeat_small=True`` fills them with repeats: an image then comes as several views, each augmented with its
    own seed (training without labels: every image its own class, its views the positive pairs).
    ``batches_per_epoch`` defaults to (number of usable samples) // (P * N), at least 1, a repeated class counting
    N samples. A negative label marks a sample held out: it is never drawn.
    """

    def __init__(
        self,
        labels: Sequence[int] | np.ndarray,
        classes_per_batch: int,
        samples_per_class: int,
        drop_small: bool = False,
        seed: int = 0,
        batches_per_epoch: int | None = None,
        repeat_small: bool = False,
    ) -> None:
        labels = np.asarray(labels).reshape(-1)
        if samples_per_class < 2:
            raise ValueError(
                "`samples_per_class` must be >= 2 (metric losses need a positive pair), "
                f"got {samples_per_class}"
            )
        if classes_per_batch < 1:
            raise ValueError(f"`classes_per_batch` must be >= 1, got {classes_per_batch}")
        classes, counts = np.unique(labels[labels >= 0], return_counts=True)
        small = classes[counts < samples_per_class] if not repeat_small else classes[:0]
        if len(small) and not drop_small:
            raise ValueError(
                f"{len(small)} of {len(classes)} classes have fewer than {samples_per_class} samples "
                f"(smallest has {counts.min()}); pass `drop_small` to leave them out, or lower `samples_per_class`"
            )
        usable = classes if repeat_small else classes[counts >= samples_per_class]
        if len(usable) < classes_per_batch:
            raise ValueError(
                f"only {len(usable)} classes have >= {samples_per_class} samples but `classes_per_batch` is "
                f"{classes_per_batch}; a batch needs that many classes: lower `classes_per_batch` (e.g. to "
                f"{len(usable)}: a batch of {len(usable) * samples_per_class} samples) or `samples_per_class`"
            )
        self.classes = usable
        self.indices_by_class = {int(c): np.flatnonzero(labels == c) for c in usable}
        self.dropped_classes = [int(c) for c in small]
        self.classes_per_batch = classes_per_batch
        self.samples_per_class = samples_per_class
        self.repeat_small = repeat_small
        self.seed = seed
        self.epoch = 0
        self.start = 0
        usable_samples = sum(max(len(v), samples_per_class if repeat_small else 0)
                             for v in self.indices_by_class.values())
        default = max(1, usable_samples // (classes_per_batch * samples_per_class))
        if batches_per_epoch is not None and batches_per_epoch < 1:
            raise ValueError(f"`batches_per_epoch` must be >= 1, got {batches_per_epoch}")
        self.batches_per_epoch = batches_per_epoch or default

    @property
    def batch_size(self) -> int:
        return self.classes_per_batch * self.samples_per_class

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Use a different (still deterministic) shuffle for each epoch; iterate from batch ``start`` of it."""
        if not 0 <= start <= self.batches_per_epoch:
            raise ValueError(f"start must lie in 0..{self.batches_per_epoch} (batches per epoch), got {start}")
        self.epoch = epoch
        self.start = start

    def __len__(self) -> int:
        """Batches left in the epoch (all of them unless ``set_epoch(..., start)`` skipped some)."""
        return self.batches_per_epoch - self.start

    def part(self, batch: list) -> list:
        """This process's part of a global batch: all of it (the distributed sampler takes a slice)."""
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.global_batches():
            yield self.part(batch)

    def global_batches(self) -> Iterator[list[int]]:
        """The epoch's batches from ``start`` on, whole (the same on every rank)."""
        rng = np.random.default_rng([self.seed, self.epoch])
        class_queue = _CyclicQueue(self.classes, rng)
        sample_queues = {c: _CyclicQueue(idx, rng) for c, idx in self.indices_by_class.items()}
        for position in range(self.batches_per_epoch):
            batch: list[int] = []
            for cls in class_queue.take(self.classes_per_batch):
                queue = sample_queues[cls]
                batch.extend(queue.take_views(self.samples_per_class) if self.repeat_small
                             else queue.take(self.samples_per_class))
            if position >= self.start:  # the skipped batches are drawn all the same: the queues' state needs them
                yield batch


class DistributedClassBalancedBatchSampler(ClassBalancedBatchSampler):
    """Rank ``rank``'s part of each ``ClassBalancedBatchSampler`` batch: samples ``[rank * b, (rank + 1) * b)``
    of the global batch of B = ``classes_per_batch * samples_per_class``, with b = B / ``world_size``.

    Every rank draws the same global sequence from ``(seed, epoch)``, so the parts put side by side in rank
    order are exactly the one-process batches, in order; ``len`` and ``set_epoch(epoch, start)`` (a mid-epoch
    resume) are the global sampler's, hence the same on every rank.
    """

    def __init__(self, labels: Sequence[int] | np.ndarray, classes_per_batch: int, samples_per_class: int,
                 rank: int, world_size: int, **kwargs) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in 0..world_size-1 with world_size >= 1, got rank {rank} of {world_size}")
        batch = classes_per_batch * samples_per_class
        if batch % world_size:
            step = math.lcm(world_size, samples_per_class)
            fits = sorted({max(step, batch // step * step), (batch // step + 1) * step})
            raise ValueError(
                f"the global batch B = {batch} ({classes_per_batch} classes x {samples_per_class} per class) does "
                f"not divide by the world size {world_size} (processes); every rank takes an equal part of each "
                f"batch: choose a batch size that is a multiple of {step} (world size and samples per class), e.g. "
                f"{' or '.join(map(str, fits))}, or another number of processes"
            )
        super().__init__(labels, classes_per_batch, samples_per_class, **kwargs)
        self.rank = rank
        self.world_size = world_size

    def part(self, batch: list) -> list:
        size = len(batch) // self.world_size
        return batch[self.rank * size : (self.rank + 1) * size]


class WithSampleSeeds(Sampler[list[tuple[int, int]]]):
    """``sampler``'s batches with a seed per sample: ``[(index, seed), ...]`` for ``CatchBadSamples``.

    The seed is a function of (sampler seed, epoch, batch position, place in the batch), so random augmentation
    does not depend on the number of workers or on where a run was resumed; under a distributed sampler the seeds
    are those of the global batch, so a sample gets the same augmentation whatever the number of ranks.
    """

    def __init__(self, sampler: ClassBalancedBatchSampler) -> None:
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        sampler = self.sampler
        for position, batch in enumerate(sampler.global_batches(), start=sampler.start):
            seeds = np.random.default_rng([sampler.seed, sampler.epoch, position]).integers(2**63, size=len(batch))
            yield sampler.part([(int(index), int(seed)) for index, seed in zip(batch, seeds, strict=True)])
