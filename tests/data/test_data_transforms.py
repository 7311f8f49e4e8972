"""Transforms: output shape/dtype/normalisation; eval is deterministic and equals preprocess_eval."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from retrieval.data import build_transforms, preprocess_eval
from retrieval.data.preprocessing import ModelPreprocessing

CONFIG = ModelPreprocessing(input_size=32, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))


def test_eval_matches_a_manual_reference():
    image = Image.new("RGB", (40, 60), (255, 102, 0))
    out = preprocess_eval(image, CONFIG)
    assert out.shape == (3, 32, 32) and out.dtype == torch.float32
    expected = [(1.0 - 0.5) / 0.2, (0.4 - 0.4) / 0.25, (0.0 - 0.3) / 0.3]
    assert torch.allclose(out.mean(dim=(1, 2)), torch.tensor(expected), atol=1e-5)
    assert torch.equal(build_transforms(CONFIG, train=False)(image), out)


def test_eval_centre_crops_after_resize():
    array = np.zeros((40, 80, 3), np.uint8)
    array[:, 40:] = 255  # left half black, right half white
    out = preprocess_eval(
        Image.fromarray(array).convert("L"), replace(CONFIG, mean=(0, 0, 0), std=(1, 1, 1))
    )
    # Resize short side to 36 (72x36), centre crop 32: columns 20..51, the middle is the edge.
    assert out[:, :, :12].max() < 0.05 and out[:, :, 20:].min() > 0.95


def test_train_is_random_and_right_shape():
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (50, 70, 3), dtype=np.uint8))
    train = build_transforms(CONFIG, train=True)
    torch.manual_seed(0)
    a = train(image)
    b = train(image)
    assert a.shape == b.shape == (3, 32, 32) and not torch.equal(a, b)


def test_timm_style_size_and_errors():
    timm_style = ModelPreprocessing.from_config({**CONFIG.to_config(), "input_size": (3, 16, 16)})
    assert preprocess_eval(Image.new("RGB", (10, 10)), timm_style).shape == (3, 16, 16)
    with pytest.raises(ValueError, match="input_size"):
        ModelPreprocessing.from_config({**CONFIG.to_config(), "input_size": None})
    with pytest.raises(ValueError, match="mean"):
        ModelPreprocessing.from_config({"input_size": 8})
    with pytest.raises(ValueError, match=r"model_config\['std'\] must be non-zero"):
        replace(CONFIG, std=(1, 0, 1))


def torchvision_eval(config):
    """The evaluation pipeline as torchvision's v2 steps (what EvalPreprocess replaced): the reference."""
    from torchvision.transforms import v2

    from retrieval.data.transforms import background_of

    size = config.input_size
    return v2.Compose([background_of(config), v2.Resize(int(size * 1.14), antialias=True), v2.CenterCrop(size),
                       v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                       v2.Normalize(mean=list(config.mean), std=list(config.std))])


def random_images(count: int):
    """Photos-like and odd images: every orientation, sizes near the crop, tiny ones, grey, RGBA, palette."""
    rng = np.random.default_rng(0)
    for i in range(count):
        w, h = (int(v) for v in rng.integers(1, 300, 2))
        pixels = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
        mode = ("RGB", "RGBA", "L", "P", "LA")[i % 5]
        image = Image.fromarray(pixels, "RGBA")
        yield image.convert(mode) if mode != "RGBA" else image


@pytest.mark.parametrize("size", [1, 7, 32, 64, 224])
def test_eval_preprocess_equals_torchvision_bit_for_bit(size):
    from retrieval.data.eval_preprocess import EvalPreprocess

    config = replace(CONFIG, input_size=size, background=(20, 200, 90))
    reference, ours = torchvision_eval(config), EvalPreprocess(config)
    images = list(random_images(60)) + [Image.new("RGB", (size, size)), Image.new("RGB", (int(size * 1.14), 500))]
    for image in images:
        expected = reference(image).numpy()
        got = ours(image)
        assert got.dtype == np.float32 and got.shape == expected.shape == (3, size, size)
        assert np.array_equal(got, expected), (image.size, image.mode)


def test_crop_then_batched_normalize_equals_the_whole_preprocess():
    """Ray's decode tasks ship uint8 crops and the actor normalises a batch: the input must not change a bit."""
    from retrieval.data.eval_preprocess import EvalPreprocess

    preprocess = EvalPreprocess(replace(CONFIG, input_size=24, background=(20, 200, 90)))
    images = list(random_images(40))
    crops = np.stack([preprocess.crop(image) for image in images])
    assert crops.dtype == np.uint8 and crops.shape == (40, 3, 24, 24)
    batched = preprocess.normalize(crops)
    assert batched.dtype == np.float32
    for image, row in zip(images, batched, strict=True):
        assert np.array_equal(row, preprocess(image)), (image.size, image.mode)


def test_normalize_rejects_what_crop_does_not_make():
    from retrieval.data.eval_preprocess import EvalPreprocess

    preprocess = EvalPreprocess(replace(CONFIG, input_size=8))
    with pytest.raises(ValueError, match="uint8"):
        preprocess.normalize(np.zeros((2, 3, 8, 8), np.float32))
    with pytest.raises(ValueError, match=r"3, 8, 8"):
        preprocess.normalize(np.zeros((2, 3, 9, 8), np.uint8))


def test_eval_preprocess_needs_no_torch(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys; import numpy as np; from PIL import Image\n"
        "from retrieval.data.eval_preprocess import EvalPreprocess\n"
        "from retrieval.data.preprocessing import ModelPreprocessing\n"
        "config = ModelPreprocessing.from_config({'input_size': 16, 'mean': (0.5,) * 3, 'std': (0.5,) * 3})\n"
        "out = EvalPreprocess(config)(Image.new('RGBA', (30, 20)))\n"
        "assert out.shape == (3, 16, 16)\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'torchvision')], 'torch was imported'\n"
    )
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-2000:]
