"""The local engine decodes a gallery in threads of its own process: the batches in order, each image as decoding it
alone gives it, bad files recorded in place; a consumer that stops early leaves no thread behind."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from sample_images import write_images

from retrieval.data.preprocessing import ModelPreprocessing
from retrieval.index.embedding.decode import AHEAD, DecodedBatch, GalleryDecodeDataset, thread_batches

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


@pytest.mark.parametrize(("batch_size", "threads"), [(3, 1), (3, 4), (1, 2), (20, 3)])
def test_threads_give_the_images_in_order_as_decoding_each_alone_does(dataset, batch_size, threads):
    records, arrays = flatten(thread_batches(dataset, batch_size, threads))
    assert [record_id for record_id, _ in records] == list(range(1, 9))
    assert records[3][1] is not None and all(error is None for i, (_, error) in enumerate(records) if i != 3)
    alone = [dataset[i] for i in range(len(dataset))]  # one image at a time, in this thread
    np.testing.assert_array_equal(arrays, np.stack([d.array for d in alone if d.array is not None]))
    assert arrays.dtype == np.float32 and arrays.shape == (7, 3, 16, 16)


def test_a_consumer_that_stops_early_leaves_no_thread_behind(dataset):
    before = {t for t in threading.enumerate() if t.name.startswith("decode")}
    batches = thread_batches(dataset, 1, 2)
    next(batches)
    assert {t for t in threading.enumerate() if t.name.startswith("decode")} - before
    batches.close()  # the generator's threads end with it
    assert not {t for t in threading.enumerate() if t.name.startswith("decode")} - before


def test_only_a_few_batches_are_decoded_ahead_of_the_consumer(dataset, monkeypatch):
    started = []
    original = GalleryDecodeDataset.__getitem__
    monkeypatch.setattr(GalleryDecodeDataset, "__getitem__", lambda self, i: started.append(i) or original(self, i))
    batches = thread_batches(dataset, 1, 4)
    next(batches)
    assert len(started) <= AHEAD + 2  # the batch handed over, AHEAD behind it, and the one submitted meanwhile
    batches.close()
