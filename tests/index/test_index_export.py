"""`retrieval index export`: an index's searchable rows as parquet or npy files that pandas,
autofaiss and vector databases read as they are."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from embedders import FakeEmbedder
from sample_images import write_images

from retrieval.cli.main import main
from retrieval.index import CatalogueReader, IndexLayout, Status, add_images, build_index, remove_images
from retrieval.index.embedding.engine import IngestOptions
from retrieval.index.formats.export_files import ExportSink
from retrieval.index.formats.table_export import MANIFEST, export_index, read_facts
from retrieval.index.shards import ShardStore
from retrieval.index.vectors import done_chunks

QUICK = IngestOptions(workers=0, shard_size=4)  # several shards even for a small gallery
DIM = 24


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A gallery (two classes and one unlabelled image at the top) and its index, built once for the module."""
    root = tmp_path_factory.mktemp("export")
    gallery = root / "gallery"
    write_images(gallery / "cat", 5, 0)
    write_images(gallery / "dog", 4, 10)
    write_images(gallery, 1, 20)
    build_index(gallery, root / "idx", embedder=FakeEmbedder(DIM), options=QUICK)
    return gallery, root / "idx"


def truth(index_dir: Path, gallery: Path) -> dict:
    """What the export must hold, straight from the catalogue and the shards."""
    layout = IndexLayout(index_dir)
    with CatalogueReader(layout.catalogue) as reader:
        done = reader.done_shards()
        rows = reader.rows(list(done), Status.DONE)
    vectors = {}
    for ids, chunk in done_chunks(ShardStore(layout.shards, read_only=True), done):
        vectors.update(zip(ids.tolist(), chunk, strict=True))
    ids = sorted(done)
    return {
        "id": ids,
        "path": [Path(rows[i]["path"]).relative_to(gallery.resolve()).as_posix() for i in ids],
        "absolute": [rows[i]["path"] for i in ids],
        "label": [rows[i]["label"] for i in ids],
        "sha256": [rows[i]["sha256"] for i in ids],
        "size": [rows[i]["size"] for i in ids],
        "embedding": np.stack([vectors[i] for i in ids]).astype(np.float32),
        "info": layout.read_info(),
    }


def assert_matches(table: pa.Table, vectors: np.ndarray, expected: dict, paths: str = "path") -> None:
    assert table.column("id").to_pylist() == expected["id"]
    assert table.column("path").to_pylist() == expected[paths]
    for name in ("label", "sha256", "size"):
        assert table.column(name).to_pylist() == expected[name], name
    assert vectors.dtype == np.float32 and vectors.shape == expected["embedding"].shape
    assert vectors.tobytes() == expected["embedding"].tobytes()  # bit for bit


def test_parquet_file_holds_the_catalogue_rows_and_the_shard_vectors(built, tmp_path):
    gallery, idx = built
    expected = truth(idx, gallery)
    out = tmp_path / "gallery.parquet"
    summary = export_index(idx, out)
    assert summary["rows"] == len(expected["id"]) == 10 and summary["layout"] == "file" and summary["files"] == [
        "gallery.parquet"]
    table = pq.read_table(out)
    embedding = table.schema.field("embedding").type
    assert pa.types.is_fixed_size_list(embedding) and embedding.list_size == DIM
    assert embedding.value_type == pa.float32()
    assert table.column_names == ["id", "path", "label", "sha256", "size", "embedding"]
    assert table.schema.field("id").type == pa.int64()
    frame = pd.read_parquet(out)  # pandas reads it as it is
    vectors = np.stack(frame["embedding"].to_numpy())
    assert_matches(table, vectors, expected)
    assert frame["id"].tolist() == expected["id"]
    assert None in expected["label"] and expected["label"].count("cat") == 5  # the unlabelled top-level image
    facts = read_facts(out)
    info = expected["info"]
    assert facts["model_hash"] == info["model_hash"] and facts["embedding_dim"] == DIM
    assert facts["index_key"] == info["index_key"] and facts["count"] == 10 and facts["normalized"] is True
    assert facts["similarity"] == info["similarity"] and facts["gallery_root"] == str(gallery.resolve())
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_npy_folder_is_the_autofaiss_and_clip_retrieval_layout(built, tmp_path):
    gallery, idx = built
    expected = truth(idx, gallery)
    out = tmp_path / "npy"
    summary = export_index(idx, out, "npy", rows_per_file=4, chunk_rows=3)
    embeddings = sorted((out / "embeddings").iterdir())  # autofaiss reads them in file-name order
    metadata = sorted((out / "metadata").iterdir())
    assert [p.name for p in embeddings] == ["part-00000.npy", "part-00001.npy", "part-00002.npy"]
    assert [p.name for p in metadata] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    parts = [np.load(p) for p in embeddings]
    tables = [pq.read_table(p) for p in metadata]
    assert [len(a) for a in parts] == [len(t) for t in tables] == [4, 4, 2]  # the same rows, part by part
    assert all(a.dtype == np.float32 and a.ndim == 2 and a.shape[1] == DIM for a in parts)
    assert "embedding" not in tables[0].column_names
    assert_matches(pa.concat_tables(tables), np.concatenate(parts), expected)
    assert pd.read_parquet(out / "metadata")["id"].tolist() == expected["id"]  # the folder, as pandas reads it
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["files"] == summary["files"] and manifest["model_hash"] == expected["info"]["model_hash"]
    assert read_facts(out / "metadata" / "part-00001.parquet")["embedding_dim"] == DIM


def test_streamed_chunks_and_part_files_equal_the_one_shot_export(built, tmp_path):
    _, idx = built
    export_index(idx, tmp_path / "one.parquet")
    export_index(idx, tmp_path / "parts", rows_per_file=3, chunk_rows=1)  # a folder of parquet parts
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == [
        MANIFEST, "part-00000.parquet", "part-00001.parquet", "part-00002.parquet", "part-00003.parquet"]
    assert pq.ParquetFile(tmp_path / "parts" / "part-00000.parquet").metadata.num_row_groups == 3  # one per chunk
    one, parts = pd.read_parquet(tmp_path / "one.parquet"), pd.read_parquet(tmp_path / "parts")
    pd.testing.assert_frame_equal(one.drop(columns="embedding"), parts.drop(columns="embedding"))
    assert np.stack(one["embedding"].to_numpy()).tobytes() == np.stack(parts["embedding"].to_numpy()).tobytes()
    export_index(idx, tmp_path / "npy-one", "npy")
    export_index(idx, tmp_path / "npy-parts", "npy", rows_per_file=7, chunk_rows=2)
    whole = np.load(tmp_path / "npy-one" / "embeddings" / "part-00000.npy")
    pieces = np.concatenate([np.load(p) for p in sorted((tmp_path / "npy-parts" / "embeddings").iterdir())])
    assert whole.tobytes() == pieces.tobytes()


def test_removed_images_are_left_out_and_a_readded_one_comes_from_its_new_shard(tmp_path):
    gallery = tmp_path / "gallery"
    paths = write_images(gallery / "a", 6, 0) + write_images(gallery / "b", 5, 30)
    idx = tmp_path / "idx"
    build_index(gallery, idx, embedder=FakeEmbedder(DIM), options=QUICK)
    remove_images(idx, ids=[2, 7, 9])
    add_images(idx, paths[6], embedder=FakeEmbedder(DIM), options=QUICK)  # id 7 again, in a new shard
    expected = truth(idx, gallery)
    assert 2 not in expected["id"] and 9 not in expected["id"] and 7 in expected["id"]
    with CatalogueReader(IndexLayout(idx).catalogue) as reader:
        assert reader.done_shards()[7] > reader.done_shards()[8]  # its shard comes after its neighbours'
    export_index(idx, tmp_path / "x.parquet", chunk_rows=4)
    table = pq.read_table(tmp_path / "x.parquet")
    assert_matches(table, np.stack(table.column("embedding").to_numpy(zero_copy_only=False)), expected)
    assert table.column("id").to_pylist() == sorted(table.column("id").to_pylist())  # id order across shards
    export_index(idx, tmp_path / "abs.parquet", absolute_paths=True)
    assert pq.read_table(tmp_path / "abs.parquet").column("path").to_pylist() == expected["absolute"]


def test_an_index_with_every_image_removed_exports_empty_files(tmp_path):
    gallery = tmp_path / "gallery"
    write_images(gallery / "a", 2, 0)
    idx = tmp_path / "idx"
    build_index(gallery, idx, embedder=FakeEmbedder(DIM), options=QUICK)
    remove_images(idx, ids=[1, 2])
    assert export_index(idx, tmp_path / "e.parquet")["rows"] == 0
    table = pq.read_table(tmp_path / "e.parquet")
    assert table.num_rows == 0 and table.schema.field("embedding").type.list_size == DIM
    export_index(idx, tmp_path / "e", "npy")
    assert np.load(tmp_path / "e" / "embeddings" / "part-00000.npy").shape == (0, DIM)


def test_catalogue_and_manifest_columns_are_exported_with_split_after_the_label(tmp_path):
    gallery = tmp_path / "gallery"
    write_images(gallery / "a", 4, 0)
    idx = tmp_path / "idx"
    build_index(gallery, idx, embedder=FakeEmbedder(DIM), options=QUICK)
    with sqlite3.connect(IndexLayout(idx).catalogue) as db:  # what a newer schema / a manifest's columns hold
        db.execute("ALTER TABLE images ADD COLUMN note TEXT")
        db.execute("UPDATE images SET note = 'checked' WHERE id = 2")
        db.execute("CREATE TABLE IF NOT EXISTS metadata (id INTEGER PRIMARY KEY, data TEXT NOT NULL)")
        rows = {1: {"split": "test", "price": 3, "size": "L"}, 2: {"split": "train", "price": 4.5},
                3: {"split": "test", "sku": 12}, 4: {"sku": "A-7"}}
        db.executemany("INSERT OR REPLACE INTO metadata(id, data) VALUES (?, ?)",
                       [(i, json.dumps(v)) for i, v in rows.items()])
    export_index(idx, tmp_path / "m.parquet", chunk_rows=3)
    table = pq.read_table(tmp_path / "m.parquet")
    assert table.column_names == ["id", "path", "label", "split", "sha256", "size", "note", "price",
                                  "manifest_size", "sku", "embedding"]
    assert table.column("split").to_pylist() == ["test", "train", "test", None]
    assert table.schema.field("price").type == pa.float64()  # ints and floats
    assert table.column("price").to_pylist() == [3.0, 4.5, None, None]
    assert table.column("sku").to_pylist() == [None, None, "12", "A-7"]  # numbers and text: text
    assert table.column("note").to_pylist() == [None, "checked", None, None]
    assert table.column("manifest_size").to_pylist() == ["L", None, None, None]  # "size" is the file's bytes


def test_refusals_name_the_fix_and_lose_nothing(built, tmp_path):
    _, idx = built
    precious = tmp_path / "precious.parquet"
    precious.write_bytes(b"not yours")
    with pytest.raises(FileExistsError, match="exists and is not empty.*`overwrite`"):
        export_index(idx, precious)
    assert precious.read_bytes() == b"not yours"
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        export_index(idx, folder, "npy")
    with pytest.raises(FileExistsError, match="no earlier export"):
        export_index(idx, folder, "npy", overwrite=True)  # never deletes a folder it did not write
    assert (folder / "keep.txt").read_text() == "mine" and len(list(folder.iterdir())) == 1
    with pytest.raises(ValueError, match="fmt 'csv' is an unknown export format: use parquet.*or npy"):
        export_index(idx, tmp_path / "x", "csv")
    with pytest.raises(ValueError, match="outside the index folder"):
        export_index(idx, idx / "export.parquet")
    with pytest.raises(ValueError, match="rows_per_file"):
        export_index(idx, tmp_path / "y", rows_per_file=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "precious.parquet"]
    export_index(idx, precious, overwrite=True)  # a file is replaced when asked
    assert pq.read_table(precious).num_rows == 10
    export_index(idx, folder / "sub", "npy")
    export_index(idx, folder / "sub", "npy", overwrite=True, rows_per_file=5)  # an earlier export is replaced
    assert len(list((folder / "sub" / "embeddings").iterdir())) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_index(idx, empty, "npy")["rows"] == 10  # an empty folder is no loss


def test_an_unfinished_or_busy_index_is_refused(tmp_path, built):
    gallery, idx = built
    unfinished = tmp_path / "unfinished"
    build_index(gallery / "dog", unfinished, embedder=FakeEmbedder(DIM), options=QUICK)
    (unfinished / "index.json").unlink()
    with pytest.raises(FileNotFoundError, match="not finished.*retrieval index repair"):
        export_index(unfinished, tmp_path / "u.parquet")
    assert not (tmp_path / "u.parquet").exists()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
         "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'{\"pid\": 1, \"command\": \"retrieval index add\"}'); "
         "print('locked', flush=True); time.sleep(60)", str(idx / "writer.lock")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RuntimeError, match="being written by .*retrieval index add.*when that finishes"):
            export_index(idx, tmp_path / "busy.parquet")
    finally:
        holder.kill()
        holder.wait()
    assert not (tmp_path / "busy.parquet").exists()


def test_a_killed_export_leaves_nothing_under_the_final_name(built, tmp_path, monkeypatch):
    _, idx = built
    real_write = ExportSink.write
    calls = []

    def write_then_die(self, table, vectors):
        real_write(self, table, vectors)
        calls.append(len(vectors))
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a Ctrl-C mid-export

    monkeypatch.setattr(ExportSink, "write", write_then_die)
    for out, fmt in ((tmp_path / "k.parquet", "parquet"), (tmp_path / "k", "npy")):
        calls.clear()
        with pytest.raises(KeyboardInterrupt):
            export_index(idx, out, fmt, chunk_rows=2, rows_per_file=4)
        assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary file either
    monkeypatch.undo()
    stale = tmp_path / ".k.parquet.tmp-999999999-abcd"  # what a kill -9 leaves: its process is gone
    stale.write_bytes(b"half")
    export_index(idx, tmp_path / "k.parquet")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.parquet"]


def test_the_command_line_exports_and_ends_with_the_next_step(built, tmp_path):
    _, idx = built
    out = tmp_path / "cli"
    result = CliRunner().invoke(main, ["index", "export", str(idx), "--format", "npy", "--out", str(out),
                                       "--rows-per-file", "6"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[-2].startswith(f"exported 10 images ({DIM}-d float32 embeddings, model_hash ")
    assert f"to {out} as npy (4 files" in lines[-2]  # 2 .npy + their 2 metadata parts
    assert lines[-1].startswith(f"next: autofaiss build_index --embeddings {out}/embeddings --metric_type ip")
    again = CliRunner().invoke(main, ["index", "export", str(idx), "--format", "npy", "--out", str(out)])
    assert again.exit_code == 1 and "exists and is not empty" in again.output and "Traceback" not in again.output
    as_json = CliRunner().invoke(main, ["index", "export", str(idx), "--out", str(tmp_path / "t.parquet"), "--json"])
    assert as_json.exit_code == 0, as_json.output
    summary = json.loads(as_json.stdout)
    assert summary["rows"] == 10 and summary["format"] == "parquet" and summary["files"] == ["t.parquet"]
    bad = CliRunner().invoke(main, ["index", "export", str(idx), "--format", "csv", "--out", str(tmp_path / "c")])
    assert bad.exit_code == 2 and "parquet" in bad.output and not (tmp_path / "c").exists()
    parquet = CliRunner().invoke(main, ["index", "export", str(idx), "--out", str(tmp_path / "p.parquet")])
    assert parquet.stdout.strip().splitlines()[-1].startswith("next: python -c ")


def test_the_export_module_is_read_side_only():
    """No writer module and no torch: exporting needs neither."""
    writer = [f"retrieval.index.{name}" for name in ("writer", "engines", "ingest", "mend", "faiss_build")]
    code = (f"import sys, retrieval.index.formats.table_export; "
            f"print(sorted(set({[*writer, 'torch']!r}) & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
