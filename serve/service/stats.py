"""What the served index is and measures: ``SearchService.describe``, ``health``, its statistics and leave-one-out,
and the view of them clients may see (no server folder)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path, PurePath
from typing import Any

from retrieval.index.live import LiveIndex
from retrieval.index.searchable.opening import IndexPlace
from retrieval.serve.diagnostics import LeaveOneOut
from retrieval.serve.service.state import ServedIndex


class Statistics:
    """``SearchService``'s facts and summaries of a state: cheap ones (``health``, ``describe``) and the slower ones,
    computed once per state."""

    # set by SearchService: what it serves (a folder or a collection), where its relative paths start, its states
    place: IndexPlace
    index_dir: Path
    live: LiveIndex[ServedIndex]
    current: Callable[[], ServedIndex]

    def health(self) -> dict[str, int]:
        """The vectors and dimension of one state (GET /health), once it can be searched (a Milvus collection it
        cannot reach or load raises ``MilvusUnavailable``: 503)."""
        state = self.current()
        state.index.check_ready()
        return {"vectors": len(state), "embedding_dim": state.index.dim}

    def text_search(self) -> bool:
        """Whether the state served now searches by text (it has a text model, or a keyword index)."""
        state = self.current()
        return state.text.embedder is not None or state.keywords is not None

    def describe(self, state: ServedIndex | None = None) -> dict[str, Any]:
        """The index and model of ``state`` (default: the current one) for the operator: server paths included."""
        state = self.current() if state is None else state
        return {
            "index_dir": self.place.shown,  # for the operator (logs, UI); the API shows names only
            "vectors": len(state),
            "embedding_dim": state.index.dim,
            "index_key": state.index.info.vectors.index_key,
            "model_hash": state.index.model_hash,
            "model_path": state.index.info.model.path,
            # built from embeddings: no model, so no input size (image queries are refused)
            "input_size": state.embedder.preprocessing.input_size if state.index.has_model else None,
            **({} if state.index.has_model else {"source": state.index.info.catalogue.source}),
            **state.text.describe(),  # text search: on, with its text model, or off (and why, where one was asked)
            "text_no_match": state.no_match.describe(),  # the "no good match" floor and its calibration, or why none
        }

    # --- slower summaries, computed once per state
    def index_stats(self) -> dict[str, Any]:
        with self.live.acquire() as state:
            return state.index_stats()

    def public_stats(self, state: ServedIndex | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """``describe()`` and ``index_stats()`` of one state (``state``, held by the caller; default: the current
        one, held here) as clients may see them (API ``/stats``, the app's Index tab): the index and model as file
        names, gallery files relative to the gallery root, no server folder anywhere."""
        if state is not None:
            return self._public_stats(state)
        with self.live.acquire() as held:
            return self._public_stats(held)

    def _public_stats(self, state: ServedIndex) -> tuple[dict[str, Any], dict[str, Any]]:
        def name(path: Any) -> Any:
            return PurePath(path).name if path else path

        def scrub(text: Any) -> Any:  # error messages may quote a server path
            if not isinstance(text, str):
                return text
            for folder, shown in ((str(state.gallery_root), "<gallery>"), (str(state.index.gallery.root), "<gallery>"),
                                  (self.place.shown, "<index>")):  # the gallery where recorded, and now
                text = text.replace(folder, shown) if folder not in ("", "/", ".") else text
            return text

        described = self.describe(state)
        described |= {"index_dir": self.place.name, "model_path": name(described["model_path"])}
        if described["text_model"] is not None:
            described["text_model"] = described["text_model"] | {
                "text_model_path": name(described["text_model"]["text_model_path"])}
        index = state.index_stats()
        index = index | {"index_dir": name(index.get("index_dir"))}
        if isinstance(index.get("model"), dict):
            index["model"] = index["model"] | {"model_path": name(index["model"].get("model_path"))}
            if "embeddings_dir" in index["model"]:  # built from embeddings: the folder's name, as the model's
                index["model"]["embeddings_dir"] = name(index["model"]["embeddings_dir"])
        neighbours = state.neighbour_scores()  # what a query's best score is read against (docs/SERVING.md)
        index["neighbour_similarity"] = neighbours.to_dict() if neighbours is not None else None
        index["error_examples"] = [
            row | {"path": state.public_path(row["path"]) if row.get("path") else row.get("path"),
                   "error": scrub(row.get("error"))}
            for row in index.get("error_examples", [])
        ]
        return described, index

    def leave_one_out(self) -> LeaveOneOut:
        with self.live.acquire() as state:
            return state.leave_one_out()
