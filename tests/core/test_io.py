"""retrieval.utils.io: atomic_write, the one write-then-rename helper (index files, checkpoints, reports, caches),
and open_regular_within, a file below a folder opened through no link out of it."""

import errno
import os
import stat

import numpy as np
import pytest

from retrieval.utils.io import (
    TEMPORARY_GLOB,
    NotRegularFileError,
    OutsideFolderError,
    atomic_write,
    open_regular_within,
)


def test_writes_bytes_text_and_writer_output(tmp_path):
    atomic_write(tmp_path / "a.bin", b"\x00\x01")
    atomic_write(tmp_path / "b.txt", "h\u00e9\n")

    def save(tmp):
        with tmp.open("wb") as handle:
            np.save(handle, np.arange(3))

    atomic_write(tmp_path / "c.npy", save)
    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "b.txt").read_bytes() == "h\u00e9\n".encode()
    assert np.load(tmp_path / "c.npy").tolist() == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.txt", "c.npy"]  # no temporary left


def test_replaces_an_existing_file_and_keeps_it_when_the_writer_fails(tmp_path):
    path = tmp_path / "report.json"
    atomic_write(path, "old")
    atomic_write(path, "new")
    assert path.read_text() == "new"

    seen = []

    def broken(tmp):
        seen.append(tmp)
        tmp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, broken)
    assert path.read_text() == "new"
    assert seen[0].parent == tmp_path and seen[0].match(TEMPORARY_GLOB)  # same folder, a name cleaners know
    assert not seen[0].exists()


def test_files_get_the_usual_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "index.faiss", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "index.faiss").stat().st_mode) == 0o644  # readable by a server's user


def test_a_file_below_a_folder_is_opened_only_through_links_that_stay_inside(tmp_path):
    root, outside = tmp_path / "gallery", tmp_path / "outside"
    (root / "real" / "deep").mkdir(parents=True)
    outside.mkdir()
    (root / "real" / "deep" / "a.png").write_bytes(b"inside")
    (outside / "a.png").write_bytes(b"secret")
    (root / "in").symlink_to(root / "real", target_is_directory=True)
    (root / "chain").symlink_to("in/deep", target_is_directory=True)  # a link through a link, relative
    (root / "out").symlink_to(outside, target_is_directory=True)
    (root / "climb").symlink_to("../outside", target_is_directory=True)
    (root / "real" / "up").symlink_to("../../outside", target_is_directory=True)
    (root / "loop").symlink_to("loop", target_is_directory=True)
    (root / "real" / "deep" / "file-link.png").symlink_to(root / "real" / "deep" / "a.png")
    handle, status = open_regular_within(root, root / "in" / "deep" / "a.png")
    with handle:
        assert handle.read() == b"inside" and status.st_size == 6
    with open_regular_within(root, root / "chain" / "a.png")[0] as handle:
        assert handle.read() == b"inside"
    for leaving in ("out/a.png", "climb/a.png", "real/up/a.png", "real/../../outside/a.png"):
        with pytest.raises(OutsideFolderError):
            open_regular_within(root, f"{root}/{leaving}")
    with pytest.raises(OSError) as looped:
        open_regular_within(root, root / "loop" / "a.png")
    assert looped.value.errno == errno.ELOOP
    with pytest.raises(OSError) as linked_file:  # the file itself is never opened through a link
        open_regular_within(root, root / "real" / "deep" / "file-link.png")
    assert linked_file.value.errno == errno.ELOOP
    with pytest.raises(NotRegularFileError):
        open_regular_within(root, root / "real" / "deep")
    with pytest.raises(OutsideFolderError):
        open_regular_within(root, outside / "a.png")
