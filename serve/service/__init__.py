"""``SearchService``: an index folder (ONNX embedder + faiss + catalogue) answering searches from any thread,
and following its writers; this module opens and holds the states it serves, and each job over them is a base class
of its own module (``search``, ``items``, ``stats``).

Image queries are preprocessed in the caller's thread and embedded by a ``MicroBatcher``, so requests
that arrive together share one model call; the search itself is ``Index.search`` (faiss is thread-safe, the
catalogue is read through per-thread read-only connections) and runs in the caller's thread.

The index is served as ``ServedIndex`` states (``retrieval.index.live``): a watcher swaps in a new state about a
second after a writer (``retrieval index add/remove/...``) finishes, and each request uses the one state it took
at its start, so it sees the index before or after a change, never a mix (see ``retrieval.index.live``).

Text queries are embedded by each state's text model (``retrieval.serve.service.text``): ``text_model`` (loaded once,
checked against each state), else the one the state's index.json records, loaded once while it stays recorded.

- ``state``: one opened state of the index (``ServedIndex``) and the model its queries are embedded with.
- ``text``: text queries checked, and the text model each served state embeds them with (``StateText``).
- ``answers``: what a search answers (``SearchResponse``), and how clients address an item.
- ``checks``: a search's inputs checked before it runs, each refusal a ``QueryError`` (422).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

from retrieval.index.live import RELOAD_INTERVAL_S, LiveIndex
from retrieval.index.milvus.milvus_collection import MilvusPlace
from retrieval.index.query_embedder import ImageEmbedder
from retrieval.index.searchable.opening import IndexPlace, index_place
from retrieval.serve.defaults import DEFAULT_MAX_PIXELS, DEFAULT_MAX_UPLOAD_BYTES
from retrieval.serve.service.answers import SearchResponse
from retrieval.serve.service.items import ItemFiles
from retrieval.serve.service.search import Searching
from retrieval.serve.service.state import ServedIndex, SharedModel
from retrieval.serve.service.stats import Statistics
from retrieval.serve.service.text import state_text
from retrieval.text.text_onnx import TextEmbedder

# the package's public names: ``retrieval.serve`` exports SearchService and SearchResponse from here
__all__ = ["SearchResponse", "SearchService", "ServedIndex"]


class SearchService(Searching, ItemFiles, Statistics):
    """Open ``index_dir`` (a folder, or an ``IndexPlace``; ``milvus``: the collection served instead);
    ``search(image | embedding, k)`` from many threads, over the index's current state.

    ``live`` swaps in a new ``ServedIndex`` within about ``reload_interval_s`` once a writer (``retrieval index
    add/remove/repair/build``) has finished; None: never. The service has no per-fact accessors of the index (two
    of them could read two states): an answer takes one state, ``current()`` or held with ``acquire()``, and reads
    its index, catalogue, model and batcher from it.
    """

    def __init__(
        self,
        index_dir: str | Path | IndexPlace,
        embedder: ImageEmbedder | None = None,
        max_batch: int = 32,
        max_wait_ms: float = 5.0,
        max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        reload_interval_s: float | None = RELOAD_INTERVAL_S,
        gallery_root: str | Path | None = None,
        milvus: MilvusPlace | None = None,
        text_model: str | Path | None = None,
    ) -> None:
        self.place = index_place(index_dir, milvus)  # what is served: a folder or a collection (``searchable``)
        # the text model given (--text-model): loaded once, before the first state checks it against the index
        self._text = TextEmbedder(text_model) if text_model is not None else None
        self.index_dir = self.place.root  # where index.json's relative paths start (a collection: its name)
        self.gallery_root = gallery_root  # where the gallery moved (--gallery-root); None: found from index.json
        self.max_upload_bytes, self.max_pixels = int(max_upload_bytes), int(max_pixels)
        self._embedder, self._batching = embedder, (max_batch, max_wait_ms)
        self.generation = 0  # states opened, each swapped in at once (1: the first); /metrics counts reloads by it
        self.live: LiveIndex[ServedIndex] = LiveIndex(self.index_dir, self._open_state, reload_interval_s,
                                                      identity=self.place.watch())

    def _open_state(self, previous: ServedIndex | None) -> ServedIndex:
        """The index's state now; its model is the previous state's unless the index records another one."""
        snapshot = self.place.open_state(self._embedder, self.gallery_root, first=previous is None)
        model = None
        try:
            # the same model and output (an upgrade from a compatible output to the model's own keeps its hash)
            if previous is not None and (previous.index.model_hash, previous.index.model_output) == (
                    snapshot.model_hash, snapshot.model_output):
                model = previous.model
                snapshot.embedder = model.embedder
            else:  # loads the ONNX model recorded in index.json now, not per request
                model = SharedModel(snapshot.embedder, *self._batching)
            text = state_text(snapshot.info, self.index_dir, model.embedder, self._text,
                              previous.text if previous is not None else None)
            state = ServedIndex(snapshot, model, text)
            self.generation += 1  # opens are serialised (LiveIndex's reload lock, or the constructor)
            return state
        except BaseException:
            snapshot.close()
            if model is not None and model.users == 0:
                model.batcher.close()
            raise

    def reload(self) -> bool:
        """Swap in the index folder's new state now if a writer changed it; whether it swapped."""
        return self.live.reload()

    # --- the served state: every fact of one answer is read from ONE state, taken once
    def current(self) -> ServedIndex:
        """The state served now, not held: a reload may replace it at any moment, so an answer takes it ONCE and
        reads every fact from the object returned (work that takes longer holds one: ``acquire``)."""
        return self.live.current

    def acquire(self) -> AbstractContextManager[ServedIndex]:
        """The state served now, held open for the ``with`` block even if a reload replaces it meanwhile."""
        return self.live.acquire()

    def __len__(self) -> int:
        """The vectors served now: one fact of one state (several facts of one state: ``current()``)."""
        return len(self.live.current)

    def close(self) -> None:
        """Stop watching the folder; each state's catalogue and batcher close once no request holds it."""
        self.live.close()
