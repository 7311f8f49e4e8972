"""The duplicate and audit pictures draw each image as the model sees it: transparent pixels on the model's
background colour (white by default), never on the hidden colour under them (black, as most exporters leave it)."""

from __future__ import annotations

import numpy as np
from PIL import Image

from retrieval.analysis.neighbour_pictures import duplicates_picture, suspects_picture
from retrieval.data.colour import DEFAULT_BACKGROUND
from retrieval.data.preprocessing import ModelPreprocessing
from retrieval.index.curation.catalogued_images import picture_background
from retrieval.index.query_embedder import NoModel


def dark_symbol(size: int = 96) -> Image.Image:
    """A small dark cross on a fully transparent background whose hidden RGB is black."""
    pixels = np.zeros((size, size, 4), np.uint8)
    middle = size // 2
    pixels[middle - 4:middle + 4, size // 4:3 * size // 4] = (20, 20, 30, 255)
    pixels[size // 4:3 * size // 4, middle - 4:middle + 4] = (20, 20, 30, 255)
    return Image.fromarray(pixels, "RGBA")


def on(colour: tuple[int, int, int]) -> Image.Image:
    """The dark symbol as the model sees it: composited onto ``colour``."""
    symbol = dark_symbol()
    canvas = Image.new("RGB", symbol.size, colour)
    canvas.paste(symbol, mask=symbol.getchannel("A"))
    return canvas


def black_share(picture: Image.Image) -> float:
    """The share of the picture's pixels that are black (every channel below 8)."""
    return float((np.asarray(picture.convert("RGB")).max(axis=2) < 8).mean())


SUMMARY = {"threshold": 0.95, "groups_found": 1,
           "groups": [{"ids": [1, 2, 3], "similarities": [1.0, 0.99, 0.98]}]}
SUSPECTS = {"suspects_found": 1, "suspects": [
    {"id": 1, "label": "a", "suggested": "b", "score": 0.5,
     "neighbours": [{"id": 2, "label": "b", "similarity": 0.9}, {"id": 3, "label": "a", "similarity": 0.8}]}]}


def test_transparency_is_drawn_on_white_not_black():
    picture = duplicates_picture(SUMMARY, lambda _: dark_symbol())
    # pixel for pixel the picture of the symbol on white, as the model (white by default) sees it
    expected = duplicates_picture(SUMMARY, lambda _: on(DEFAULT_BACKGROUND))
    assert np.array_equal(np.asarray(picture), np.asarray(expected))
    assert black_share(picture) < 0.01  # drawn on the hidden black, three tiles made a fifth of it black


def test_transparency_is_drawn_on_the_models_background():
    green = (40, 160, 60)
    for draw, summary in ((suspects_picture, SUSPECTS), (duplicates_picture, SUMMARY)):
        picture = draw(summary, lambda _: dark_symbol(), background=green)
        assert np.array_equal(np.asarray(picture), np.asarray(draw(summary, lambda _: on(green))))


def test_the_pictures_background_is_the_models():
    class Model:
        preprocessing = ModelPreprocessing(input_size=32, mean=(0.5,) * 3, std=(0.5,) * 3, background=(10, 20, 30))

    assert picture_background(Model()) == (10, 20, 30)
    assert picture_background(NoModel(8, "somewhere")) == DEFAULT_BACKGROUND  # built from embeddings: white
