"""The process heap (glibc's malloc): give freed memory back to the system, or keep it for the next batch.

Two opposite needs. A server decoding hostile images gives a large decode's memory back at once (``trim_heap``).
A training or embedding loop frees and allocates the same large tensors at every batch: glibc serves blocks over
its mmap threshold with fresh mappings and trims the top of the heap as soon as it is free, so every batch pays
its activations again in page faults and page zeroing. On 2 cores, embedding EfficientNet-Lite0 batches of 128
at 128 px spent almost as much time in the kernel as in the model (measured with benchmarks/heap.py). Inside
``kept_heap`` glibc keeps freed memory in the heap instead, and gives it back when the block ends.

Both are no-ops where the C library is not glibc (musl, macOS, Windows).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator

# mallopt(3) parameters and glibc's documented defaults
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
GLIBC_DEFAULTS = {M_TRIM_THRESHOLD: 128 * 1024, M_MMAP_MAX: 65536}
# no fresh mapping for a large block, and the free top of the heap is kept up to the largest value mallopt takes
KEPT = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 2**31 - 1}


def _libc_function(name: str, argtypes: list) -> Callable[..., int] | None:
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


_MALLOC_TRIM = _libc_function("malloc_trim", [ctypes.c_size_t])
_MALLOPT = _libc_function("mallopt", [ctypes.c_int, ctypes.c_int]) if _MALLOC_TRIM is not None else None
_kept_depth = 0
_kept_lock = threading.Lock()


def trim_heap() -> None:
    """Give the heap memory freed so far back to the system (glibc's ``malloc_trim``); a no-op elsewhere.

    glibc keeps the freed blocks of a large decode: it raises its mmap threshold once a big block is freed, so
    the next 16 MB blocks of Pillow's images come from the heap, and every thread has a heap (arena) of its own.
    Decoding the worst images in a server's 16 threads, the process stayed 0.9 to 1.5 GB above idle afterwards
    (and peaked at 3x the decode budget); ``read_image`` calls this after every large decode.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _set(params: dict[int, int]) -> None:
    for param, value in params.items():
        _MALLOPT(param, value)


@contextlib.contextmanager
def kept_heap() -> Iterator[None]:
    """Keep freed memory in the heap for the ``with`` block (a loop over batches); on leaving the outermost block,
    glibc's defaults are set again and the kept memory is given back. Nests; a no-op where there is no glibc.

    The process' peak memory stays about the same (the loop's largest batch; within 6 % in benchmarks/heap.py);
    it is held until the block ends. glibc's
    own adjustment of its thresholds stays off afterwards (any mallopt call ends it): the defaults it returns to
    give memory back at least as soon as before.
    """
    global _kept_depth
    if _MALLOPT is None:
        yield
        return
    with _kept_lock:
        _kept_depth += 1
        if _kept_depth == 1:
            _set(KEPT)
    try:
        yield
    finally:
        with _kept_lock:
            _kept_depth -= 1
            if _kept_depth == 0:
                _set(GLIBC_DEFAULTS)
                trim_heap()
