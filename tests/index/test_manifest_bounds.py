"""A manifest's columns and labels are bounded where the manifest is read: a column named like one of the index's
own is refused (the export would write two columns of one name, one's values lost, and pandas could not read it),
so are column names over MAX_COLUMN_NAME_CHARS; a label over MAX_LABEL_CHARS makes its row an error, never a cut
label. An export never writes one column name twice, whatever an older catalogue holds."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from embedders import FakeEmbedder
from index_builds import load_models_as
from sample_images import write_images

from retrieval.cli.main import main
from retrieval.index import CatalogueReader, IndexLayout, build_index, sources
from retrieval.index.embedding.engine import IngestOptions
from retrieval.index.formats.table_export import export_index
from retrieval.index.sources import MAX_COLUMN_NAME_CHARS, MAX_LABEL_CHARS, RESERVED_COLUMNS, list_gallery

QUICK = IngestOptions(workers=0, shard_size=4)
DIM = 8


def write_manifest(folder: Path, columns: dict[str, list], kind: str) -> Path:
    """``columns`` (path first) as manifest.csv or manifest.parquet in ``folder``."""
    if kind == "parquet":
        pq.write_table(pa.table(columns), folder / "manifest.parquet")
        return folder / "manifest.parquet"
    names = list(columns)
    rows = zip(*columns.values(), strict=True)
    text = ",".join(names) + "\n" + "".join(",".join(map(str, row)) + "\n" for row in rows)
    (folder / "manifest.csv").write_text(text)
    return folder / "manifest.csv"


@pytest.mark.parametrize("kind", ["csv", "parquet"])
@pytest.mark.parametrize("reserved", [*RESERVED_COLUMNS])
def test_a_manifest_column_named_like_the_index_own_is_refused_naming_it(tmp_path, reserved, kind):
    names = [path.name for path in write_images(tmp_path, 2)]
    manifest = write_manifest(tmp_path, {"path": names, "label": ["a", "b"], reserved: ["x", "y"]}, kind)
    with pytest.raises(ValueError, match=rf"column '{reserved}' has a name the index uses.*rename it") as refused:
        build_index(manifest, tmp_path / "idx", embedder=FakeEmbedder(DIM), options=QUICK)
    assert f"source_{reserved}" in str(refused.value) and not (tmp_path / "idx" / "index.json").exists()


def test_the_command_line_says_which_column_to_rename(tmp_path, monkeypatch):

    load_models_as(monkeypatch, lambda *_args, **_kwargs: FakeEmbedder(DIM))  # no ONNX file needed
    names = [path.name for path in write_images(tmp_path, 2)]
    manifest = write_manifest(tmp_path, {"path": names, "label": ["a", "b"], "sha256": ["x", "y"]}, "csv")
    result = CliRunner().invoke(main, ["index", "build", "--images", str(manifest), "--out", str(tmp_path / "idx"),
                                       "--model", str(tmp_path / "model.onnx"), "--workers", "0"])
    assert result.exit_code != 0 and "column 'sha256'" in result.output and "rename it" in result.output, \
        result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_a_column_name_over_the_bound_is_refused(tmp_path, kind):
    names = [path.name for path in write_images(tmp_path, 2)]
    longest, over = "c" * MAX_COLUMN_NAME_CHARS, "d" * (MAX_COLUMN_NAME_CHARS + 1)
    ok = write_manifest(tmp_path, {"path": names, longest: ["1", "2"]}, kind)
    assert [item.extra for item in list_gallery(ok).items] == [{longest: "1"}, {longest: "2"}]
    manifest = write_manifest(tmp_path, {"path": names, over: ["1", "2"]}, kind)
    with pytest.raises(ValueError, match=rf"{MAX_COLUMN_NAME_CHARS + 1} characters, longer than "
                                         rf"{MAX_COLUMN_NAME_CHARS}; rename it"):
        list_gallery(manifest)


def test_a_label_over_the_bound_is_refused_whole_never_cut(tmp_path):
    """A label just over the bound: its row is an error naming the manifest line and the limit; a label of exactly
    the bound is indexed whole (a label far over it is refused with the manifest: test_parquet_manifest_bombs)."""
    names = [path.name for path in write_images(tmp_path, 3)]
    labels = ["ok", "x" * MAX_LABEL_CHARS, "y" * (MAX_LABEL_CHARS + 1)]
    manifest = write_manifest(tmp_path, {"path": names, "label": labels}, "parquet")
    summary = build_index(manifest, tmp_path / "idx", embedder=FakeEmbedder(DIM), options=QUICK)
    assert summary["indexed"] == 2 and summary["errors"] == 1
    (error,) = (e["error"] for e in summary["error_examples"])
    assert f"has {MAX_LABEL_CHARS + 1} characters, more than {MAX_LABEL_CHARS}" in error
    assert "(manifest line 3)" in error and len(error) < 400  # the label is not repeated in the message
    with CatalogueReader(IndexLayout(tmp_path / "idx").catalogue) as reader:
        kept = sorted(label for _, label in reader.labelled())
    assert kept == sorted(labels[:2])  # whole: never cut to the bound


def test_a_csv_label_over_the_bound_is_refused(tmp_path):
    names = [path.name for path in write_images(tmp_path, 2)]
    manifest = write_manifest(tmp_path, {"path": names, "label": ["a", "l" * 1000]}, "csv")
    gallery = list_gallery(manifest)
    assert [item.label for item in gallery.items] == ["a"]
    (error,) = gallery.errors
    assert "1000 characters, more than" in error.error and "(manifest line 3)" in error.error


def test_an_export_never_writes_two_columns_of_one_name(tmp_path, monkeypatch):
    """An index built before the check (the reserved names let through) from a manifest with sha256, a
    manifest_sha256 of its own, embedding and id: every export reads back with pandas, each column once, every
    manifest value kept under some column."""
    names = [path.name for path in write_images(tmp_path, 3)]
    manifest = {"path": names, "label": ["a", "b", "a"], "sha256": ["s0", "s1", "s2"],
                "manifest_sha256": ["m0", "m1", "m2"], "embedding": ["e0", "e1", "e2"], "id": ["i0", "i1", "i2"]}
    monkeypatch.setattr(sources, "RESERVED_COLUMNS", (), raising=False)
    build_index(write_manifest(tmp_path, manifest, "csv"), tmp_path / "idx", embedder=FakeEmbedder(DIM),
                options=QUICK)
    for fmt, out, table_path in (("parquet", "e.parquet", "e.parquet"), ("parquet", "folder", "folder"),
                                 ("npy", "n", "n/metadata")):
        summary = export_index(tmp_path / "idx", tmp_path / out, fmt, progress=False)
        frame = pd.read_parquet(tmp_path / table_path)
        columns = list(frame.columns)
        assert len(columns) == len(set(columns)) and summary["columns"] == columns[: len(summary["columns"])]
        values = {column: frame[column].tolist() for column in columns if column != "embedding"}
        for name, given in manifest.items():
            if name in ("path", "label"):
                continue
            assert given in values.values(), (name, values)  # no manifest column's values lost
        assert values["sha256"] != manifest["sha256"] and len(values["sha256"][0]) == 64  # the file's own hash
        assert columns == ["id", "path", "label", "sha256", "size", "manifest_sha256", "manifest_manifest_sha256",
                           "manifest_embedding", "manifest_id", *(["embedding"] if fmt == "parquet" else [])]
