"""`retrieval data prepare`: writes ImageFolder trees that the loaders read back."""

from __future__ import annotations

import json

from click.testing import CliRunner

from retrieval.cli.data import data_group
from retrieval.data import load_dataset


def test_prepare_emoji_small(tmp_path):
    out = tmp_path / "emoji"
    result = CliRunner().invoke(
        data_group, ["prepare", "emoji", "--out", str(out), "--limit", "12", "--image-size", "40"]
    )
    assert result.exit_code == 0, result.output
    info = json.loads((out / "info.json").read_text())
    assert f'"classes": {info["classes"]}' in result.output
    assert len(load_dataset("emoji", out, "test")) == 2 * info["test_classes"]


def test_prepare_digits_export(tmp_path):
    out = tmp_path / "digits"
    result = CliRunner().invoke(data_group, ["prepare", "digits", "--out", str(out), "--limit", "3"])
    assert result.exit_code == 0, result.output
    train = load_dataset("folder", out, "train")
    test = load_dataset("csv", out, "test")
    assert train.class_names == list("01234") and test.class_names == list("56789")
    assert len(train) == len(test) == 15
    assert train.load_image(0).size == (32, 32)


def test_prepare_refusal_is_a_clean_error(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    result = CliRunner().invoke(data_group, ["prepare", "emoji", "--out", str(tmp_path), "--limit", "2"])
    assert result.exit_code == 1 and "not an emoji data set" in result.output
