"""Decoding and augmenting training images on the device (--decode-on device) shows the model what the workers'
pipeline shows it: the same crops and flips from the same seeds, every file the CPU pipeline reads, damaged JPEGs
reported by name. Run here with the device stage on the CPU (torchvision's decode_jpeg there); the CUDA run is in
tests/project/test_cuda.py."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)
from device_batches import CONFIG, both_pipelines
from PIL import Image
from sample_images import save_jpeg, smooth_picture

from retrieval.data import device_decode
from retrieval.data.augment import resolve_augmentation
from retrieval.data.dataset import CatchBadSamples, ImageDataset
from retrieval.data.device_decode import EncodedBatch, EncodedImages, collate_encoded, draw_box
from retrieval.inference import make_loader


def test_the_crop_and_flip_are_drawn_as_the_workers_draw_them(tmp_path):
    paths = [save_jpeg(tmp_path / f"{i}.jpg", smooth_picture(120 + 37 * i, 300 - 21 * i, i)) for i in range(8)]
    cpu, images, labels, bad, encoded = both_pipelines(paths)
    assert all(item.encoded for item in encoded.inputs.images)  # plain JPEGs travel as bytes
    assert bad == [] and labels.tolist() == cpu.labels.tolist()
    assert images.shape == cpu.inputs.shape == (8, 3, 64, 64)
    # the same region and orientation: resampled once instead of twice, decoded by another decoder
    assert (images - cpu.inputs).abs().mean(dim=(1, 2, 3)).max() < 0.05
    # a crop from another seed is far off: the comparison above would catch a wrong draw
    _, other, *_ = both_pipelines(paths, seeds=[99 + i for i in range(8)])
    assert (other - cpu.inputs).abs().mean(dim=(1, 2, 3)).min() > 0.1


def test_the_box_maps_the_resized_crop_back_to_the_decoded_image():
    aug = resolve_augmentation("none")  # the centre crop of the image resized to 1.14 x 64 = 72 px on its short side
    (top, left, height, width), flip = draw_box(144, 400, 64, aug)
    assert not flip
    assert (height, width) == (128, 128)  # 64 of 72 px, scaled by 2 back to the decoded image
    assert (top, left) == (8, 136)


@pytest.mark.parametrize("kind", ["png", "array", "grey-jpeg", "progressive-jpeg", "rotated-jpeg", "cmyk-jpeg",
                                  "large-jpeg"])
def test_images_the_device_decoder_would_see_otherwise_are_decoded_by_the_workers(tmp_path, kind):
    pixels = smooth_picture(90, 130, 3)
    if kind == "png":
        sample = tmp_path / "a.png"
        Image.fromarray(pixels).save(sample)
    elif kind == "array":
        sample = pixels
    elif kind == "grey-jpeg":
        sample = tmp_path / "a.jpg"
        Image.fromarray(pixels).convert("L").save(sample, quality=95)
    elif kind == "progressive-jpeg":
        sample = save_jpeg(tmp_path / "a.jpg", pixels, progressive=True)
    elif kind == "rotated-jpeg":
        exif = Image.Exif()
        exif[0x0112] = 6  # rotate 90 degrees to show upright
        sample = save_jpeg(tmp_path / "a.jpg", pixels, exif=exif.tobytes())
    elif kind == "cmyk-jpeg":
        sample = tmp_path / "a.jpg"
        Image.fromarray(pixels).convert("CMYK").save(sample, quality=95)
    else:  # read_image shrinks an image whose short side is twice MIN_SHORT_SIDE
        sample = save_jpeg(tmp_path / "a.jpg", smooth_picture(1600, 1700, 3))
    cpu, images, _, bad, encoded = both_pipelines([sample, save_jpeg(tmp_path / "plain.jpg", pixels)])
    assert [item.encoded for item in encoded.inputs.images] == [False, True]
    assert bad == []
    assert (images - cpu.inputs).abs().mean(dim=(1, 2, 3)).max() < 0.05


def test_a_jpeg_damaged_past_its_header_is_reported_by_name_and_the_batch_goes_on(tmp_path):
    good = [save_jpeg(tmp_path / f"{i}.jpg", smooth_picture(80, 100, i)) for i in range(3)]
    data = Path(good[1]).read_bytes()
    broken = tmp_path / "broken.jpg"
    scan = data.index(b"\xff\xda")  # keep the header, garble the entropy-coded data and drop the end marker
    broken.write_bytes(data[:scan + 40] + bytes(range(256)) * 4)
    cpu, images, labels, bad, encoded = both_pipelines([good[0], str(broken), good[2]])
    assert encoded.inputs.images[1].encoded  # the header passes: it reaches the device decoder
    if not bad:  # libjpeg may decode garbage as grey blocks with a warning rather than fail
        pytest.skip("this libjpeg decodes the garbled scan without an error")
    assert [b.source for b in bad] == [str(broken)] and bad[0].index == 1
    assert "could not be decoded" in bad[0].reason
    assert labels.tolist() == [0, 2] and images.shape[0] == 2


def test_a_batch_is_decoded_in_groups_of_bounded_pixels_with_the_same_result(tmp_path, monkeypatch):
    paths = [save_jpeg(tmp_path / f"{i}.jpg", smooth_picture(100, 120, i)) for i in range(6)]
    calls = []
    real = device_decode.decode_jpeg

    def counting(data, **kwargs):
        calls.append(len(data) if isinstance(data, list) else 1)
        return real(data, **kwargs)

    monkeypatch.setattr(device_decode, "decode_jpeg", counting)
    _, whole, *_ = both_pipelines(paths)
    assert calls == [6]
    calls.clear()
    _, grouped, *_ = both_pipelines(paths, group_pixels=2 * 100 * 120)
    assert calls == [2, 2, 2]
    assert torch.equal(whole, grouped)


def encoded_dataset(tmp_path, count: int = 6):
    """JPEGs (handed over as bytes) and one PNG (decoded in the worker, handed over as pixels)."""
    paths = [save_jpeg(tmp_path / f"{i}.jpg", smooth_picture(70 + 13 * i, 90, i)) for i in range(count - 1)]
    Image.fromarray(smooth_picture(60, 80, 9)).save(tmp_path / "p.png")
    paths.append(str(tmp_path / "p.png"))
    aug = resolve_augmentation("crop-flip")
    dataset = ImageDataset(paths, list(range(count)), [str(i) for i in range(count)], None)
    return EncodedImages(dataset, CONFIG, aug), [(i, 500 + i) for i in range(count)]


def same_batches(first: EncodedBatch, second: EncodedBatch) -> None:
    assert torch.equal(first.labels, second.labels) and torch.equal(first.indices, second.indices)
    assert len(first.images) == len(second.images)
    for a, b in zip(first.images, second.images, strict=True):
        assert torch.equal(a.data, b.data)
        assert (a.encoded, a.shape, a.box, a.flip, a.seed) == (b.encoded, b.shape, b.box, b.flip, b.seed)


def test_a_batch_leaves_a_worker_as_one_tensor_and_arrives_whole(tmp_path):
    encoded, keys = encoded_dataset(tmp_path)
    loaded = collate_encoded([CatchBadSamples(encoded)[key] for key in keys])
    assert {image.encoded for image in loaded.inputs.images} == {True, False}
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(loaded.inputs)
    arrived = pickle.loads(buffer.getvalue())
    same_batches(arrived, loaded.inputs)
    assert len({image.data.untyped_storage().data_ptr() for image in arrived.images}) == 1


def test_batches_from_worker_processes_equal_those_made_in_the_main_process(tmp_path):
    encoded, keys = encoded_dataset(tmp_path)
    batches = [keys[:4], keys[4:]]
    local = [collate_encoded([CatchBadSamples(encoded)[key] for key in batch]) for batch in batches]
    loader = make_loader(encoded, None, 2, None, batch_sampler=batches, collate_fn=collate_encoded)
    received = list(loader)
    assert len(received) == 2
    for got, want in zip(received, local, strict=True):
        same_batches(got.inputs, want.inputs)
        # one shared-memory tensor a batch crossed from the worker, not one an image
        assert len({image.data.untyped_storage().data_ptr() for image in got.inputs.images}) == 1


def test_a_batch_of_other_than_uint8_data_is_refused_before_it_is_packed(tmp_path):
    encoded, keys = encoded_dataset(tmp_path, 2)
    batch = collate_encoded([CatchBadSamples(encoded)[key] for key in keys]).inputs
    first = batch.images[0]
    odd = EncodedBatch([first, dataclasses.replace(first, data=first.data.float())], batch.labels, batch.indices)
    with pytest.raises(ValueError, match="uint8 data only"):
        pickle.dumps(odd)


def test_a_packed_batch_that_does_not_hold_its_images_is_refused():
    with pytest.raises(ValueError, match="does not hold"):
        device_decode._unpack_batch(torch.zeros(10, dtype=torch.uint8), [((11,), True, (4, 4), (0, 0, 4, 4),
                                                                          False, 1)],
                                    torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))


def test_colour_augmentation_on_the_device_depends_on_the_sample_seed_only(tmp_path):
    paths = [save_jpeg(tmp_path / f"{i}.jpg", smooth_picture(90, 110, i)) for i in range(4)]
    _, first, *_ = both_pipelines(paths, augmentation="strong")
    _, again, *_ = both_pipelines(paths, augmentation="strong")
    _, plain, *_ = both_pipelines(paths, augmentation="crop-flip")
    assert torch.equal(first, again)
    assert not torch.equal(first, plain)


def test_an_oversized_header_is_refused_before_any_pixel_is_decoded(tmp_path):
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64)).save(buffer, format="JPEG")
    data = bytearray(buffer.getvalue())
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = (60_000).to_bytes(2, "big") + (60_000).to_bytes(2, "big")  # 3.6 gigapixels declared
    path = tmp_path / "bomb.jpg"
    path.write_bytes(bytes(data))
    assert device_decode.jpeg_for_device(bytes(data)) is None  # never handed to the device decoder
    dataset = ImageDataset([str(path)], [0], ["0"])
    item = CatchBadSamples(EncodedImages(dataset, CONFIG, resolve_augmentation("crop-flip")))[(0, 1)]
    assert "too large" in item.reason and item.source == str(path)


def test_batches_decoded_ahead_come_in_order_and_a_failure_reaches_the_consumer():
    from retrieval.data.dataset import LoadedBatch

    class Stage:
        device = torch.device("cpu")

        def __call__(self, batch):
            if batch == "boom":
                raise RuntimeError("the stage failed")
            return torch.full((1,), batch), torch.zeros(1), []

    def loader(items):
        for item in items:
            yield LoadedBatch(item, None, torch.empty(0), [])

    got = [(batch.inputs, None if done is None else int(done[0])) for batch, done in
           device_decode.decoded_batches(loader(list(range(7))), Stage())]
    assert got == [(i, i) for i in range(7)]
    empty = LoadedBatch(None, None, torch.empty(0), [])
    assert [done for _, done in device_decode.decoded_batches(iter([empty]), Stage())] == [None]
    with pytest.raises(RuntimeError, match="the stage failed"):
        list(device_decode.decoded_batches(loader([1, "boom", 2]), Stage()))
    endless = device_decode.decoded_batches(loader(iter(int, 1)), Stage())  # a consumer that stops early
    assert next(endless)[0].inputs == 0
    endless.close()  # joins the thread: nothing keeps running


def test_a_path_that_is_not_a_regular_file_is_refused_before_it_is_read(tmp_path):
    fifo = tmp_path / "waits.jpg"
    os.mkfifo(fifo)  # reading it would block until a writer came
    dataset = ImageDataset([str(fifo)], [0], ["0"])
    item = CatchBadSamples(EncodedImages(dataset, CONFIG, resolve_augmentation("crop-flip")))[(0, 1)]
    assert "not a regular file" in item.reason and item.source == str(fifo)


@pytest.mark.parametrize("resize", ["crop", "pad"])
def test_training_decodes_on_the_device_when_told(tmp_path, resize):
    from retrieval.train import TrainConfig, train

    root = tmp_path / "data"
    for label in range(8):  # the first 4 classes train
        (root / f"class{label}").mkdir(parents=True)
        for i in range(6):
            save_jpeg(root / f"class{label}" / f"{i}.jpg", smooth_picture(70 + 5 * i, 90, 10 * label + i))
    cfg = TrainConfig(dataset="folder", data=str(root), backbone="timm:test_resnet", pretrained=False, image_size=32,
                      embedding_dim=8, loss="ms", batch_size=8, per_class=2, batches_per_epoch=2, epochs=2,
                      workers=2, device="cpu", out=str(tmp_path / "run"), decode_on="device", eval_before=False,
                      plots=False, eval_limit=16, resize=resize)
    report = train(cfg, progress=False)  # two epochs of the same workers, the decoding thread started twice
    for row in report["history"]:
        assert row["steps"] == 2 and row["skipped_images"] == 0 and np.isfinite(row["loss"])
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    assert recorded["decode_on"] == "device" and recorded["resize"] == resize


def test_decoding_on_the_device_is_refused_with_frozen_features(tmp_path):
    from retrieval.train import TrainConfig

    with pytest.raises(ValueError, match="--decode-on device"):
        TrainConfig(dataset="digits", freeze_backbone=True, decode_on="device", out=str(tmp_path)).validate()
