"""The base install (no torch) decodes a gallery in a process pool of its own: the same batches, in the same order,
as torch's DataLoader gives the full install, bad files included; a dead worker is named, not a hang."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from sample_images import write_images

from retrieval.data.preprocessing import ModelPreprocessing
from retrieval.index.embedding.decode import DecodedBatch, GalleryDecodeDataset, decoded_batches, pool_batches

PREPROCESSING = ModelPreprocessing(input_size=16, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> GalleryDecodeDataset:
    """Seven readable images and, in the middle, a file that is no image."""
    folder = tmp_path_factory.mktemp("gallery")
    paths = write_images(folder, 7)
    broken = folder / "broken.png"
    broken.write_bytes(b"not an image")
    paths.insert(3, broken)
    return GalleryDecodeDataset([(i + 1, str(path)) for i, path in enumerate(paths)], PREPROCESSING)


def flatten(batches) -> tuple[list[tuple[int, str | None]], np.ndarray]:
    """Every record's (id, error) in order, and the readable images' arrays stacked."""
    records, arrays = [], []
    for batch in batches:
        assert isinstance(batch, DecodedBatch)
        records += [(record.id, record.error) for record in batch.records]
        if batch.batch is not None:
            assert len(batch.ok_index) == len(batch.array())
            arrays.append(batch.array())
    return records, np.concatenate(arrays)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_pool_gives_the_dataloaders_batches_in_order(dataset, workers):
    expected_records, expected_arrays = flatten(decoded_batches(dataset, 3, workers))  # torch's DataLoader here
    records, arrays = flatten(pool_batches(dataset, 3, workers))
    assert records == expected_records
    assert [record_id for record_id, _ in records] == list(range(1, 9))
    assert records[3][1] is not None and all(error is None for i, (_, error) in enumerate(records) if i != 3)
    np.testing.assert_array_equal(arrays, expected_arrays)
    assert arrays.dtype == np.float32 and arrays.shape == (7, 3, 16, 16)


def test_a_consumer_that_stops_early_leaves_no_worker_behind(dataset):
    before = children()
    batches = pool_batches(dataset, 1, 2)
    next(batches)
    assert children() - before  # the pool's workers
    batches.close()  # the generator's pool is shut down with it
    assert not children() - before


def test_a_killed_worker_is_named_with_how_to_resume(dataset, monkeypatch):
    monkeypatch.setattr("retrieval.index.embedding.decode.decode_items", _die)
    with pytest.raises(RuntimeError, match="worker process died.*run the command again to resume"):
        list(pool_batches(dataset, 2, 1))


def _die(*args: object) -> DecodedBatch:
    os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer would
    raise AssertionError("unreachable")


def children() -> set[int]:
    """This process's live child processes (Linux's /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                state, parent = stat.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):  # not a process, or gone meanwhile
            continue
        if int(parent) == os.getpid() and state != "Z":
            found.add(int(entry))
    return found
