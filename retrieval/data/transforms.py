"""Image transforms from a model's ``ModelPreprocessing`` (input size, mean, std, background, resize mode).

Training augments with torchvision as an ``augment.Augmentation`` says (default: the crop-flip preset); evaluation
is ``eval_preprocess.EvalPreprocess`` (PIL and NumPy, no torch) returned as a tensor here, and also the plain
function ``preprocess_eval``, so that indexing, serving and the ONNX export all prepare images exactly as evaluation
does.
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image
from torchvision.transforms import v2

from retrieval.data.augment import DEFAULT_AUGMENTATION, Augmentation, resolve_augmentation
from retrieval.data.colour import FlattenAlpha
from retrieval.data.eval_preprocess import PAD, EvalPreprocess, letterboxed_size
from retrieval.data.preprocessing import ModelPreprocessing


def _normalize(preprocessing: ModelPreprocessing) -> v2.Normalize:
    return v2.Normalize(mean=list(preprocessing.mean), std=list(preprocessing.std))


class EvalTransform:
    """The evaluation preprocessing as a tensor: ``EvalPreprocess`` (the one definition), then ``from_numpy``."""

    def __init__(self, preprocessing: ModelPreprocessing) -> None:
        self.preprocess = EvalPreprocess(preprocessing)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return torch.from_numpy(self.preprocess(image))

    def __repr__(self) -> str:
        return f"EvalTransform({self.preprocess!r})"


PAD_SCALE = (0.8, 1.0)  # --resize pad's training: the letterboxed image's long side, a fraction of the input's


class Letterbox:
    """Transform step: an RGB PIL image's long side resized to ``size`` and centred on a ``size`` x ``size`` canvas
    of ``background`` (``EvalPreprocess``'s pad mode). With ``scale`` (training), the long side is drawn in
    ``scale`` x ``size`` and the image placed anywhere it fits whole, from torch's RNG (seeded per sample): the
    whole image always stays in view. Picklable for DataLoader workers."""

    def __init__(self, size: int, background: Any, scale: tuple[float, float] | None = None) -> None:
        self.size, self.background = int(size), tuple(int(c) for c in background)
        self.scale = scale

    def __call__(self, image: Image.Image) -> Image.Image:
        side = self.size
        if self.scale is not None:
            low, high = self.scale
            side = max(1, min(self.size, round(self.size * (low + (high - low) * float(torch.rand(1))))))
        width, height = letterboxed_size(image.width, image.height, side)
        if (width, height) != image.size:
            image = image.resize((width, height), resample=Image.BILINEAR)
        room_x, room_y = self.size - width, self.size - height
        if self.scale is None:
            left, top = room_x // 2, room_y // 2
        else:
            left, top = int(torch.randint(room_x + 1, ())), int(torch.randint(room_y + 1, ()))
        canvas = Image.new("RGB", (self.size, self.size), self.background)
        canvas.paste(image, (left, top))
        return canvas

    def __repr__(self) -> str:
        return f"Letterbox(size={self.size}, background={self.background}, scale={self.scale})"


def background_of(preprocessing: ModelPreprocessing) -> FlattenAlpha:
    """The step that composites transparent pixels onto the model's background (white for older models)."""
    return FlattenAlpha(preprocessing.background)


def colour_steps(preprocessing: ModelPreprocessing, augmentation: Augmentation) -> list[Any]:
    """The augmentation's auto-augment and colour jitter steps (uint8 pixels, PIL or tensor), in that order; the
    corners that rotations and shears uncover take the model's background colour, as transparent pixels do."""
    fill = tuple(int(c) for c in preprocessing.background)
    steps: list[Any] = []
    if augmentation.auto_augment == "trivial":
        steps.append(v2.TrivialAugmentWide(fill=fill))
    elif augmentation.auto_augment == "rand":
        steps.append(v2.RandAugment(fill=fill))
    if augmentation.color_jitter:
        value = augmentation.color_jitter
        steps.append(v2.ColorJitter(brightness=value, contrast=value, saturation=value, hue=augmentation.hue))
    return steps


def build_transforms(
    preprocessing: ModelPreprocessing, train: bool, augmentation: Augmentation | None = None, normalise: bool = True
) -> v2.Compose | EvalTransform:
    """PIL image (RGB or RGBA) -> float32 tensor [3, S, S], normalised; ``augmentation`` when ``train`` (None: the
    default preset, crop-flip). ``normalise=False`` (train only): the uint8 pixels [3, S, S] before scaling and
    normalising, for ``ScaleAndNormalise`` to finish on the training device."""
    if not train:
        return EvalTransform(preprocessing)
    aug = augmentation if augmentation is not None else resolve_augmentation(DEFAULT_AUGMENTATION)
    size = preprocessing.input_size
    background = background_of(preprocessing)
    if preprocessing.resize_mode == PAD:
        # the whole image letterboxed as evaluation does; a random crop becomes a random size and place within the
        # square: the whole object stays in view
        steps: list[Any] = [background, Letterbox(size, background.background, PAD_SCALE if aug.random_crop else None)]
    else:
        steps = [background, v2.Resize(preprocessing.short_side, antialias=True)]
        if aug.random_crop:
            steps.append(v2.RandomResizedCrop(size, scale=aug.crop_scale, ratio=aug.crop_ratio, antialias=True))
        else:
            steps.append(v2.CenterCrop(size))
    if aug.flip:
        steps.append(v2.RandomHorizontalFlip())
    # auto-augment and jitter work on uint8 pixels (PIL here), so they come before scaling and normalising
    steps += colour_steps(preprocessing, aug)
    steps.append(v2.ToImage())
    if normalise:
        steps += [v2.ToDtype(torch.float32, scale=True), _normalize(preprocessing)]
    # every op above draws from torch's global RNG, which CatchBadSamples seeds per sample
    return v2.Compose(steps)


class ScaleAndNormalise:
    """uint8 images [B, 3, H, W] -> float32, scaled to [0, 1] and normalised with the model's mean and std: the last
    two steps of the train pipeline, on the device that holds the images (255 folded into the mean and std)."""

    def __init__(self, preprocessing: ModelPreprocessing, device: torch.device | str) -> None:
        self.mean = torch.tensor(preprocessing.mean, device=device).view(1, 3, 1, 1) * 255.0
        self.std = torch.tensor(preprocessing.std, device=device).view(1, 3, 1, 1) * 255.0

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """A new float32 tensor from uint8 ``images``; float32 ``images`` (pixel values 0-255) in place."""
        out = images if images.dtype == torch.float32 else images.float()
        return out.sub_(self.mean).div_(self.std)


def preprocess_eval(image: Image.Image, preprocessing: ModelPreprocessing) -> torch.Tensor:
    """The evaluation preprocessing of one image: flatten transparency, resize, centre crop, scale, normalise."""
    return EvalTransform(preprocessing)(image)
