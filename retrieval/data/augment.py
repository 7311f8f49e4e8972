"""Training augmentation as data: the ``Augmentation`` settings and the named presets (``AUGMENTATIONS``).

A leaf with no torch: ``TrainConfig`` validates and resolves augmentation without loading torch, and
``retrieval.data.transforms.build_transforms`` turns an ``Augmentation`` into torchvision v2 steps. The steps run
in this order: resize (shorter side ``input_size * RESIZE_RATIO``), random resized crop (or the evaluation's centre
crop), horizontal flip, auto-augment, colour jitter (both on uint8 pixels), then scale to float and normalise.

``color_jitter`` is one strength ``v`` for everything: brightness = contrast = saturation = ``v`` (factors drawn
from ``[max(0, 1 - v), 1 + v]``) and hue = ``min(v / 4, 0.5)``; 0 turns jitter off.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from retrieval.utils.registry import Registry

AUTO_AUGMENT_CHOICES = ("none", "trivial", "rand")  # trivial: v2.TrivialAugmentWide; rand: v2.RandAugment
DEFAULT_AUGMENTATION = "crop-flip"  # the pipeline of every run before augmentation was configurable
# where the steps run: in the DataLoader workers (transforms.build_transforms) or on the training device
# (device_decode: JPEG decoded there, the same crops and flips)
DECODE_ON_CHOICES = ("workers", "device")


class AugmentationError(ValueError):
    """Invalid augmentation settings; ``problems`` maps each bad field to what is wrong with it."""

    def __init__(self, problems: dict[str, str]) -> None:
        super().__init__("; ".join(f"{name} {problem}" for name, problem in problems.items()))
        self.problems = problems


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _pair(value: Any) -> tuple[float, float] | None:
    """``value`` as (min, max) floats, or None when it is not two finite numbers."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(_is_number(v) for v in value):
        return float(value[0]), float(value[1])
    return None


@dataclass(frozen=True)
class Augmentation:
    """The random changes made to a training image; see the module docstring for the order and ``color_jitter``."""

    crop_scale: tuple[float, float] = (0.08, 1.0)  # fraction of the (resized) image's area that the crop keeps
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)  # the crop's width / height before it is resized to a square
    flip: bool = True  # random horizontal flip
    color_jitter: float = 0.0  # 0 = off; brightness = contrast = saturation = value, hue = min(value / 4, 0.5)
    auto_augment: str | None = None  # None | "trivial" | "rand" ("none" is read as None)
    random_crop: bool = True  # False: the evaluation's centre crop (crop_scale and crop_ratio then unused)

    def __post_init__(self) -> None:
        problems = {}
        scale, ratio = _pair(self.crop_scale), _pair(self.crop_ratio)
        if scale is None or not 0 < scale[0] <= scale[1] <= 1:
            problems["crop_scale"] = ("must be MIN,MAX with 0 < MIN <= MAX <= 1 (the fraction of the image's area "
                                      f"a crop keeps), got {self.crop_scale!r}")
        if ratio is None or not 0 < ratio[0] <= ratio[1]:
            problems["crop_ratio"] = (f"must be MIN,MAX with 0 < MIN <= MAX (a crop's width / height), got "
                                      f"{self.crop_ratio!r}")
        if not _is_number(self.color_jitter) or self.color_jitter < 0:
            problems["color_jitter"] = f"must be a number >= 0 (0 = off), got {self.color_jitter!r}"
        if self.auto_augment is not None and self.auto_augment not in AUTO_AUGMENT_CHOICES:
            problems["auto_augment"] = f"must be one of {', '.join(AUTO_AUGMENT_CHOICES)}, got {self.auto_augment!r}"
        if not isinstance(self.flip, bool):
            problems["flip"] = f"must be true or false, got {self.flip!r}"
        if problems:
            raise AugmentationError(problems)
        # frozen: normalise through object.__setattr__ (lists from TOML become tuples, so presets compare equal)
        object.__setattr__(self, "crop_scale", scale)
        object.__setattr__(self, "crop_ratio", ratio)
        object.__setattr__(self, "color_jitter", float(self.color_jitter))
        object.__setattr__(self, "auto_augment", None if self.auto_augment == "none" else self.auto_augment)

    @property
    def hue(self) -> float:
        """The colour jitter's hue range: a quarter of its strength, at most 0.5 (torchvision's limit)."""
        return min(self.color_jitter / 4, 0.5)

    @property
    def random(self) -> bool:
        """Whether the pipeline draws random numbers at all."""
        return self.random_crop or self.flip or self.color_jitter > 0 or self.auto_augment is not None

    def describe(self) -> str:
        """One line for help texts and logs, e.g. ``crop scale 0.08-1 ratio 0.75-1.33, flip``."""
        parts = [f"crop scale {self.crop_scale[0]:g}-{self.crop_scale[1]:g} ratio {self.crop_ratio[0]:.3g}-"
                 f"{self.crop_ratio[1]:.3g}" if self.random_crop else "centre crop"]
        if self.flip:
            parts.append("flip")
        if self.color_jitter:
            parts.append(f"colour jitter {self.color_jitter:g}")
        if self.auto_augment:
            parts.append({"trivial": "TrivialAugmentWide", "rand": "RandAugment"}[self.auto_augment])
        return ", ".join(parts)


AUGMENTATIONS: Registry[Augmentation] = Registry("augmentation preset")


@AUGMENTATIONS.register("crop-flip")
def crop_flip() -> Augmentation:
    """torchvision's RandomResizedCrop defaults and a horizontal flip: the default, as before presets existed."""
    return Augmentation()


@AUGMENTATIONS.register("light")
def light() -> Augmentation:
    """Larger crops (at least 35% of the image) and a flip: for small or already centred objects."""
    return Augmentation(crop_scale=(0.35, 1.0))


@AUGMENTATIONS.register("strong")
def strong() -> Augmentation:
    """crop-flip, colour jitter 0.3 and TrivialAugmentWide."""
    return Augmentation(color_jitter=0.3, auto_augment="trivial")


@AUGMENTATIONS.register("none")
def no_augmentation() -> Augmentation:
    """No randomness: the evaluation's resize and centre crop."""
    return Augmentation(flip=False, random_crop=False)


def resolve_augmentation(preset: str = DEFAULT_AUGMENTATION, **overrides: Any) -> Augmentation:
    """The preset ``preset`` with ``overrides`` (Augmentation fields; None keeps the preset's value) applied."""
    base = AUGMENTATIONS.build(preset)
    unknown = set(overrides) - {f.name for f in dataclasses.fields(Augmentation)}
    if unknown:
        raise TypeError(f"unknown augmentation field(s) {sorted(unknown)}; known: "
                        f"{[f.name for f in dataclasses.fields(Augmentation)]}")
    changes = {name: value for name, value in overrides.items() if value is not None}
    crop = {"crop_scale", "crop_ratio"} & set(changes)
    if crop and not base.random_crop and not changes.get("random_crop"):
        # a crop range without a random crop would be silently ignored
        cropping = ", ".join(name for name in augmentation_names() if AUGMENTATIONS.build(name).random_crop)
        raise AugmentationError({name: f"sets a random crop, which the {preset!r} preset does not make (it centre-"
                                       f"crops like evaluation): choose a preset with a random crop ({cropping})"
                                 for name in sorted(crop)})
    return dataclasses.replace(base, **changes)


def augmentation_names() -> list[str]:
    """The preset names, the default first."""
    return [DEFAULT_AUGMENTATION] + [name for name in AUGMENTATIONS.names() if name != DEFAULT_AUGMENTATION]
