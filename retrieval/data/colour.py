"""Background colours and transparency: ``parse_background`` and compositing transparent pixels onto a colour.

The decoder keeps transparency (RGBA); ``FlattenAlpha``, the first step of every preprocessing pipeline
(``retrieval.data.transforms``), composites it onto the model's background colour, so that the colour is a model
setting recorded with the model like mean and std. Light: Pillow only (``TrainConfig`` parses its colour here).
"""

from __future__ import annotations

from collections.abc import Sequence

from PIL import Image, ImageColor

DEFAULT_BACKGROUND = (255, 255, 255)  # transparent pixels become white unless a model says otherwise


def parse_background(value: str | Sequence[int] | None) -> tuple[int, int, int]:
    """A background colour as RGB: a name (``white``), ``#RRGGBB``, ``R,G,B``, or a 3-sequence of 0..255."""
    if value is None:
        return DEFAULT_BACKGROUND
    if isinstance(value, str):
        text = value.strip()
        try:
            if "," in text:
                parts = tuple(int(p) for p in text.split(","))
            else:
                parts = tuple(ImageColor.getrgb(text))[:3]
        except ValueError as exc:
            raise ValueError(
                f"background colour {value!r} is not a colour; use a name (white), #RRGGBB or R,G,B"
            ) from exc
    else:
        parts = tuple(int(p) for p in value)
    if len(parts) != 3 or not all(0 <= p <= 255 for p in parts):
        raise ValueError(f"background colour must be 3 numbers in 0..255, got {value!r}")
    return parts  # type: ignore[return-value]


def has_alpha(image: Image.Image) -> bool:
    """Whether ``image`` has transparency: an alpha band, or a colour key (``transparency`` in its info)."""
    return image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info


def flatten_alpha(image: Image.Image, background: Sequence[int] = DEFAULT_BACKGROUND) -> Image.Image:
    """An RGB image: transparent pixels composited onto ``background`` (an RGB image is returned as it is)."""
    if image.mode == "RGB":
        return image
    if not has_alpha(image):
        return image.convert("RGB")
    rgba = image if image.mode == "RGBA" else image.convert("RGBA")
    canvas = Image.new("RGB", rgba.size, tuple(int(c) for c in background))
    canvas.paste(rgba, mask=rgba.getchannel("A"))
    return canvas


class FlattenAlpha:
    """Transform step: ``flatten_alpha`` with a fixed background (picklable for DataLoader workers)."""

    def __init__(self, background: Sequence[int] = DEFAULT_BACKGROUND) -> None:
        self.background = parse_background(background)

    def __call__(self, image: Image.Image) -> Image.Image:
        return flatten_alpha(image, self.background) if isinstance(image, Image.Image) else image

    def __repr__(self) -> str:
        return f"FlattenAlpha(background={self.background})"
