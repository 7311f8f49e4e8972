"""A manifest's text is bounded before it is unpacked: a parquet manifest whose column chunks hold more bytes than
their rows' values can take (a few KB of zstd that unpack to tens of MB) is refused from its metadata, naming the
file, column and row group, before any value is read, wherever a manifest is read (index build, text train, int8
calibration); one dictionary value repeated row after row is refused per batch before it is unpacked (a manifest
and a build-from-embeddings metadata part alike); a CSV row is refused once its lines run over MAX_ROW_CHARS. An
honest manifest, every value at its bound, reads whole."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from embedders import FakeEmbedder
from index_builds import load_models_as, write_embeddings_folder

from retrieval.cli.main import main
from retrieval.index import build_from_embeddings
from retrieval.index.embedding.engine import IngestOptions
from retrieval.index.sources import MAX_EXTRA_CHARS, MAX_LABEL_CHARS, MAX_ROW_CHARS, list_gallery

QUICK = IngestOptions(workers=0, shard_size=4)
BOMB_VALUE = 16 * 2**20  # four of these: 64 MiB unpacked, a few KB of zstd


def _bomb(folder: Path, column: str = "caption", value: int = BOMB_VALUE, rows: int = 4) -> Path:
    """A parquet manifest of ``rows`` rows whose ``column`` holds ``value`` characters a row, plain-encoded and zstd
    compressed (as a bomb would be)."""
    columns = {"path": [f"{n}.jpg" for n in range(rows)], "label": ["a"] * rows, "caption": ["short"] * rows}
    columns[column] = ["x" * value] * rows
    manifest = folder / "bomb.parquet"
    pq.write_table(pa.table(columns), manifest, compression="zstd", use_dictionary=False)
    return manifest


@pytest.fixture(scope="module")
def bomb(tmp_path_factory) -> Path:
    manifest = _bomb(tmp_path_factory.mktemp("bomb"))
    assert manifest.stat().st_size < 64_000  # 64 MiB of captions in a few KB
    return manifest


@pytest.fixture
def never_read(monkeypatch):
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", lambda *a, **k: pytest.fail("a manifest value was read"))


def _refused_from_metadata(message: str, column: str = "caption") -> None:
    assert f"bomb.parquet: column {column!r} of row group 0 (4 rows) holds " in message, message
    assert "more than the " in message and "write the manifest again" in message, message


@pytest.mark.parametrize("column", ["path", "label", "caption"])
def test_a_compressed_manifest_bomb_is_refused_from_its_metadata_before_any_value_is_read(tmp_path, never_read,
                                                                                          column):
    manifest = _bomb(tmp_path, column, value=2_000_000)
    with pytest.raises(ValueError) as refused:
        list_gallery(manifest)
    _refused_from_metadata(str(refused.value), column)


def test_text_train_refuses_a_caption_bomb_before_reading_it(bomb, never_read):
    from retrieval.train.text_tower import read_captions

    with pytest.raises(ValueError) as refused:
        read_captions(str(bomb), ["caption"], None)
    _refused_from_metadata(str(refused.value))


def test_index_build_refuses_a_caption_bomb_before_reading_it(bomb, never_read, tmp_path, monkeypatch):
    load_models_as(monkeypatch, lambda *_args, **_kwargs: FakeEmbedder(8))
    result = CliRunner().invoke(main, ["index", "build", "--images", str(bomb), "--out", str(tmp_path / "idx"),
                                       "--model", str(tmp_path / "model.onnx"), "--workers", "0"])
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    _refused_from_metadata(" ".join(result.output.split()))  # the message as one line, however it was wrapped
    assert not (tmp_path / "idx" / "index.json").exists()


def test_int8_calibration_refuses_a_manifest_bomb_before_reading_it(bomb, never_read):
    from retrieval.export.int8_export import sample_items

    with pytest.raises(ValueError) as refused:
        sample_items(bomb, 16, seed=0)
    _refused_from_metadata(str(refused.value))


def _dictionary_bomb(target: Path, rows: int, value: int, column: str = "caption", **columns: list) -> None:
    """``rows`` rows whose ``column`` points at one dictionary value of ``value`` characters: a few hundred bytes
    unpack to rows x value (no Arrow schema stored, so pyarrow would unpack it unasked)."""
    table = pa.table({**columns, column: pa.DictionaryArray.from_arrays(np.zeros(rows, np.int32), ["x" * value])})
    pq.write_table(table, target, compression="zstd", store_schema=False)


def test_a_dictionary_value_repeated_row_after_row_is_refused_before_it_is_unpacked(tmp_path):
    """4,096 rows pointing at one 64 KiB caption (256 MiB unpacked, twice that as Python strings) from a file of a
    few KB: refused per batch, naming the rows, while the process grows by less than a tenth of it."""
    manifest = tmp_path / "dictionary.parquet"
    _dictionary_bomb(manifest, 4096, 2**16, path=[f"{n}.jpg" for n in range(4096)])
    assert manifest.stat().st_size < 64_000
    script = textwrap.dedent(f"""
        import json, resource
        from retrieval.index.sources import list_gallery
        start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            list_gallery({str(manifest)!r})
            message = None
        except ValueError as exc:
            message = str(exc)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start
        print(json.dumps({{"message": message, "grown_kib": grown}}))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    outcome = json.loads(run.stdout.strip().splitlines()[-1])
    message = outcome["message"] or ""
    assert "dictionary.parquet: column 'caption' of rows 1 to 1,024 would unpack to 67,108,864 bytes" in message, \
        outcome
    assert outcome["grown_kib"] < 24 * 1024, outcome


def test_a_dictionary_bomb_in_a_metadata_part_is_refused_before_it_is_unpacked(tmp_path):
    rows = 1000
    write_embeddings_folder(tmp_path / "in", [np.random.default_rng(0).normal(size=(rows, 8)).astype(np.float32)])
    (tmp_path / "in" / "metadata").mkdir()
    _dictionary_bomb(tmp_path / "in" / "metadata" / "part-00000.parquet", rows, 16_384)
    with pytest.raises(ValueError, match=r"part-00000.parquet: column 'caption' of rows 1 to 1,000 would unpack to "
                                         r"16,384,000 bytes.*write the part again"):
        build_from_embeddings(tmp_path / "in", tmp_path / "out", options=QUICK)


@pytest.mark.parametrize("write", [{"row_group_size": 2}, {"use_dictionary": False}, {"store_schema": False}])
def test_an_honest_manifest_at_its_bounds_reads_whole(tmp_path, write):
    """Every value at its bound in 4-byte characters, repeated (dictionary-encoded) or not: nothing is refused."""
    wide = "\U0001F600"
    rows = 5
    columns = {"path": [f"{wide * 200}/{n}.jpg" for n in range(rows)], "label": [wide * MAX_LABEL_CHARS] * rows,
               "caption": [wide * MAX_EXTRA_CHARS] * rows, "price": [1.5] * rows}
    pq.write_table(pa.table(columns), tmp_path / "m.parquet", compression="zstd", **write)
    gallery = list_gallery(tmp_path / "m.parquet")
    assert len(gallery.items) == rows and not gallery.errors
    assert {item.extra["caption"] for item in gallery.items} == {wide * MAX_EXTRA_CHARS}


def test_a_csv_row_over_the_bound_is_refused_before_it_is_all_read(tmp_path):
    manifest = tmp_path / "m.csv"
    manifest.write_text("path,label\na.jpg,x\n" + "b.jpg,y," + "z," * (MAX_ROW_CHARS // 2) + "\nc.jpg,z\n")
    with pytest.raises(ValueError, match=rf"m.csv: the row from line 3 runs over {MAX_ROW_CHARS:,} characters.*fix "
                                         "that row"):
        list_gallery(manifest)


def test_csv_rows_each_within_the_bound_read_whatever_the_file_holds(tmp_path):
    manifest = tmp_path / "m.csv"
    many = "z," * (MAX_ROW_CHARS // 3)  # each row within the bound, the three together over it
    manifest.write_text("path,label\n" + "".join(f"{n}.jpg,x,{many}\n" for n in range(3)))
    assert [Path(item.path).name for item in list_gallery(manifest).items] == ["0.jpg", "1.jpg", "2.jpg"]
