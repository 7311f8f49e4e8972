"""Captions of the emoji for the text tower (docs/TEXT.md): each emoji's Unicode name and its subgroup's name, on the
subgroup reading's split, so the test subgroups are unseen by the image model's head and by the text tower alike."""

from __future__ import annotations

import csv
from pathlib import Path

from retrieval.data.emoji import emoji_name
from retrieval.data.emoji_groups import split_subgroups

TEXT_TRAIN_CSV, TEXT_TEST_CSV = "text_train.csv", "text_test.csv"
CAPTION_COLUMNS = ("name", "subgroup_text")


def caption_manifests(manifest: Path) -> tuple[Path, Path]:
    """``TEXT_TRAIN_CSV`` (the train subgroups' images) and ``TEXT_TEST_CSV`` (the test subgroups') beside the emoji
    data's ``manifest``: path, label (the emoji's sequence), name (its Unicode name, lower case), subgroup_text (its
    subgroup's name, words apart) and subgroup."""
    with open(manifest, newline="", encoding="utf-8") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("subgroup")]
    split = split_subgroups((row["group"], row["subgroup"]) for row in rows)
    written = []
    for name, keep in ((TEXT_TRAIN_CSV, set(split["train"])), (TEXT_TEST_CSV, set(split["test"]))):
        path = manifest.with_name(name)
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(["path", "label", *CAPTION_COLUMNS, "subgroup"])
            for row in rows:
                title = row.get("name") or (emoji_name(row["label"]) or "").lower()
                if row["subgroup"] in keep and title:
                    writer.writerow([row["path"], row["label"], title, row["subgroup"].replace("-", " "),
                                     row["subgroup"]])
        written.append(path)
    return written[0], written[1]
