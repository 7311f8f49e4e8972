"""Items and their files: ``SearchService``'s catalogue entries, the gallery item a query is, and an indexed image's
file, opened without following a symlink put in its place."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO, Any

from retrieval.data.formats import (  # what an image file is served as: its content's format, named by extension
    ACCEPTED_FORMATS_TEXT,
    IMAGE_FORMATS,
    SIGNATURE_BYTES,
    sniff_image_format,
)
from retrieval.index import IMAGE_EXTENSIONS
from retrieval.index.live import LiveIndex
from retrieval.serve.images import QueryError
from retrieval.serve.service.answers import QueryItem, display_name, image_url
from retrieval.serve.service.state import ServedIndex


class ItemFiles:
    """``SearchService``'s items: what the catalogue says of one, and its file."""

    live: LiveIndex[ServedIndex]  # set by SearchService: the states it serves

    def query_item(self, data: bytes) -> QueryItem | None:
        """The indexed gallery item whose file has exactly these bytes (catalogue sha256), if any."""
        with self.live.acquire() as state:
            return state.query_item(data)

    def item(self, image_id: int) -> dict[str, Any] | None:
        """An indexed image's catalogue entry as clients see it (path relative to the gallery root)."""
        with self.live.acquire() as state:
            row = state.index.indexed_row(image_id)
            if row is None:
                return None
            return {
                "id": row["id"],
                "path": state.public_path(row["path"]),
                "name": display_name(row["path"]),
                "label": row["label"],
                "sha256": row["sha256"],
                "size": row["size"],
                "image_url": image_url(row["id"]),
            }

    def _catalogued_image(self, image_id: int, state: ServedIndex | None = None) -> Path | None:
        """Where the file of an indexed image is now (its gallery may have moved: ``Index.image_file``), or None."""
        if state is not None:
            row = state.index.indexed_row(image_id)
            file = state.index.image_file(row["path"]) if row is not None else None
        else:
            with self.live.acquire() as held:
                row = held.index.indexed_row(image_id)
                file = held.index.image_file(row["path"]) if row is not None else None
        # an image's path is absolute; a build from embeddings may catalogue URLs (or any text: a NUL names no
        # file), never opened here; a moved gallery has no place for a path outside its root (None), which is
        # never opened either
        if file is None or "\x00" in file or not Path(file).is_absolute() \
                or Path(file).suffix.lower() not in IMAGE_EXTENSIONS:
            return None
        return Path(file)

    def image_path(self, image_id: int, state: ServedIndex | None = None) -> Path | None:
        """The file of an indexed image of ``state`` (default: the current one), for callers that open it by path
        (the UI): only if catalogued as indexed and still a regular file that is not a symlink
        (``open_image_file`` is the race-free way)."""
        path = self._catalogued_image(image_id, state)
        try:
            return path if path is not None and stat.S_ISREG(os.lstat(path).st_mode) else None
        except OSError:
            return None

    def open_image_file(self, image_id: int) -> tuple[IO[bytes], int, str]:
        """The open file of an indexed image, its size and media type; 404 (QueryError) when it is not there.

        The file itself is opened without following a final symlink (a symlink that replaced a gallery file
        is not followed to its target; parent folders may be symlinks), and it must be a regular file, as
        seen on the opened descriptor: nothing can be swapped in between a check and the open.
        """
        path = self._catalogued_image(image_id)
        if path is None:
            raise QueryError(f"no indexed image with id {image_id}", 404)
        try:  # O_NONBLOCK: a FIFO put in its place must not block the open
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:  # ELOOP: the final component is a symlink
            reason = "was replaced by a symlink" if os.path.islink(path) else "is gone"
            raise QueryError(f"image {image_id} is catalogued but its file {reason}; it is not served", 404) from exc
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise QueryError(
                f"image {image_id} is catalogued but its file is not a regular file; it is not served", 404
            )
        handle = os.fdopen(fd, "rb")
        # the content decides, not the name: a catalogue (a build from another tool's metadata) may name any file
        kind = sniff_image_format(handle.read(SIGNATURE_BYTES))
        if kind is None:
            handle.close()
            raise QueryError(f"image {image_id} is catalogued but its file is not an image ({ACCEPTED_FORMATS_TEXT}); "
                             "it is not served", 404)
        handle.seek(0)
        media = IMAGE_FORMATS[kind].get(path.suffix.lower(), next(iter(IMAGE_FORMATS[kind].values())))
        return handle, info.st_size, media
