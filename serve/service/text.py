"""Text queries: a query's text checked (``text_query``), and the text model each served state embeds them with
(``StateText``): the one the server was started with (``--text-model``), else the one the index's index.json records
(`retrieval index text`), each checked against that state's image model.

A ``--text-model`` that does not fit the index refuses the start; one that stops fitting after a reload (an upgrade
to an image model of another space), or a recorded one that cannot be found or does not fit, leaves the state without
text search, logged, and a text query is then a 422 that says why (with no server path in it).

A query's cost is its tokens (``text_work``: what the batches lane charges, in images' worth of work); a query with
no word to search by is a 422 (``query_tokens``), and a text model that fails on a query a 503 (``embed_text_queries``:
the server's model is at fault, logged), never a 500.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.index.query_embedder import ImageEmbedder, hash_matches
from retrieval.records.index_info import IndexInfo
from retrieval.serve.defaults import TEXT_ATTENTION_TOKENS, TEXT_TOKENS_PER_IMAGE
from retrieval.serve.images import QueryError
from retrieval.text.text_index import (
    checked_text_model,
    has_text_model,
    open_text_model,
    text_off_problem,
)
from retrieval.text.text_onnx import TextEmbedder, TextEmbeddingError, TextModelError
from retrieval.text.tokens import WordlessText, check_query_text

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


def query_tokens(embedder: TextEmbedder, texts: Sequence[str], positions: Sequence[int] | None = None) -> list[int]:
    """Each text query's tokens (``TextEmbedder.query_tokens``); a 422 naming a query with no word to search by (by
    its place in a batch, ``positions``), a 503 where the text model's tokenizer fails."""
    try:
        return embedder.query_tokens(texts)
    except WordlessText as exc:
        where = "" if positions is None else f"queries[{positions[exc.position]}]: "
        raise QueryError(f"{where}{exc}", 422) from None
    except TextEmbeddingError as exc:
        raise _failed(exc) from None


def batch_text_work(embedder: TextEmbedder | None, queries: Sequence[Any]) -> int:
    """What a batch's text queries cost the batches lane (``text_work``; each 1 where the state has no text model,
    which refuses them); a 422 for one with no word to search by, before the batch waits for a turn."""
    texts = {position: query.text for position, query in enumerate(queries) if isinstance(query, TextQuery)}
    if not texts or embedder is None:
        return len(texts)
    return text_work(query_tokens(embedder, list(texts.values()), list(texts)))


def text_work(tokens: Sequence[int]) -> int:
    """What embedding texts of ``tokens`` tokens costs, in images' worth of the batches lane (at least 1): each text's
    tokens, its attention's square term included, over the tokens that cost one image."""
    work = sum(n * (1 + n / TEXT_ATTENTION_TOKENS) for n in tokens)
    return max(1, math.ceil(work / TEXT_TOKENS_PER_IMAGE))


def embed_text_queries(embedder: TextEmbedder, texts: Sequence[str],
                       positions: Sequence[int] | None = None) -> np.ndarray:
    """``texts`` embedded (``TextEmbedder.embed``) once each has a word to search by (``query_tokens``: else a 422);
    a text model that fails is a 503 saying so (the server's model is at fault; the log has the details)."""
    query_tokens(embedder, texts, positions)
    try:
        return embedder.embed(texts)
    except TextEmbeddingError as exc:
        raise _failed(exc) from None


def _failed(exc: TextEmbeddingError) -> QueryError:
    log.error("the text model failed on a query: %s", exc)
    return QueryError("this server's text model failed to embed the query (a fault of the server's model, not of "
                      "the query: its operator's log says why); search by image meanwhile, or ask the operator to "
                      "export the text model again with `retrieval text train`", 503)


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


def state_text(info: IndexInfo, index_root: Path, image_model: ImageEmbedder, given: TextEmbedder | None,
               previous: StateText | None) -> StateText:
    """The text model of a state whose index.json is ``info`` (``image_model``: the model that embeds its image
    queries): ``given`` (``--text-model``), else the one ``info`` records (the ``previous`` state's, when it records
    the same), each checked against the index. ``given`` not fitting the first state (``previous`` None) raises
    ``TextModelError``: the server refuses to start."""
    if given is None and not has_text_model(info):  # an upgrade may have turned it off: the 422 says why
        model = Path(str(info.model.path or "MODEL.onnx")).name  # no server folder in what clients read
        return StateText(problem=text_off_problem(info.text.off, "<index>", model))
    try:
        if given is not None:
            return StateText(checked_text_model(given, info, index_root, image_model))
        kept = previous.embedder if previous is not None else None
        if kept is not None and hash_matches(info.text.hash, kept):  # loaded once, while it is recorded
            return StateText(checked_text_model(kept, info, index_root, image_model))
        return StateText(open_text_model(info, index_root, image_model=image_model))
    except (TextModelError, OSError) as exc:  # OSError: a recorded file that cannot be read
        if given is not None and previous is None:
            raise
        log.warning("text search is off for the index in %s: %s", index_root, exc)
        return StateText(problem=_public(exc, index_root, given, info))


def _public(exc: Exception, index_root: Path, given: TextEmbedder | None, info: IndexInfo) -> str:
    """A text model's problem as clients may read it: the file by its name, the index as <index>, and what to do."""
    problem = exc.problem if isinstance(exc, TextModelError) else None
    if problem is None or (given is None and "no file has that hash" in problem):  # such messages name folders
        return (f"the text model the index records (text_model_hash {info.text.hash}) cannot be read "
                f"where it was recorded (the server's log says why); {START_WITH_ONE}")
    if given is not None:
        problem = problem.replace(str(given.path), given.path.name)
    for folder in {str(index_root.resolve()), str(index_root.absolute()), str(index_root)}:
        problem = problem.replace(folder, "<index>")
    recorded = info.text.path
    if isinstance(recorded, str) and recorded:
        problem = problem.replace(recorded, Path(recorded).name)
    return f"the text model {problem}"
