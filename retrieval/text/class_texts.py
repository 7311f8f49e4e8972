"""The ImageNet-1k classes as text: their WordNet lemmas and definitions as the installed ``timm`` package ships them
(``timm/data/_info``: ``imagenet_synsets.txt`` in the order of an ImageNet classifier's rows,
``imagenet_synset_to_lemma.txt``, ``imagenet_synset_to_definition.txt``), read without importing timm (no torch)
and without any download; and the texts a zero-shot text tower is trained on, by prompt set.

Each file is read whole but bounded (``MAX_INFO_BYTES``); a missing or damaged file is an ``ImageNetTextsError``
that names it and the fix.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SYNSETS_FILE = "imagenet_synsets.txt"
LEMMA_FILE = "imagenet_synset_to_lemma.txt"
DEFINITION_FILE = "imagenet_synset_to_definition.txt"
MAX_INFO_BYTES = 16 << 20  # the lemma and definition files cover ImageNet-21k: 0.7 and 1.7 MB
MAX_CLASSES = 1000  # an ImageNet-1k head
SYNSET = re.compile(r"n\d{8}")

# the training texts, by prompt set: {} is one lemma, "{a}" its article
PHOTO_TEMPLATES = ("a photo of {a} {}",)
MORE_TEMPLATES = ("a picture of {a} {}", "a close-up photo of the {}", "{a} {}", "the {}", "a product photo of {a} {}",
                  "{a} {} for sale", "a photo of my {}", "a photo of the {}, a type of object")
PROMPT_SETS = ("names", "photo", "definition", "templates")
DEFAULT_PROMPTS = ("names", "photo", "definition", "templates")


class ImageNetTextsError(ValueError):
    """The class names or definitions cannot be read; the message names the file and the fix."""


@dataclass(frozen=True)
class ImageNetClass:
    """One ImageNet class: its WordNet ``synset`` id, its ``lemmas`` (names, the first the usual one) and its
    WordNet ``definition``."""

    synset: str
    lemmas: tuple[str, ...]
    definition: str

    @property
    def name(self) -> str:
        """The class's usual name (its first lemma)."""
        return self.lemmas[0]


def info_folder() -> Path:
    """The folder of timm's ImageNet files, found from the installed package without importing it (no torch)."""
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        raise ImageNetTextsError("the ImageNet class names come with the timm package, which is not installed: "
                                 "`pip install timm` (part of the train extra)")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "_info"


def _read(folder: Path, name: str) -> list[str]:
    """The lines of one of timm's info files, bounded."""
    path = folder / name
    try:
        size = path.stat().st_size
    except OSError:
        raise ImageNetTextsError(f"{path} is missing: the installed timm package lacks its ImageNet class names; "
                                 "reinstall timm") from None
    if not path.is_file() or size > MAX_INFO_BYTES:
        raise ImageNetTextsError(f"{path} is not timm's ImageNet file (not a file, or over {MAX_INFO_BYTES >> 20} "
                                 "MiB); reinstall timm")
    with open(path, "rb") as handle:
        data = handle.read(MAX_INFO_BYTES + 1)
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise ImageNetTextsError(f"{path} is not UTF-8 text; reinstall timm") from None


def _table(folder: Path, name: str, wanted: set[str]) -> dict[str, str]:
    """``synset -> text`` of the tab-separated file ``name``, for the synsets in ``wanted``."""
    table: dict[str, str] = {}
    for number, line in enumerate(_read(folder, name), 1):
        synset, tab, text = line.partition("\t")
        if not tab or not SYNSET.fullmatch(synset):
            raise ImageNetTextsError(f"{folder / name}, line {number}, is not 'synset<TAB>text'; reinstall timm")
        if synset in wanted:
            table[synset] = " ".join(text.split())
    return table


def read_imagenet_classes(folder: str | Path | None = None) -> list[ImageNetClass]:
    """The 1,000 ImageNet classes in the order of a classifier's rows, each with its lemmas and definition, from
    ``folder`` (default: the installed timm's ``data/_info``)."""
    folder = Path(folder) if folder is not None else info_folder()
    synsets = [line.strip() for line in _read(folder, SYNSETS_FILE) if line.strip()]
    bad = [s for s in synsets if not SYNSET.fullmatch(s)]
    if bad or len(synsets) != MAX_CLASSES or len(set(synsets)) != len(synsets):
        raise ImageNetTextsError(f"{folder / SYNSETS_FILE} holds {len(synsets)} lines ({len(set(synsets))} distinct, "
                                 f"{len(bad)} not a synset id such as n01440764), not the {MAX_CLASSES} ImageNet "
                                 "classes; reinstall timm")
    wanted = set(synsets)
    lemmas, definitions = _table(folder, LEMMA_FILE, wanted), _table(folder, DEFINITION_FILE, wanted)
    classes = []
    for synset in synsets:
        names = tuple(dict.fromkeys(n.strip() for n in lemmas.get(synset, "").split(",") if n.strip()))
        if not names:
            raise ImageNetTextsError(f"{folder / LEMMA_FILE} names no lemma for {synset}; reinstall timm")
        classes.append(ImageNetClass(synset, names, definitions.get(synset, "")))
    return classes


def article(word: str) -> str:
    """"an" before a vowel's letter, else "a" (by spelling: WordNet's lemmas are plain words)."""
    return "an" if word[:1].lower() in "aeiou" else "a"


def templated(templates: Sequence[str], lemma: str) -> list[str]:
    """Each template with ``lemma`` (``{}``) and its article (``{a}``)."""
    return [template.replace("{a}", article(lemma)).replace("{}", lemma) for template in templates]


def class_texts(cls: ImageNetClass, prompts: Sequence[str] = DEFAULT_PROMPTS) -> dict[str, list[str]]:
    """The training texts of one class by prompt set (``PROMPT_SETS``): ``names`` each lemma; ``photo`` "a photo
    of a {lemma}"; ``definition`` "{name}: {definition}"; ``templates`` more phrasings of each lemma (a picture, a
    close-up, a product photo, for sale). Each text once, in the first set that has it."""
    unknown = [p for p in prompts if p not in PROMPT_SETS]
    if unknown:
        raise ImageNetTextsError(f"unknown prompt set(s) {', '.join(map(repr, unknown))}; the sets are "
                                 f"{', '.join(PROMPT_SETS)}")
    made = {
        "names": list(cls.lemmas),
        "photo": [t for lemma in cls.lemmas for t in templated(PHOTO_TEMPLATES, lemma)],
        "definition": [f"{cls.name}: {cls.definition}"] if cls.definition else [],
        "templates": [t for lemma in cls.lemmas for t in templated(MORE_TEMPLATES, lemma)],
    }
    seen: set[str] = set()
    out: dict[str, list[str]] = {}
    for prompt in dict.fromkeys(prompts):
        out[prompt] = [t for t in made[prompt] if not (t in seen or seen.add(t))]
    return out
