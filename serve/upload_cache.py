"""The Gradio app's files: a folder of its own, only uploaded files as event inputs, pruned by age and size.

Gradio copies every file an event names into its cache and serves the cache at ``/gradio_api/file=``. Its guard
(``processing_utils._check_allowed``: event inputs must lie in the upload folder) only runs once
``blocks.has_launched`` is set, which ``launch()`` does and ``gr.mount_gradio_app`` does not; and its cache is
the machine-wide ``/tmp/gradio`` that every Gradio app of every user shares. This module mends both and adds a
guard of its own in front of Gradio (URLs included, which Gradio would download) with one answer for any file
that was not uploaded, so that nothing tells whether a path exists.

What an event may open is decided by Gradio's own records (``UploadRecords``: the paths its upload route saved,
and the example copies it made), never by the shape of the request: a file reference with or without ``meta``,
a plain string or a URL is read only if Gradio recorded exactly that path.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import anyio
import gradio as gr
from fastapi import FastAPI
from gradio import processing_utils
from gradio.context import LocalContext
from gradio.exceptions import InvalidPathError
from gradio_client.utils import is_file_obj_with_meta
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from retrieval.data.decode import ImageDecodeError, open_regular_file
from retrieval.serve.admission import read_whole_body, replayed
from retrieval.serve.bodies import JsonText, json_depth, json_values
from retrieval.serve.defaults import BODY_READ_TIMEOUT_S, GRADIO_JSON_BODY_LIMIT
from retrieval.serve.exposure import ConfigError
from retrieval.serve.images import QueryError

log = logging.getLogger(__name__)

GRADIO_API_PREFIX = "/gradio_api/"
GRADIO_UPLOAD_PATHS = ("/gradio_api/upload", "/gradio_api/upload/")  # multipart bodies: Gradio caps and records them
GRADIO_FILE_ROUTE = "/gradio_api/file="  # Gradio serves files (and fetches URLs) named after it
MAX_UPLOAD_PARTS = 4  # files in one upload request: the app's image box sends one
GRADIO_MAX_VALUES = 4096  # an event names a file, k, a filter and chosen labels: far fewer values
GRADIO_MAX_DEPTH = 16  # Gradio's event body nests its inputs a few levels deep
UPLOAD_SLACK = 64 * 1024  # multipart boundaries and part headers around the one uploaded file
SHARED_GRADIO_FOLDER = Path(tempfile.gettempdir()) / "gradio"  # Gradio's default: every app on the machine
NOT_UPLOADED = (
    "this call names a file that was not uploaded to this app. Upload the file first (POST /gradio_api/upload, "
    "which gradio_client's handle_file() does for you) and pass the path that the upload returns"
)
UPLOAD_GONE = "the uploaded file is no longer kept (uploads are deleted after a while): upload it again"

_process_folder: Path | None = None


def use_upload_folder(requested: Path | None = None) -> Path:
    """Point Gradio (``GRADIO_TEMP_DIR``, process-wide) at this server's own upload folder and return it.

    None: a new private folder (mode 0700) for this process, removed at exit. A given folder is created 0700 and
    is this server's alone: the pruner deletes its files. One process serves one folder (Gradio reads the
    variable on every check), so a second, different folder in the same process is refused.
    """
    global _process_folder
    if requested is None:
        if _process_folder is None:
            _process_folder = Path(tempfile.mkdtemp(prefix="retrieval-gradio-")).resolve()
            atexit.register(shutil.rmtree, _process_folder, True)
        folder = _process_folder
    else:
        folder = Path(requested).expanduser().resolve()
        if folder == SHARED_GRADIO_FOLDER.resolve():
            raise ConfigError(f"{folder} is Gradio's machine-wide default folder, shared with every other Gradio "
                             "app: pass a folder of this server's own to --upload-dir")
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"--upload-dir {folder} exists and is not a folder")
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if _process_folder is not None and _process_folder != folder:
            raise ConfigError(f"this process already keeps Gradio uploads in {_process_folder}; Gradio's folder is "
                             "process-wide (GRADIO_TEMP_DIR), start another process for another folder")
        _process_folder = folder
    os.environ["GRADIO_TEMP_DIR"] = str(folder)
    # Gradio's file route also serves its examples cache (by default .gradio/cached_examples under the working
    # folder, where another app may have left files): point it into this server's own folder too.
    os.environ["GRADIO_EXAMPLES_CACHE"] = str(folder / "cached_examples")
    return folder


def lock_file_access(blocks: gr.Blocks) -> None:
    """Make Gradio's own "event inputs only from the upload folder" check effective on a mounted app, and prove it.

    ``launch()`` sets both flags; a mounted app must too: ``has_launched`` turns the check on and ``is_running``
    stops Gradio from marking SVG copies as static (served inline: script on this origin). Refuses to serve
    (RuntimeError) if this Gradio version lets a file from outside the upload folder through.
    """
    blocks.has_launched = True
    blocks.is_running = True
    probe = Path(__file__).resolve()  # exists, and is not in the upload folder
    token = LocalContext.blocks.set(blocks)
    try:
        processing_utils._check_allowed(probe, check_in_upload_folder=True)
    except InvalidPathError:
        return
    finally:
        LocalContext.blocks.reset(token)
    raise RuntimeError(f"gradio {gr.__version__} accepts event inputs outside its upload folder on a mounted app; "
                       "refusing to serve (pin the gradio version in pyproject.toml that this check passes with)")


def kept_files(blocks: gr.Blocks) -> set[str]:
    """The example copies Gradio made for the app's components (kept for the server's lifetime)."""
    return set().union(*(getattr(block, "keep_in_cache", set()) for block in blocks.blocks.values()))


class UploadRecords:
    """Gradio's own records of the files this app received: its upload route's ``upload_file_set`` and the
    components' example copies. The only files an event may open, whatever shape its reference has."""

    def __init__(self, blocks: gr.Blocks) -> None:
        self.blocks = blocks

    def holds(self, path: Any) -> bool:
        """Whether ``path`` is, character for character, a path Gradio recorded (the pruner forgets deleted ones)."""
        return isinstance(path, str) and (path in self.blocks.upload_file_set or path in kept_files(self.blocks))

    def read(self, path: Any, max_bytes: int) -> bytes:
        """A recorded file's bytes, read no further than ``2 * max_bytes + 1`` (Gradio's upload route already
        refuses larger files; the caller refuses those over ``max_bytes`` naming their size, memory stays bounded).

        Anything not recorded gets the one NOT_UPLOADED answer (no existence oracle, no path echoed); a
        recorded path is still opened as a regular file only (never blocks on a FIFO put in its place).
        """
        if not self.holds(path):
            raise QueryError(NOT_UPLOADED)
        try:
            with open_regular_file(path) as handle:
                return handle.read(2 * max_bytes + 1)
        except (OSError, ImageDecodeError):
            raise QueryError(UPLOAD_GONE) from None


def _named_files(value: Any) -> Iterable[str]:
    """Every path named by a file reference anywhere in a JSON value: any object with a ``path`` (Gradio's
    FileData, with or without its ``meta``) or a ``url`` that is not an inline ``data:`` URL."""
    if isinstance(value, dict):
        if is_file_obj_with_meta(value) or "path" in value:
            yield value.get("path") if isinstance(value.get("path"), str) else repr(value.get("path"))
        elif isinstance(value.get("url"), str) and not value["url"].startswith("data:"):
            yield value["url"]
        for item in value.values():
            yield from _named_files(item)
    elif isinstance(value, list):
        for item in value:
            yield from _named_files(item)


class UploadedFilesOnly:
    """ASGI middleware: a Gradio call (a POST under /gradio_api/) is one JSON body naming only recorded files.

    In front of Gradio and of the handlers' own check (``UploadRecords.read``): it answers every file reference
    that Gradio did not record (any shape, URLs included, which Gradio would download) with the same 400, whether
    or not the file exists, without echoing it. Only the upload route takes another body (multipart).
    """

    def __init__(self, app: ASGIApp, records: UploadRecords, max_upload_bytes: int,
                 limit: int = GRADIO_JSON_BODY_LIMIT) -> None:
        self.app, self.records, self.limit = app, records, limit
        self.upload_limit = max_upload_bytes + UPLOAD_SLACK

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GRADIO_API_PREFIX):
            await self.app(scope, receive, send)
            return
        if scope["path"].startswith(GRADIO_FILE_ROUTE) and "://" in scope["path"]:  # Gradio would fetch the URL
            await JSONResponse({"detail": NOT_UPLOADED}, 400)(scope, receive, send)
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        content_types = [value for name, value in scope["headers"] if name.lower() == b"content-type"]
        if len(content_types) > 1:  # which one a parser reads is not for this middleware to guess
            await JSONResponse({"detail": "send one Content-Type header, not several"}, 400)(scope, receive, send)
            return
        if scope["path"] in GRADIO_UPLOAD_PATHS:
            refusal = self.upload_refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
            body = await read_whole_body(receive, self.upload_limit, BODY_READ_TIMEOUT_S)
            if isinstance(body, bytes):
                refusal = upload_parts_refusal(scope, body)
            else:
                refusal, body = body, b""
            if refusal is not None:
                await refusal(scope, receive, send)
                return
            await self.app(scope, replayed(body, receive), send)
            return
        body = await read_whole_body(receive, self.limit, BODY_READ_TIMEOUT_S)
        if not isinstance(body, bytes):
            if body.status_code == 413:
                body = JSONResponse({"detail": f"a Gradio call body is limited to {self.limit} bytes; upload "
                                     "files with POST /gradio_api/upload and pass their paths"}, 413)
            await body(scope, receive, send)
            return
        refusal = gradio_body_refusal(body)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):
            await JSONResponse({"detail": "a Gradio call is a JSON body (files go to POST /gradio_api/upload)"},
                               400)(scope, receive, send)
            return
        if not all(self.records.holds(path) for path in _named_files(payload)):
            await JSONResponse({"detail": NOT_UPLOADED}, 400)(scope, receive, send)
            return
        await self.app(scope, replayed(body, receive), send)

    def upload_refusal(self, scope: Scope) -> JSONResponse | None:
        """An upload is one image: its declared length must fit one file of the upload limit (Gradio would take
        up to 1000 files a request, gigabytes written before the next prune)."""
        lengths = [value for name, value in scope["headers"] if name.lower() == b"content-length"]
        if len(lengths) != 1 or not lengths[0].isdigit():
            return JSONResponse({"detail": "an upload needs one Content-Length header"}, 411)
        if int(lengths[0]) > self.upload_limit:
            return JSONResponse({"detail": f"an upload is one image of at most {self.upload_limit - UPLOAD_SLACK} "
                                 "bytes (start the server with a larger --max-upload-mb)"}, 413)
        return None


def upload_parts_refusal(scope: Scope, body: bytes) -> JSONResponse | None:
    """A 400 for an upload of more parts than the app's one image needs, counted by its boundary in C before
    Gradio's parser (which handles every part on the event loop, and takes up to 1,000 files) sees it."""
    content_type = next((value for name, value in scope["headers"] if name.lower() == b"content-type"), b"")
    start = content_type.lower().find(b"boundary=")  # the parameter's name in any case; its value as sent
    boundary = content_type[start + len(b"boundary="):].split(b";")[0].strip().strip(b'"') if start >= 0 else b""
    if not boundary:
        return JSONResponse({"detail": "an upload is multipart/form-data with a boundary"}, 400)
    parts = body.count(b"--" + boundary) - 1  # the last delimiter closes the body
    if parts > MAX_UPLOAD_PARTS:
        return JSONResponse({"detail": f"an upload holds at most {MAX_UPLOAD_PARTS} files (the app sends one "
                             f"image), this one about {parts}"}, 400)
    return None


def gradio_body_refusal(body: bytes) -> JSONResponse | None:
    """A 413 for a call body of more values or deeper nesting than an event of this app has: measured before it is
    parsed, here and then again by Gradio, both on the event loop (bounded: at most ``GRADIO_JSON_BODY_LIMIT``)."""
    text = JsonText(body, 4 * GRADIO_MAX_VALUES)
    if (text.too_many or json_values(text.structure) > GRADIO_MAX_VALUES
            or json_depth(text.structure, 2 * GRADIO_MAX_VALUES + 2) > GRADIO_MAX_DEPTH):
        return JSONResponse({"detail": f"a Gradio call holds at most {GRADIO_MAX_VALUES} values nested at most "
                             f"{GRADIO_MAX_DEPTH} deep: this app's events take a few inputs"}, 413)
    return None


def prune_folder(folder: Path, max_age_s: float, max_bytes: int, keep: Iterable[str] = (),
                 now: float | None = None) -> list[Path]:
    """Delete files older than ``max_age_s``, then the oldest until the rest take ``max_bytes`` or less on disk.

    ``keep`` (Gradio's example copies) are counted but never deleted. Age is the later of mtime and ctime
    (Gradio touches a cached copy it hands out again). Returns the deleted files; empty subfolders go too.
    """
    now = time.time() if now is None else now
    keep = set(keep)
    files = []
    for root, _, names in os.walk(folder):
        for name in names:
            path = Path(root) / name
            try:
                st = path.lstat()
            except OSError:
                continue
            files.append((max(st.st_mtime, st.st_ctime), max(st.st_size, st.st_blocks * 512), path))
    files.sort(key=lambda f: f[0])
    total = sum(size for _, size, _ in files)
    removed = []
    for changed, size, path in files:
        if str(path) in keep or (now - changed <= max_age_s and total <= max_bytes):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        total -= size
        removed.append(path)
    for root, dirs, _ in os.walk(folder, topdown=False):
        for name in dirs:
            with contextlib.suppress(OSError):  # not empty, or gone
                (Path(root) / name).rmdir()
    return removed


class UploadPruner:
    """Keeps the upload folder of a mounted Blocks within an age and a size, from the app's lifespan."""

    def __init__(self, blocks: gr.Blocks, folder: Path, max_age_s: float, max_bytes: int, interval_s: float) -> None:
        self.blocks, self.folder = blocks, folder
        self.max_age_s, self.max_bytes, self.interval_s = max_age_s, max_bytes, interval_s

    def prune(self, max_age_s: float | None = None) -> list[Path]:
        """One pass; Gradio's own lists of its temporary files forget the deleted ones (no unbounded growth)."""
        removed = prune_folder(self.folder, self.max_age_s if max_age_s is None else max_age_s, self.max_bytes,
                               kept_files(self.blocks))
        gone = {str(path) for path in removed}
        for files in list(self.blocks.temp_file_sets):
            files.difference_update(gone)
        return removed

    async def run(self) -> None:
        while True:
            try:
                await anyio.to_thread.run_sync(self.prune)
            except Exception as exc:  # noqa: BLE001 - a failed pass must not end pruning for good
                log.warning("pruning the upload folder %s failed: %r", self.folder, exc)
            await asyncio.sleep(self.interval_s)

    def attach(self, app: FastAPI) -> None:
        """Prune while ``app`` serves; on shutdown delete every upload (the examples stay)."""
        inner = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(parent: Any) -> AsyncIterator[Any]:
            async with inner(parent) as state:
                task = asyncio.create_task(self.run())
                try:
                    yield state
                finally:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    self.blocks.is_running = False  # ends Gradio's heartbeat loops
                    self.prune(max_age_s=-1)

        app.router.lifespan_context = lifespan
