"""Python's cyclic garbage collector in a server: the start-up heap out of its reach while the server runs.

A full collection walks every tracked object in the process, with the GIL held, so every request and /health wait
for it: about 210,000 objects in ``retrieval serve`` (Gradio, FastAPI, onnxruntime, faiss; ~0.1 s on a slow core),
several times that where a process also tests or trains (docs/SECURITY.md, "Availability"). Most of what exists
once the server has started lives as long as the server: ``frozen_heap`` collects, then moves it into the permanent
generation (``gc.freeze``), so a collection walks only what was allocated since. Frozen objects are still freed by
reference counting (a replaced index state is, tested); only reference cycles among them wait until the last server
in the process stops (``gc.unfreeze``).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

_lock = threading.Lock()
_holders = 0  # servers running in this process (tests run several at once): the last one to stop unfreezes


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """While held, what the process holds on entry (less its garbage) is out of the cyclic collector's walks."""
    global _holders
    # garbage is freed, not frozen (cheap once a first server froze the rest); outside the lock, since a finalizer
    # it runs may stop another server
    gc.collect()
    with _lock:
        gc.freeze()  # cumulative: a second server's start-up objects join the first's
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                gc.unfreeze()


def freeze_after_startup(app: Any) -> None:
    """Freeze the heap of the Starlette/FastAPI ``app``'s process from its start (everything mounted in it started,
    before uvicorn listens) to its shutdown. Call it after the last mount: it wraps the lifespan there is."""
    started: Callable[[Any], contextlib.AbstractAsyncContextManager] = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(inner_app: Any) -> AsyncIterator[Any]:
        async with started(inner_app) as state:
            with frozen_heap():
                yield state

    app.router.lifespan_context = lifespan
