"""Training augmentation from the configuration: presets, build_transforms, TrainConfig, TOML and the command line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from sample_images import NoisePictures
from torchvision.transforms import v2

from retrieval.cli.main import main
from retrieval.data import build_transforms
from retrieval.data.augment import (
    AUGMENTATIONS,
    DEFAULT_AUGMENTATION,
    Augmentation,
    AugmentationError,
    resolve_augmentation,
)
from retrieval.data.colour import FlattenAlpha
from retrieval.data.eval_preprocess import RESIZE_RATIO
from retrieval.data.preprocessing import ModelPreprocessing
from retrieval.data.transforms import ScaleAndNormalise
from retrieval.train.config import TrainConfig

CONFIG = ModelPreprocessing(input_size=32, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))


def rgb(width: int = 50, height: int = 70, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8))


def rgba(width: int = 50, height: int = 70, seed: int = 1) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 4), dtype=np.uint8), "RGBA")


def old_train_pipeline(preprocessing: ModelPreprocessing) -> v2.Compose:
    """build_transforms(train=True) as it was hard-coded before augmentation was configurable."""
    size = preprocessing.input_size
    return v2.Compose(
        [
            FlattenAlpha((255, 255, 255)), v2.Resize(int(size * RESIZE_RATIO), antialias=True),
            v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(), v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean=preprocessing.mean, std=preprocessing.std),
        ]
    )


def run(transform, image: Image.Image, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return transform(image)


@pytest.mark.parametrize("augmentation", [None, resolve_augmentation(DEFAULT_AUGMENTATION)])
def test_the_default_reproduces_the_old_hard_coded_pipeline_bit_for_bit(augmentation):
    new, old = build_transforms(CONFIG, train=True, augmentation=augmentation), old_train_pipeline(CONFIG)
    for seed in range(20):  # enough seeds for both flip outcomes and many crops
        for image in (rgb(), rgba()):
            assert torch.equal(run(new, image, seed), run(old, image, seed))


def test_crop_scale_and_ratio_are_used():
    # the whole (square) image, squashed to the input size: no randomness left, equal to a plain resize
    full = resolve_augmentation("crop-flip", crop_scale=(1, 1), crop_ratio=(1, 1), flip=False)
    transform = build_transforms(CONFIG, train=True, augmentation=full)
    image = rgb(60, 60)
    resize = v2.Compose([v2.Resize(int(32 * RESIZE_RATIO), antialias=True), v2.Resize(32, antialias=True),
                         v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                         v2.Normalize(mean=CONFIG.mean, std=CONFIG.std)])
    expected = resize(image)
    assert all(torch.equal(run(transform, image, seed), expected) for seed in range(5))
    crop = next(step for step in build_transforms(CONFIG, train=True, augmentation=resolve_augmentation("light"))
                .transforms if isinstance(step, v2.RandomResizedCrop))
    assert crop.scale == (0.35, 1.0) and crop.ratio == (0.75, 4 / 3)


@pytest.mark.parametrize("preset", AUGMENTATIONS.names())
@pytest.mark.parametrize("image", [rgb(), rgba(), rgb(20, 90).convert("L")], ids=["rgb", "rgba", "grey"])
def test_every_preset_builds_and_gives_normalised_float_images(preset, image):
    transform = build_transforms(CONFIG, train=True, augmentation=resolve_augmentation(preset))
    for seed in range(3):
        out = run(transform, image, seed)
        assert out.shape == (3, 32, 32) and out.dtype == torch.float32 and torch.isfinite(out).all()


@pytest.mark.parametrize("preset", ["strong", "light", "crop-flip"])
def test_the_same_seed_gives_the_same_augmentation(preset):
    augmentation = resolve_augmentation(preset)
    first, second = (build_transforms(CONFIG, train=True, augmentation=augmentation) for _ in range(2))
    outputs = [run(first, rgba(), seed) for seed in range(8)]
    assert all(torch.equal(run(second, rgba(), seed), out) for seed, out in enumerate(outputs))
    assert not all(torch.equal(outputs[0], out) for out in outputs[1:])  # and it does vary with the seed


def test_strong_draws_only_from_torch():
    # the pipeline's randomness is torch's global RNG (what CatchBadSamples seeds per sample), not Python's
    transform = build_transforms(CONFIG, train=True, augmentation=resolve_augmentation("strong"))
    import random

    random.seed(1)
    a = run(transform, rgb(), 7)
    random.seed(2)
    assert torch.equal(run(transform, rgb(), 7), a)


def test_a_sample_seed_fixes_its_augmentation_without_seeding_the_accelerators(monkeypatch):
    """Seeding every device queues a lazy seed and formats a stack trace for each, per sample: the CPU's alone."""
    from retrieval.data.dataset import CatchBadSamples

    calls = []
    for module in (torch.cuda, torch.xpu, torch.mtia):
        monkeypatch.setattr(module, "manual_seed_all", lambda seed, name=module.__name__: calls.append(name))
    transform = build_transforms(CONFIG, train=True, augmentation=resolve_augmentation("strong"))

    class Augmented:
        def __getitem__(self, index):
            return transform(rgb()), 0

    samples = CatchBadSamples(Augmented())
    torch.manual_seed(123)
    calls.clear()
    before = torch.get_rng_state()
    first, again, other = (samples[(i, seed)][1][0] for i, seed in ((0, 5), (1, np.int64(5)), (2, 6)))
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert calls == []
    assert torch.equal(torch.get_rng_state(), before)  # the caller's random stream is left as it was


def test_none_is_the_evaluation_preprocessing():
    transform = build_transforms(CONFIG, train=True, augmentation=resolve_augmentation("none"))
    evaluation = build_transforms(CONFIG, train=False)
    for image in (rgb(), rgba()):
        assert torch.allclose(run(transform, image, 0), evaluation(image), atol=1e-5)
        assert torch.equal(run(transform, image, 0), run(transform, image, 1))


def test_presets_and_overrides():
    assert resolve_augmentation("crop-flip") == Augmentation()
    assert resolve_augmentation("crop-flip") == Augmentation(crop_scale=[0.08, 1], crop_ratio=[0.75, 4 / 3])
    light = resolve_augmentation("light")
    assert light.crop_scale == (0.35, 1.0) and light.flip and not light.color_jitter and light.auto_augment is None
    strong = resolve_augmentation("strong")
    assert strong.color_jitter == 0.3 and strong.auto_augment == "trivial" and strong.crop_scale == (0.08, 1.0)
    assert strong.hue == 0.075 and Augmentation(color_jitter=5).hue == 0.5
    assert not resolve_augmentation("none").random and resolve_augmentation("crop-flip").random
    # None keeps the preset's value; "none" turns auto-augment off
    assert resolve_augmentation("strong", crop_scale=None, color_jitter=None) == strong
    assert resolve_augmentation("strong", auto_augment="none").auto_augment is None
    assert resolve_augmentation("light", color_jitter=0.2, auto_augment="rand").color_jitter == 0.2
    with pytest.raises(KeyError, match="available: crop-flip, light, none, strong"):
        resolve_augmentation("heavy")
    with pytest.raises(AugmentationError, match="crop_scale sets a random crop.*'none' preset"):
        resolve_augmentation("none", crop_scale=(0.5, 1))
    with pytest.raises(AugmentationError, match="crop_scale must be MIN,MAX with 0 < MIN <= MAX <= 1"):
        Augmentation(crop_scale=(0.5, 1.5))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"augment": "heavy"}, "--augment must be one of crop-flip, light, none, strong, got 'heavy'"),
        ({"crop_scale": [0, 1]}, "--crop-scale must be MIN,MAX with 0 < MIN <= MAX <= 1"),
        ({"crop_scale": [0.9, 0.5]}, "--crop-scale must be MIN,MAX with 0 < MIN <= MAX <= 1"),
        ({"crop_scale": [0.5, 1.2]}, "--crop-scale must be MIN,MAX with 0 < MIN <= MAX <= 1"),
        ({"crop_scale": [0.5]}, "--crop-scale must be MIN,MAX"),
        ({"crop_ratio": [0, 1]}, "--crop-ratio must be MIN,MAX with 0 < MIN <= MAX"),
        ({"crop_ratio": [2, 1]}, "--crop-ratio must be MIN,MAX with 0 < MIN <= MAX"),
        ({"color_jitter": -0.1}, "--color-jitter must be a number >= 0"),
        ({"auto_augment": "auto"}, "--auto-augment must be one of none, trivial, rand, got 'auto'"),
        ({"augment": "none", "crop_ratio": [1, 1]}, "--crop-ratio sets a random crop"),
        ({"augment": "strong", "freeze_backbone": True}, "--freeze-backbone trains on backbone features computed "
                                                         "once, without augmentation"),
        ({"color_jitter": 0.2, "freeze_backbone": True}, "--freeze-backbone"),
    ],
)
def test_train_config_refuses_bad_augmentation(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**fields)


def test_train_config_resolves_the_augmentation():
    assert TrainConfig().augment == "crop-flip" and TrainConfig().augmentation() == Augmentation()
    cfg = TrainConfig(augment="strong", crop_scale=[0.3, 1], auto_augment="rand")
    assert cfg.augmentation() == Augmentation(crop_scale=(0.3, 1), color_jitter=0.3, auto_augment="rand")
    # cached features are not augmented: the default and "none" are what they get anyway
    assert TrainConfig(freeze_backbone=True).augmentation() == Augmentation()
    assert not TrainConfig(augment="none", freeze_backbone=True).augmentation().random
    assert TrainConfig(**TrainConfig(augment="light", color_jitter=0.1).to_dict()).augmentation().color_jitter == 0.1


def test_toml_file_with_augmentation(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('augment = "light"\ncrop-ratio = [0.5, 2.0]\ncolor_jitter = 0.2\nauto_augment = "trivial"\n')
    augmentation = TrainConfig.from_sources(path).augmentation()
    assert augmentation == Augmentation(crop_scale=(0.35, 1), crop_ratio=(0.5, 2), color_jitter=0.2,
                                        auto_augment="trivial")
    path.write_text('crop_scale = 0.5\n')
    with pytest.raises(ValueError, match="--crop-scale must be MIN,MAX"):
        TrainConfig.from_sources(path)


@pytest.fixture
def captured_train(monkeypatch) -> list[TrainConfig]:
    """`retrieval train` with a train() that only records the configuration it was given."""
    import retrieval.train

    configs: list[TrainConfig] = []
    monkeypatch.setattr(retrieval.train, "train", lambda cfg: configs.append(cfg))
    return configs


def test_command_line_options_reach_the_config(captured_train, tmp_path):
    args = ["train", "--augment", "strong", "--crop-scale", "0.35,1", "--crop-ratio", "0.5,2", "--color-jitter",
            "0.1", "--auto-augment", "rand", "--out", str(tmp_path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    (cfg,) = captured_train
    assert (cfg.augment, cfg.crop_scale, cfg.crop_ratio, cfg.color_jitter, cfg.auto_augment) == (
        "strong", [0.35, 1.0], [0.5, 2.0], 0.1, "rand")
    assert cfg.augmentation() == Augmentation(crop_scale=(0.35, 1), crop_ratio=(0.5, 2), color_jitter=0.1,
                                              auto_augment="rand")


def test_command_line_options_override_the_file(captured_train, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('augment = "strong"\ncrop_scale = [0.2, 1.0]\n')
    result = CliRunner().invoke(main, ["train", "--config", str(path), "--crop-scale", "0.5,1", "--out",
                                       str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert captured_train[0].augmentation() == Augmentation(crop_scale=(0.5, 1), color_jitter=0.3,
                                                            auto_augment="trivial")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--crop-scale", "0.35"], "expected MIN,MAX (two numbers with a comma, e.g. 0.35,1), got '0.35'"),
        (["--crop-ratio", "a,b"], "expected MIN,MAX"),
        (["--crop-scale", "0.5,1,1"], "expected MIN,MAX"),
        (["--auto-augment", "auto"], "'auto' is not one of 'none', 'trivial', 'rand'"),
        (["--augment", "heavy"], "--augment must be one of crop-flip, light, none, strong"),
        (["--crop-scale", "0.5,2"], "--crop-scale must be MIN,MAX with 0 < MIN <= MAX <= 1"),
        (["--augment", "strong", "--freeze-backbone"], "--freeze-backbone trains on backbone features"),
    ],
)
def test_command_line_errors(captured_train, args, message):
    result = CliRunner().invoke(main, ["train", *args])
    assert result.exit_code != 0 and message in result.output, result.output
    assert not captured_train


def test_train_help_lists_the_presets():
    result = CliRunner().invoke(main, ["train", "--help"], terminal_width=200)
    text = " ".join(result.output.split())  # help lines wrap
    assert result.exit_code == 0
    assert "crop-flip (default): crop scale 0.08-1 ratio 0.75-1.33, flip;" in text
    assert "strong: crop scale 0.08-1 ratio 0.75-1.33, flip, colour jitter 0.3, TrivialAugmentWide" in text


def test_the_feature_sources_take_the_augmentation():
    from retrieval.train.features import CachedFeatures, ImagePipeline

    strong = resolve_augmentation("strong")
    steps = ImagePipeline.train_transform(CONFIG, strong).transforms
    assert any(isinstance(step, v2.TrivialAugmentWide) for step in steps)
    assert any(isinstance(step, v2.ColorJitter) for step in steps)
    image = rgb()
    assert torch.equal(CachedFeatures.train_transform(CONFIG, strong)(image), build_transforms(CONFIG, False)(image))


@pytest.mark.parametrize("preset", AUGMENTATIONS.names())
def test_uint8_pixels_normalised_on_arrival_equal_the_workers_float_images(preset):
    augmentation = resolve_augmentation(preset)
    floats = build_transforms(CONFIG, train=True, augmentation=augmentation)
    pixels = build_transforms(CONFIG, train=True, augmentation=augmentation, normalise=False)
    mean, std = (torch.tensor(values, dtype=torch.float64).view(3, 1, 1) for values in (CONFIG.mean, CONFIG.std))
    for seed in range(6):
        for image in (rgb(), rgba()):
            raw = run(pixels, image, seed)
            assert raw.dtype == torch.uint8 and raw.shape == (3, 32, 32)
            arrived = ScaleAndNormalise(CONFIG, "cpu")(raw[None])[0]
            reference = (raw.double() / 255 - mean) / std
            torch.testing.assert_close(arrived.double(), reference, rtol=0, atol=1e-5)
            torch.testing.assert_close(arrived, run(floats, image, seed), rtol=0, atol=1e-5)


def pipeline_batches(monkeypatch, on_arrival: bool, transform_for: bool | None = None) -> tuple[object, list]:
    """One epoch of ``ImagePipeline`` batches, with the uint8 hand-over on (as on a GPU) or off, and its transform
    (made for the hand-over or not as ``transform_for`` says; by default as the pipeline)."""
    from retrieval.data import BadImageLog, ClassBalancedBatchSampler
    from retrieval.train import features

    cfg = TrainConfig(dataset="digits", seed=3)
    embedding = features.Embedding(torch.device("cpu"), 8, workers=0, amp=False, progress=False,
                                   bad_images=BadImageLog("skip"))
    monkeypatch.setattr(features, "normalises_on_arrival",
                        lambda device: on_arrival if transform_for is None else transform_for)
    transform = features.ImagePipeline.train_transform(CONFIG, cfg.augmentation(), embedding.device)
    monkeypatch.setattr(features, "normalises_on_arrival", lambda device: on_arrival)
    pipeline = features.ImagePipeline(cfg, NoisePictures(transform), None, embedding, CONFIG)
    sampler = ClassBalancedBatchSampler(np.arange(12) % 4, 2, 3, seed=1, batches_per_epoch=3)
    try:
        return transform, list(pipeline.batches(sampler, 0, 0))
    finally:
        pipeline.close()


def test_on_a_gpu_the_workers_hand_over_uint8_and_the_step_gets_the_same_images(monkeypatch):
    from retrieval.train.features import normalises_on_arrival

    assert normalises_on_arrival(torch.device("cuda")) and not normalises_on_arrival(torch.device("cpu"))
    handed, on_arrival = pipeline_batches(monkeypatch, True)
    kept, in_workers = pipeline_batches(monkeypatch, False)
    assert handed(rgb()).dtype == torch.uint8 and kept(rgb()).dtype == torch.float32
    assert len(on_arrival) == len(in_workers) == 3
    for (images, labels, bad), (expected, expected_labels, expected_bad) in zip(on_arrival, in_workers, strict=True):
        assert images.dtype == torch.float32 and torch.equal(labels, expected_labels) and bad == expected_bad == 0
        torch.testing.assert_close(images, expected, rtol=0, atol=1e-5)


def test_float_images_where_uint8_are_expected_are_refused_not_normalised_twice(monkeypatch):
    with pytest.raises(TypeError, match="not uint8 pixels: build the train set's transform with"):
        pipeline_batches(monkeypatch, True, transform_for=False)


def test_fine_tuning_trains_with_the_configured_augmentation(tmp_path):
    import json

    from retrieval.train import train

    cfg = TrainConfig(dataset="digits", backbone="resnet18", pretrained=False, image_size=32, embedding_dim=16,
                      loss="triplet", batch_size=8, per_class=2, epochs=1, batches_per_epoch=2, workers=0,
                      eval_limit=40, eval_before=False, plots=False, out=str(tmp_path / "run"), augment="strong",
                      crop_scale=[0.5, 1.0])
    report = train(cfg, progress=False)
    assert report["history"][-1]["steps"] == 2
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    assert (saved["augment"], saved["crop_scale"]) == ("strong", [0.5, 1.0])
