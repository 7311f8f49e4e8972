"""Items and their files: ``SearchService``'s catalogue entries, the gallery item a query is, and an indexed image's
file, opened folder by folder from the gallery root through no link out of it."""

from __future__ import annotations

import errno
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
from retrieval.utils.io import NotRegularFileError, OutsideFolderError, open_regular_within


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
            columns = state.index.columns_of([row["id"]]).get(int(row["id"]))
            return {
                "id": row["id"],
                "path": state.public_path(row["path"]),
                "name": display_name(row["path"]),
                "label": row["label"],
                "sha256": row["sha256"],
                "size": row["size"],
                "image_url": image_url(row["id"]),
            } | ({"columns": columns} if columns is not None else {})

    def _catalogued_image(self, image_id: int, state: ServedIndex | None = None) -> tuple[Path, Path] | None:
        """Where the file of an indexed image is now (its gallery may have moved: ``Index.image_file``) and the
        gallery root it is read under, or None."""
        if state is None:
            with self.live.acquire() as held:
                return self._catalogued_image(image_id, held)
        row = state.index.indexed_row(image_id)
        file = state.index.image_file(row["path"]) if row is not None else None
        # an image's path is absolute; a build from embeddings may catalogue URLs (or any text: a NUL names no
        # file), never opened here; a moved gallery has no place for a path outside its root (None), which is
        # never opened either
        if file is None or "\x00" in file or not Path(file).is_absolute() \
                or Path(file).suffix.lower() not in IMAGE_EXTENSIONS:
            return None
        return Path(file), Path(state.index.gallery.root)

    def image_path(self, image_id: int, state: ServedIndex | None = None) -> Path | None:
        """The file of an indexed image of ``state`` (default: the current one), for callers that open it by path
        (the UI): only if catalogued as indexed and, as ``open_image_file`` would open it, a regular file reached
        without a link out of the gallery (``open_image_file`` is the race-free way)."""
        found = self._catalogued_image(image_id, state)
        if found is None:
            return None
        try:
            handle, _ = self._open_catalogued(*found)
        except OSError:
            return None
        handle.close()
        return found[0]

    @staticmethod
    def _open_catalogued(path: Path, root: Path) -> tuple[IO[bytes], os.stat_result]:
        """``path`` opened for reading: below the gallery root, folder by folder with no link out of it
        (``open_regular_within``); a file catalogued outside the root (``index add`` from another folder) without
        following its final component. Only a regular file."""
        if Path(os.path.normpath(path)).is_relative_to(root):
            return open_regular_within(root, path)
        # O_NONBLOCK: a FIFO put in its place must not block the open
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise NotRegularFileError(errno.EINVAL, "not a regular file", str(path))
        return os.fdopen(fd, "rb"), info

    def open_image_file(self, image_id: int) -> tuple[IO[bytes], int, str]:
        """The open file of an indexed image, its size and media type; 404 (QueryError) when it is not there.

        The file is opened folder by folder from the gallery root without following a link out of it (a gallery
        folder swapped for a symlink to elsewhere is not followed; linked folders within the gallery are, and the
        folders above the root are the operator's), the file itself never through a symlink, and it must be a
        regular file, as seen on the opened descriptor: nothing can be swapped in between a check and the open.
        """
        found = self._catalogued_image(image_id)
        if found is None:
            raise QueryError(f"no indexed image with id {image_id}", 404)
        path = found[0]
        try:
            handle, info = self._open_catalogued(*found)
        except OutsideFolderError as exc:
            raise QueryError(f"image {image_id} is catalogued but a folder on its way leads out of the gallery "
                             "through a symlink; it is not served", 404) from exc
        except NotRegularFileError as exc:
            raise QueryError(
                f"image {image_id} is catalogued but its file is not a regular file; it is not served", 404
            ) from exc
        except OSError as exc:  # ELOOP: the final component is a symlink
            reason = "was replaced by a symlink" if os.path.islink(path) else "is gone"
            raise QueryError(f"image {image_id} is catalogued but its file {reason}; it is not served", 404) from exc
        # the content decides, not the name: a catalogue (a build from another tool's metadata) may name any file
        kind = sniff_image_format(handle.read(SIGNATURE_BYTES))
        if kind is None:
            handle.close()
            raise QueryError(f"image {image_id} is catalogued but its file is not an image ({ACCEPTED_FORMATS_TEXT}); "
                             "it is not served", 404)
        handle.seek(0)
        media = IMAGE_FORMATS[kind].get(path.suffix.lower(), next(iter(IMAGE_FORMATS[kind].values())))
        return handle, info.st_size, media
