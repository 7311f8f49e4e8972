"""The evaluation preprocessing in PIL and NumPy, without torch: the one definition of what an image becomes
before a model sees it (evaluation, indexing with either engine, the ONNX runtime, serving).

PIL image -> composite transparency onto the model's background -> the model's ``resize`` mode -> float32 in
[0, 1] -> (x - mean) / std, channels first: float32 [3, S, S]. The modes:

- ``crop`` (the default, and every model's before the mode existed): resize the short side to ``int(1.14 * S)``
  (bilinear, PIL's antialiased resampling), then centre crop S x S. This is torchvision's ``v2.Resize / CenterCrop /
  ToImage / ToDtype(scale=True) / Normalize`` on a PIL image, step for step and bit for bit
  (tests/data/test_data_transforms.py). A wide or tall image keeps only its middle.
- ``pad``: the whole image, its long side resized to S, centred on an S x S canvas of the background colour
  (letterboxed): nothing is cut, a wide image gets bands above and below.

It is written without torch so that processes that only decode and preprocess (Ray Data's decode tasks) do not
spend seconds importing torch and torchvision.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from retrieval.data.colour import flatten_alpha
from retrieval.data.preprocessing import RESIZE_RATIO, ModelPreprocessing, resized_size
from retrieval.data.resize_modes import CROP, PAD, RESIZE_MODES

__all__ = ["CROP", "PAD", "RESIZE_MODES", "RESIZE_RATIO", "EvalPreprocess", "letterboxed_size", "resized_size"]


def letterboxed_size(width: int, height: int, side: int) -> tuple[int, int]:
    """(width, height) with the long side at ``side`` and the short one scaled (rounded, at least 1 pixel)."""
    scale = side / max(width, height)
    return max(1, min(side, round(width * scale))), max(1, min(side, round(height * scale)))


class EvalPreprocess:
    """``EvalPreprocess(preprocessing)(pil_image) -> float32 [3, S, S]``; picklable for worker processes."""

    def __init__(self, preprocessing: ModelPreprocessing) -> None:
        self.size = preprocessing.input_size
        self.short_side = preprocessing.short_side
        self.mean = np.asarray(preprocessing.mean, np.float32).reshape(3, 1, 1)
        self.std = np.asarray(preprocessing.std, np.float32).reshape(3, 1, 1)
        self.background = preprocessing.background
        self.resize = preprocessing.resize_mode

    def __call__(self, image: Image.Image) -> np.ndarray:
        return self.normalize(self.crop(image))

    def crop(self, image: Image.Image) -> np.ndarray:
        """The geometric steps alone (background, then the resize mode: centre crop or letterbox): uint8
        [3, S, S], a quarter of the bytes of the model input, for stages that hand pixels to another process (Ray's
        decode tasks)."""
        if not isinstance(image, Image.Image):
            raise TypeError(f"the evaluation preprocessing takes a PIL image, got {type(image).__name__}")
        image = flatten_alpha(image, self.background)
        if self.resize == PAD:
            return self._letterbox(image)
        new_size = resized_size(image.width, image.height, self.short_side)
        if new_size != image.size:
            image = image.resize(new_size, resample=Image.BILINEAR)
        top = int(round((image.height - self.size) / 2.0))  # the resized short side is >= S: no padding
        left = int(round((image.width - self.size) / 2.0))
        image = image.crop((left, top, left + self.size, top + self.size))
        return np.ascontiguousarray(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))

    def _letterbox(self, image: Image.Image) -> np.ndarray:
        """The whole RGB ``image``, its long side at S, centred on an S x S canvas of the background colour."""
        new_size = letterboxed_size(image.width, image.height, self.size)
        if new_size != image.size:
            image = image.resize(new_size, resample=Image.BILINEAR)
        canvas = Image.new("RGB", (self.size, self.size), tuple(int(c) for c in self.background))
        canvas.paste(image, ((self.size - image.width) // 2, (self.size - image.height) // 2))
        return np.ascontiguousarray(np.asarray(canvas, dtype=np.uint8).transpose(2, 0, 1))

    def normalize(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 [..., 3, S, S] from ``crop`` -> the model input, float32 (x / 255 - mean) / std, same shape; the
        same float32 operations per element whether one image or a batch, so the result is identical."""
        if pixels.dtype != np.uint8 or pixels.shape[-3:] != (3, self.size, self.size):
            raise ValueError(f"normalize takes uint8 [..., 3, {self.size}, {self.size}], got {pixels.dtype} "
                             f"{list(pixels.shape)}")
        scaled = pixels.astype(np.float32)
        scaled *= np.float32(1.0 / 255.0)
        scaled -= self.mean  # in place: the same float32 operations, without two batch-sized temporaries
        scaled /= self.std
        return scaled

    def __repr__(self) -> str:
        return f"EvalPreprocess(size={self.size}, resize={self.resize}, background={self.background})"
