"""What the tabs share: the gallery's facts (``GalleryFacts``), thumbnails, the limits on shown text."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from retrieval.data import open_image
from retrieval.data.emoji import emoji_name, is_code_point_sequence
from retrieval.serve.defaults import API_DOCS_PATH
from retrieval.serve.page_text import MAX_PROSE_CHARS, METRIC_UNIT, markdown_code, markdown_text, shown_text
from retrieval.serve.service import SearchService
from retrieval.serve.service.state import ServedIndex

THUMBNAIL = 256
INFO_JSON_BYTES = 1 << 20  # a data set's info.json is a few KiB; anything bigger is not one
METRIC_TABS = ("Evaluation", "Index")  # the tabs that show metrics on every page (Results: with a grid)
MAX_ERROR_CHARS = 2000  # the API's messages are a few lines; one that echoes a long filter is cut
MAX_PATH_CHARS = 1000  # a gallery path in a caption: whole, so that it can be copied into the filter box
# Markdown components showing text from users: no LaTeX ($$ ... $$ in a label would be typeset as maths)
NO_LATEX: list[dict[str, Any]] = []


def tab_names(tabs: Sequence[str]) -> str:
    """``Evaluation, Results and Index``: the tabs in the page's order, joined for a sentence."""
    return ", ".join(tabs[:-1]) + f" and {tabs[-1]}" if len(tabs) > 1 else "".join(tabs)


def read_dataset_info(folder: Path, levels: int = 2) -> dict[str, Any] | None:
    """The ``info.json`` that ``retrieval data prepare`` writes, in ``folder`` or up to ``levels`` folders above."""
    for candidate in [folder, *folder.parents][: levels + 1]:
        info = candidate / "info.json"
        try:
            if info.is_file() and info.stat().st_size <= INFO_JSON_BYTES:
                data = json.loads(info.read_text(encoding="utf-8"))
                if isinstance(data, dict) and isinstance(data.get("dataset"), str):
                    return data
        except (OSError, ValueError):
            continue
    return None


@dataclass(frozen=True)
class GalleryFacts:
    """What the index holds, for the page's opening line and its labels."""

    images: int
    labelled: int
    classes: int
    example_labels: list[str]
    folder: Path | None  # the folder holding the gallery's files
    dataset: dict[str, Any] | None  # info.json of a `retrieval data prepare` folder: "dataset", "description"
    unicode_labels: bool  # every label is a code-point sequence (1F600, 1F469-200D-1F52C): shown with its name

    @classmethod
    def of(cls, service: SearchService) -> GalleryFacts:
        """The facts of the state served now (one state for all of them)."""
        with service.acquire() as state:
            return cls.of_state(state)

    @classmethod
    def of_state(cls, state: ServedIndex) -> GalleryFacts:
        """The facts of one served state."""
        labels = [label for _, label in state.catalogue.labelled()]
        classes = sorted(set(labels))
        paths = [row["path"] for row in state.catalogue.sample(200)]
        try:
            folder = Path(os.path.commonpath([str(Path(p).parent) for p in paths])) if paths else None
        except ValueError:  # files on different drives
            folder = None
        return cls(
            images=len(state),
            labelled=len(labels),
            classes=len(classes),
            example_labels=classes[: min(3, len(classes))],
            folder=folder,
            dataset=read_dataset_info(folder) if folder else None,
            unicode_labels=bool(classes) and all(is_code_point_sequence(c) for c in classes),
        )

    def label_name(self, label: str | None) -> str | None:
        """The Unicode name of a code-point label (``GRINNING FACE`` for ``1F600``), else None."""
        return emoji_name(label) if label is not None and self.unicode_labels else None

    def label_text(self, label: str | None) -> str:
        """A label as shown, as plain text: ``1F600 · GRINNING FACE`` for code points Python's unicodedata names,
        else as is; one line, cut at ``MAX_SHOWN_CHARS`` (escape it for Markdown: ``markdown_text``)."""
        if label is None:
            return "(no label)"
        name = self.label_name(label)
        return shown_text(f"{label} · {name}" if name else label)

    def reading(self) -> dict[str, Any]:
        """How the data set's info.json says this gallery is read (``readings``: ``twin`` where every label is a
        code-point sequence, else ``subgroup``), falling back to its top-level texts; {} without info.json. Keys:
        ``purpose``, ``description`` and ``right`` (what a ✓ means)."""
        info = self.dataset or {}
        readings = info.get("readings")
        if isinstance(readings, dict):
            chosen = readings.get("twin" if self.unicode_labels else "subgroup")
            if isinstance(chosen, dict):
                return chosen
        return {key: info[key] for key in ("purpose", "description") if key in info}

    def purpose(self) -> str:
        """The page's first line: what the gallery is for, in one plain sentence (its info.json's "purpose" for the
        way it is read, as its preparer wrote it, else what any gallery offers), as plain text."""
        purpose = self.reading().get("purpose")
        if isinstance(purpose, str) and purpose.strip():
            return shown_text(purpose, MAX_PROSE_CHARS)
        if self.labelled:
            return "Find the images of this gallery most like yours, and whether they share its label."
        return "Find the images of this gallery most like yours."

    def intro_markdown(self, service: SearchService, tabs: Sequence[str] = METRIC_TABS) -> str:
        """The opening lines: what the gallery holds and where from, what to try, what the score means, and which
        of the page's ``tabs`` show metrics (every name and label in it escaped: they are anyone's text)."""
        info = service.describe()
        if self.labelled:
            labels = ", ".join(markdown_code(self.label_text(label)) for label in self.example_labels)
            kind = "Unicode code points with their names" if self.unicode_labels else "class names"
            holds = (f"**{self.images} images** in **{self.classes} classes** ({self.labelled} labelled; labels are "
                     f"{kind}, e.g. {labels})")
        else:
            holds = f"**{self.images} images** without labels"
        source = ""
        if self.dataset is not None:
            source = f" from the {markdown_code(self.dataset['dataset'])} data set"
            description = self.reading().get("description")  # what a query should find, as its preparer says
            if isinstance(description, str) and description:
                source += f", {markdown_text(description, MAX_PROSE_CHARS)}"
        right = self.reading().get("right")  # what a ✓ means for this reading, else a shared label
        right = markdown_text(right, MAX_PROSE_CHARS) if isinstance(right, str) and right else "same label"
        # names, no server paths
        where = f" Files in the gallery folder {markdown_code(self.folder.name)}" if self.folder else ""
        words = service.text_search()  # a text model: describing is a way to search
        typed = (" Or describe what you look for in words (\"or describe it\", then Enter): a text model trained onto "
                 "this index's image model maps it among the images; it knows the words of its captions best, and "
                 "its scores run lower than an image's.") if words else ""
        return (
            f"**The gallery:** {holds}{source}.{where}; index {markdown_code(service.index_dir.name)} (index.json: "
            f"{markdown_code(info['index_key'])}, {info['embedding_dim']}-d embeddings {model_words(info)}, labels "
            "from its catalogue).\n\n"
            "**Try it:** upload or paste an image (or click one of the examples below the results) and press "
            "Search: the K gallery images nearest to it appear, best first. A query that is itself a gallery "
            f"image is left out of its own results, and each result is marked ✓ ({right}) or ✗.{typed}\n\n"
            "**Score:** the cosine similarity of the L2-normalised embeddings, from -1 to 1 (1 = identical "
            f"direction, 0 = unrelated). Metrics ({tab_names(tabs)} tabs) are in percent ({METRIC_UNIT}).\n\n"
            f"**From a program:** the JSON API, documented at [{API_DOCS_PATH}]({API_DOCS_PATH}) (OpenAPI; also "
            f"/redoc): `POST /search` with an image file{', an embedding or a text' if words else ' or an embedding'}."
        )


def thumbnail(path: Path | None) -> Image.Image:
    if path is None:
        return Image.new("RGB", (THUMBNAIL, THUMBNAIL), (230, 230, 230))
    image = open_image(path)
    image.thumbnail((THUMBNAIL, THUMBNAIL))
    return image


def model_words(info: dict[str, Any]) -> str:
    """Which model made the index's embeddings, for the page: its hash, or none (built from embeddings: searched
    with embeddings through the API)."""
    if info.get("model_hash") is None:
        return "built from embeddings, no model (search it with an embedding through the API)"
    return f"of model {markdown_code(info['model_hash'])}"
