"""Text queries: a query's text checked (``text_query``), and the text model each served state embeds them with
(``StateText``): the one the server was started with (``--text-model``), else the one the index's index.json records
(`retrieval index text`), each checked against that state's image model.

A ``--text-model`` that does not fit the index refuses the start; one that stops fitting after a reload (an upgrade
to an image model of another space), or a recorded one that cannot be found or does not fit, leaves the state without
text search, logged, and a text query is then a 422 that says why (with no server path in it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrieval.index.query_embedder import ImageEmbedder
from retrieval.serve.images import QueryError
from retrieval.text.text_index import TEXT_MODEL_HASH, checked_text_model, has_text_model, open_text_model
from retrieval.text.text_onnx import TextEmbedder, TextModelError
from retrieval.text.tokens import check_query_text

log = logging.getLogger(__name__)

START_WITH_ONE = ("start the server with one (`retrieval serve --index INDEX --text-model TEXT.onnx`: the text.onnx "
                  "that `retrieval text train` writes), or record one in the index (`retrieval index text INDEX "
                  "--text-model TEXT.onnx`), which a running server takes up at its next reload")


@dataclass(frozen=True)
class TextQuery:
    """A query in words (checked and stripped: ``text_query``), embedded by the served state's text model."""

    text: str


def text_query(value: Any, subject: str = "the JSON body") -> TextQuery:
    """A JSON ``text`` as a query, or a 422 saying what is wrong with it (not a string, empty, too long, a lone
    surrogate: ``retrieval.text.tokens.check_query_text``)."""
    try:
        return TextQuery(check_query_text(value))
    except ValueError as exc:
        raise QueryError(f"{subject}: {exc}", 422) from exc


@dataclass(frozen=True)
class StateText:
    """The text model of one served state (None: no text search), and why it has none where one was asked for
    (``problem``: what a text query's 422 says; no server path in it)."""

    embedder: TextEmbedder | None = None
    problem: str | None = None

    def refusal(self) -> QueryError:
        """The 422 of a text query to a state without a text model: why, and how to give it one."""
        if self.problem is not None:
            return QueryError(f"this server cannot search by text now: {self.problem}", 422)
        return QueryError(f"this server has no text model, so it cannot search by text; {START_WITH_ONE}", 422)

    def describe(self) -> dict[str, Any]:
        """What /stats says of text search (``text_model_path``: a server path, for the operator)."""
        if self.embedder is None:
            return {"text_search": False, "text_model": None,
                    **({"text_model_problem": self.problem} if self.problem else {})}
        return {"text_search": True, "text_model": {
            "text_model_path": str(self.embedder.path), "text_model_hash": self.embedder.model_hash,
            "image_model_hash": self.embedder.image_model_hash, "embedding_dim": self.embedder.dim}}


def state_text(info: Mapping[str, Any], index_root: Path, image_model: ImageEmbedder, given: TextEmbedder | None,
               previous: StateText | None) -> StateText:
    """The text model of a state whose index.json is ``info`` (``image_model``: the model that embeds its image
    queries): ``given`` (``--text-model``), else the one ``info`` records (the ``previous`` state's, when it records
    the same), each checked against the index. ``given`` not fitting the first state (``previous`` None) raises
    ``TextModelError``: the server refuses to start."""
    if given is None and not has_text_model(info):
        return StateText()
    try:
        if given is not None:
            return StateText(checked_text_model(given, info, index_root, image_model))
        kept = previous.embedder if previous is not None else None
        if kept is not None and kept.model_hash == info.get(TEXT_MODEL_HASH):  # loaded once, while it is recorded
            return StateText(checked_text_model(kept, info, index_root, image_model))
        return StateText(open_text_model(info, index_root, image_model=image_model))
    except (TextModelError, OSError) as exc:  # OSError: a recorded file that cannot be read
        if given is not None and previous is None:
            raise
        log.warning("text search is off for the index in %s: %s", index_root, exc)
        return StateText(problem=_public(exc, index_root, given, info))


def _public(exc: Exception, index_root: Path, given: TextEmbedder | None, info: Mapping[str, Any]) -> str:
    """A text model's problem as clients may read it: the file by its name, the index as <index>, and what to do."""
    problem = exc.problem if isinstance(exc, TextModelError) else None
    if problem is None or (given is None and "no file has that hash" in problem):  # such messages name folders
        return (f"the text model the index records (text_model_hash {info.get(TEXT_MODEL_HASH)}) cannot be read "
                f"where it was recorded (the server's log says why); {START_WITH_ONE}")
    if given is not None:
        problem = problem.replace(str(given.path), given.path.name)
    for folder in {str(index_root.resolve()), str(index_root.absolute()), str(index_root)}:
        problem = problem.replace(folder, "<index>")
    recorded = info.get("text_model_path")
    if isinstance(recorded, str) and recorded:
        problem = problem.replace(recorded, Path(recorded).name)
    return f"the text model {problem}"
