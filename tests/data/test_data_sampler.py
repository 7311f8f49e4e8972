"""ClassBalancedBatchSampler: P x N batches, adjacency, coverage, determinism, errors."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from retrieval.data import ClassBalancedBatchSampler


def labels_with_counts(counts: list[int], seed: int = 0) -> np.ndarray:
    labels = np.concatenate([np.full(n, c) for c, n in enumerate(counts)])
    return np.random.default_rng(seed).permutation(labels)


def test_batches_are_p_classes_times_n_adjacent_samples():
    labels = labels_with_counts([5, 7, 2, 9, 4, 6, 3, 8])
    sampler = ClassBalancedBatchSampler(labels, classes_per_batch=3, samples_per_class=2, seed=1)
    batches = list(sampler)
    assert len(batches) == len(sampler) == len(labels) // 6
    for batch in batches:
        assert len(batch) == 6 and len(set(batch)) == 6
        blocks = [labels[batch[i : i + 2]] for i in range(0, 6, 2)]
        assert all(len(set(block.tolist())) == 1 for block in blocks)  # one class per adjacent block
        assert len({int(block[0]) for block in blocks}) == 3  # P distinct classes


def test_every_class_is_visited_evenly():
    labels = labels_with_counts([4] * 10)
    sampler = ClassBalancedBatchSampler(labels, 4, 2, batches_per_epoch=50, seed=3)
    visits = Counter(int(labels[batch[i]]) for batch in sampler for i in range(0, 8, 2))
    assert sorted(visits) == list(range(10))
    assert max(visits.values()) - min(visits.values()) <= 1  # shuffled cycles over the classes
    seen = Counter(i for batch in sampler for i in batch)
    assert max(seen.values()) - min(seen.values()) <= 1  # and over each class's samples


def test_deterministic_per_seed_and_epoch():
    labels = labels_with_counts([6] * 12)
    a = ClassBalancedBatchSampler(labels, 4, 3, seed=7)
    b = ClassBalancedBatchSampler(labels, 4, 3, seed=7)
    assert list(a) == list(b) == list(a)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    b.set_epoch(1)
    assert list(a) == list(b)
    assert list(ClassBalancedBatchSampler(labels, 4, 3, seed=8)) != first


def test_small_classes_raise_or_are_dropped():
    labels = labels_with_counts([5, 1, 5, 2, 5])
    with pytest.raises(
        ValueError, match=r"2 of 5 classes have fewer than 3 samples.*`drop_small`.*`samples_per_class`"
    ):
        ClassBalancedBatchSampler(labels, 2, 3)
    sampler = ClassBalancedBatchSampler(labels, 2, 3, drop_small=True)
    assert sampler.dropped_classes == [1, 3]
    used = {int(labels[i]) for batch in sampler for i in batch}
    assert used <= {0, 2, 4}
    assert len(sampler) == 15 // 6


def test_bad_arguments():
    labels = labels_with_counts([4, 4, 4])
    with pytest.raises(ValueError, match="`samples_per_class` must be >= 2"):
        ClassBalancedBatchSampler(labels, 2, 1)
    with pytest.raises(ValueError, match="only 3 classes have >= 2 samples but `classes_per_batch` is 4"):
        ClassBalancedBatchSampler(labels, 4, 2)
    with pytest.raises(ValueError, match="only 1 classes"):
        ClassBalancedBatchSampler(labels_with_counts([4, 1, 1]), 2, 2, drop_small=True)


def test_works_as_torch_batch_sampler():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    labels = labels_with_counts([3] * 6)
    dataset = TensorDataset(torch.arange(len(labels)), torch.as_tensor(labels))
    loader = DataLoader(dataset, batch_sampler=ClassBalancedBatchSampler(labels, 3, 2, seed=0))
    for indices, batch_labels in loader:
        assert torch.equal(batch_labels, torch.as_tensor(labels)[indices])
        assert batch_labels.shape == (6,)


# --- distributed: every rank's part of the same global batches -------------------------------------------------
def test_distributed_parts_side_by_side_are_the_one_process_batches():
    from retrieval.data import DistributedClassBalancedBatchSampler, WithSampleSeeds

    labels = labels_with_counts([5, 7, 4, 9, 4, 6, 3, 8])
    one = ClassBalancedBatchSampler(labels, 3, 4, seed=5, batches_per_epoch=9, drop_small=True)
    for world in (2, 3, 4):
        ranks = [DistributedClassBalancedBatchSampler(labels, 3, 4, rank=r, world_size=world, seed=5,
                                                      batches_per_epoch=9, drop_small=True) for r in range(world)]
        for epoch, start in ((0, 0), (3, 0), (3, 4)):  # start: a run resumed inside the epoch
            one.set_epoch(epoch, start)
            for sampler in ranks:
                sampler.set_epoch(epoch, start)
            assert {len(s) for s in ranks} == {len(one)} == {9 - start}  # the same epoch length on every rank
            parts = [list(s) for s in ranks]
            assert all(len(p) == 12 // world for batches in parts for p in batches)
            assert [sum(step, []) for step in zip(*parts, strict=True)] == list(one)
            # augmentation seeds are the global batch's: the same sample gets the same seed at any world size
            seeded = [list(WithSampleSeeds(s)) for s in ranks]
            assert [sum(step, []) for step in zip(*seeded, strict=True)] == list(WithSampleSeeds(one))


def test_distributed_batch_must_divide_by_the_world_size():
    from retrieval.data import DistributedClassBalancedBatchSampler

    labels = labels_with_counts([6] * 6)
    with pytest.raises(ValueError, match=r"B = 6 .*world size 4.*multiple of 4 .*e.g. 4 or 8"):
        DistributedClassBalancedBatchSampler(labels, 3, 2, rank=0, world_size=4)
    with pytest.raises(ValueError, match="rank must lie"):
        DistributedClassBalancedBatchSampler(labels, 3, 2, rank=2, world_size=2)


def test_repeat_small_gives_each_image_its_views_side_by_side():
    labels = np.arange(12)  # every image its own class: training without labels
    sampler = ClassBalancedBatchSampler(labels, classes_per_batch=3, samples_per_class=2, seed=0, repeat_small=True)
    batches = list(sampler)
    assert len(sampler) == 12 * 2 // 6  # a class of one counts its two views
    for batch in batches:
        assert [batch[i] == batch[i + 1] for i in range(0, 6, 2)] == [True] * 3  # two views of one image, adjacent
        assert len(set(batch)) == 3  # three different images
    assert sorted(i for batch in batches for i in batch[::2]) == list(range(12))  # each image once an epoch


def test_repeat_small_repeats_only_classes_smaller_than_per_class():
    labels = np.array([0, 0, 0, 1, 2, 2])
    sampler = ClassBalancedBatchSampler(labels, classes_per_batch=3, samples_per_class=2, seed=4, repeat_small=True,
                                        batches_per_epoch=20)
    for batch in sampler:
        for i in range(0, 6, 2):
            pair = batch[i : i + 2]
            if labels[pair[0]] == 1:
                assert pair == [3, 3]  # the class of one: its image twice
            else:
                assert pair[0] != pair[1] and labels[pair[0]] == labels[pair[1]]  # two different images


def test_without_repeat_small_a_class_of_one_is_refused():
    with pytest.raises(ValueError, match="fewer than 2 samples"):
        ClassBalancedBatchSampler(np.arange(6), classes_per_batch=2, samples_per_class=2)
