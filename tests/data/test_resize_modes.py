"""`--resize crop|pad`: how an image of any shape becomes the model's square input. crop keeps the centre (a wide
image loses its ends); pad keeps the whole image, letterboxed onto the model's background. The mode is recorded
with the model and followed everywhere the one preprocessing runs (evaluation, export, index, search, the app)."""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from retrieval.data.augment import resolve_augmentation
from retrieval.data.eval_preprocess import EvalPreprocess
from retrieval.data.preprocessing import ModelPreprocessing
from retrieval.data.transforms import build_transforms

CONFIG = ModelPreprocessing(input_size=32, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), background=(255, 255, 255))
PAD = replace(CONFIG, resize="pad")


def wide_symbol(ends: str) -> Image.Image:
    """A 300 x 84 "staff": the same middle, a different mark at its left end (a treble or a bass clef)."""
    pixels = np.full((84, 300, 3), 255, np.uint8)
    pixels[20:64, 100:200] = (40, 40, 40)  # the same middle
    if ends == "treble":
        pixels[10:74, 5:30] = (200, 0, 0)
    else:
        pixels[30:54, 5:60] = (0, 0, 200)
    return Image.fromarray(pixels)


def letterbox_by_hand(image: Image.Image, side: int, background) -> np.ndarray:
    """The reference: scale so the long side is ``side``, paste centred on a background canvas, as uint8 HWC."""
    scale = side / max(image.size)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    canvas = Image.new("RGB", (side, side), tuple(background))
    canvas.paste(image.resize(size, Image.BILINEAR), ((side - size[0]) // 2, (side - size[1]) // 2))
    return np.asarray(canvas)


@pytest.mark.parametrize("size", [(300, 84), (84, 300), (33, 32), (1, 500), (32, 32), (7, 3)])
def test_pad_letterboxes_the_whole_image_onto_the_background(size):
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (*size[::-1], 3), np.uint8))
    got = EvalPreprocess(PAD).crop(image)
    assert got.shape == (3, 32, 32) and got.dtype == np.uint8
    np.testing.assert_array_equal(got.transpose(1, 2, 0), letterbox_by_hand(image, 32, (255, 255, 255)))


def test_a_wide_images_ends_survive_pad_but_not_crop():
    """Two 300 x 84 symbols differing only at their ends: one input under crop (cosine 1.000 in any model),
    two inputs under pad."""
    treble, bass = wide_symbol("treble"), wide_symbol("bass")
    crop, pad = EvalPreprocess(CONFIG), EvalPreprocess(PAD)
    np.testing.assert_array_equal(crop(treble), crop(bass))
    assert np.abs(pad(treble) - pad(bass)).max() > 1.0
    bands = pad.crop(treble)[:, :5]  # a wide image gets background bands above and below
    assert (bands == 255).all()


def test_an_unknown_mode_is_refused_naming_the_modes():
    with pytest.raises(ValueError, match="must be one of crop, pad, got 'stretch'"):
        ModelPreprocessing.from_config(CONFIG.to_config() | {"resize": "stretch"})


def test_a_cropping_model_keeps_its_hash_and_a_letterboxing_one_gets_another():
    """Models from before the mode (no key) and crop models are the same model; pad embeds other pixels."""
    before = CONFIG.identity_digest().hexdigest()
    assert replace(CONFIG, resize="crop").identity_digest().hexdigest() == before
    assert PAD.identity_digest().hexdigest() != before


def test_pad_training_keeps_the_object_in_view():
    """The training variant letterboxes as evaluation does, then zooms and shifts mildly: a wide image's marks at
    both ends stay in the frame in every draw."""
    pixels = np.full((84, 300, 3), 255, np.uint8)
    pixels[:, :12] = (200, 0, 0)  # red at the left end, blue at the right
    pixels[:, -12:] = (0, 0, 200)
    image = Image.fromarray(pixels)
    transform = build_transforms(replace(PAD, input_size=64), train=True,
                                 augmentation=resolve_augmentation("crop-flip"), normalise=False)
    transform = pickle.loads(pickle.dumps(transform))  # DataLoader workers get a copy
    for seed in range(20):
        torch.manual_seed(seed)
        out = transform(image).numpy()
        assert out.shape == (3, 64, 64)
        red = (out[0] > 150) & (out[2] < 60)
        blue = (out[2] > 150) & (out[0] < 60)
        assert red.sum() > 10 and blue.sum() > 10, seed


def test_crop_training_is_unchanged_by_the_mode():
    image = Image.fromarray(np.random.default_rng(1).integers(0, 255, (50, 80, 3), np.uint8))
    augmentation = resolve_augmentation("crop-flip")
    torch.manual_seed(3)
    old = build_transforms(CONFIG, train=True, augmentation=augmentation)(image)
    torch.manual_seed(3)
    new = build_transforms(replace(CONFIG, resize="crop"), train=True, augmentation=augmentation)(image)
    assert torch.equal(old, new)


@pytest.mark.parametrize("augmentation", ["crop-flip", "none"])
def test_device_decoding_letterboxes_as_the_workers_do(tmp_path, augmentation):
    from device_batches import CONFIG as DEVICE_CONFIG
    from device_batches import both_pipelines
    from sample_images import save_jpeg, smooth_picture

    # wide and tall JPEGs (decoded on the device) and a transparent PNG (decoded by the workers, composited)
    paths = [save_jpeg(tmp_path / f"{i}.jpg", smooth_picture(60 + 41 * i, 300 - 37 * i, i)) for i in range(6)]
    rgba = np.zeros((50, 200, 4), np.uint8)
    rgba[10:40, 20:180] = (200, 30, 30, 255)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "clear.png")
    paths.append(str(tmp_path / "clear.png"))
    config = replace(DEVICE_CONFIG, resize="pad", background="black")
    cpu, images, labels, bad, encoded = both_pipelines(paths, augmentation, config=config)
    assert bad == [] and labels.tolist() == cpu.labels.tolist() and images.shape == cpu.inputs.shape
    assert [item.encoded for item in encoded.inputs.images] == [True] * 6 + [False]
    # the same size, place and flip: pixels differ by the resampling and the JPEG decoder only
    assert (images - cpu.inputs).abs().mean(dim=(1, 2, 3)).max() < 0.05
    # the margins are the model's background (black, normalised), as the workers' canvas is
    black = ((0 - torch.tensor(DEVICE_CONFIG.mean)) / torch.tensor(DEVICE_CONFIG.std)).view(3, 1)
    top, left, height, width = encoded.inputs.images[0].box
    margin = 0 if top > 0 else top + height  # a row above or below the wide image
    assert height < 64 and torch.allclose(images[0, :, margin, :], black.expand(3, 64), atol=1e-5)
    if augmentation == "crop-flip":  # another seed puts the images elsewhere: the comparison above would see it
        _, other, *_ = both_pipelines(paths, augmentation, seeds=[99 + i for i in range(7)], config=config)
        assert (other - cpu.inputs).abs().mean(dim=(1, 2, 3)).max() > 0.1


def test_the_feature_cache_tells_a_letterboxing_model_from_a_cropping_one(tmp_path):
    """Cached backbone features are of the pixels the mode gives: a pad run must not reuse a crop run's, and
    cropping keys made before the mode stay valid."""
    from train_configs import digits_config

    from retrieval.train.feature_cache import dataset_key

    class Model:
        preprocessing = CONFIG

    cfg = digits_config(tmp_path / "run", tmp_path / "cache")
    before = dataset_key(cfg, Model, "train")
    assert before["input_size"] == 32 and "background" not in before and "resize" not in before
    Model.preprocessing = replace(CONFIG, resize="crop")
    assert dataset_key(cfg, Model, "train") == before
    Model.preprocessing = PAD
    assert dataset_key(cfg, Model, "train") == before | {"resize": "pad"}
    Model.preprocessing = replace(CONFIG, background=(10, 20, 30))
    assert dataset_key(cfg, Model, "train") == before | {"background": [10, 20, 30]}
