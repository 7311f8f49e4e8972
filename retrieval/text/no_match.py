"""An honest "no good match" for text queries: a per-index floor under which a text query's best vector score says
that the gallery holds nothing the words describe (``no_match``), though its nearest images are still shown.

Cosine scores of a text tower are not comparable across galleries or towers (a shop's right answers score 0.41-0.52
with one tower, and so do its wrong ones for a product it does not sell), so the floor is measured on each index with
its text model (``calibrate_no_match``): everyday texts from many domains (``no_match_texts``), each searched
against the gallery with the index's own search; the few the gallery answers far better than the rest are left out
(``ANSWERED_IQR``: above the upper fence of the scores, the gallery sells those), and the floor is the ``QUANTILE``
of the rest's best scores: a query the gallery does not answer scores below it about that often.
``docs/TEXT.md`` ("No good match") has the measured false rates.

index.json keeps the calibration under ``text_no_match``, with the hashes of the text model and the image model it
was measured with: ``read_floor`` refuses a record of another text model (a search with another ``text_model``: no
claim is made) or one whose values are not a calibration (a floor that is not a number in [-1, 1]), saying why.
Core: numpy and the index's search; no torch.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from retrieval.records.index_info import IndexInfo
from retrieval.text.no_match_texts import CALIBRATION_SOURCE, CALIBRATION_TEXTS

TEXT_NO_MATCH = "text_no_match"  # index.json's key
QUANTILE = 0.75  # the target share of absent products said no_match; measured: benchmarks/no_match.py
ANSWERED_IQR = 1.5  # a text whose best score is above Q3 + this x IQR is one the gallery answers (Tukey's fence)
KEYWORD_SOURCES = ("keyword", "both")  # a hit with a keyword match is a match whatever its score
MAX_LEFT_OUT_KEPT = 64  # the left-out texts index.json names (the record stays small)


class Searchable(Protocol):
    """What calibration needs of an index: its size and its search (``retrieval.index.Index``)."""

    def __len__(self) -> int: ...

    def search_arrays(self, embeddings: np.ndarray, k: int = 10) -> tuple[np.ndarray, np.ndarray]: ...


class Embeds(Protocol):
    """What calibration needs of a text model (``retrieval.text.text_onnx.TextEmbedder``)."""

    model_hash: str

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


def best_scores(index: Searchable, vectors: np.ndarray) -> np.ndarray:
    """Each vector's best cosine score against the gallery [n] (the index's own search, as a query gets it)."""
    scores, ids = index.search_arrays(np.asarray(vectors, np.float32), 1)
    best = scores[:, 0].astype(np.float64)
    best[ids[:, 0] < 0] = np.nan  # nothing found (an empty index): no score
    return best


def floor_of(best: np.ndarray, quantile: float = QUANTILE) -> tuple[float, np.ndarray]:
    """The floor from the calibration texts' best scores [n], and the mask of the texts it kept: those the gallery
    does not answer far better than the rest (at or under Q3 + ``ANSWERED_IQR`` x IQR); the floor is their
    ``quantile`` (linear interpolation, numpy's default). ValueError for fewer than 2 finite scores."""
    best = np.asarray(best, np.float64)
    finite = np.isfinite(best)
    if finite.sum() < 2:
        raise ValueError(f"{int(finite.sum())} calibration texts have a score; at least 2 are needed")
    q1, q3 = np.quantile(best[finite], [0.25, 0.75])
    kept = finite & (best <= q3 + ANSWERED_IQR * (q3 - q1))
    return float(np.quantile(best[kept], quantile)), kept


def calibration_record(best: np.ndarray, texts: Sequence[str], text_model_hash: str, model_hash: str | None,
                       images: int, quantile: float = QUANTILE, source: str = CALIBRATION_SOURCE) -> dict[str, Any]:
    """index.json's ``text_no_match`` from the calibration texts' best scores (``floor_of``)."""
    floor, kept = floor_of(best, quantile)
    answered = sorted((-score, text) for text, keep, score in zip(texts, kept, best, strict=True)
                      if not keep and np.isfinite(score))  # the best answered first
    left_out = [text for _, text in answered]
    used = best[kept]
    return {"floor": round(floor, 6), "text_model_hash": text_model_hash, "model_hash": model_hash,
            "quantile": quantile, "texts": int(kept.sum()), "left_out": len(left_out),
            "left_out_texts": left_out[:MAX_LEFT_OUT_KEPT], "images": int(images), "source": source,
            "best_scores": {"min": round(float(used.min()), 6), "median": round(float(np.median(used)), 6),
                            "max": round(float(used.max()), 6)}}


def calibrate_no_match(index: Searchable, text: Embeds, model_hash: str | None,
                       vectors: np.ndarray | None = None, texts: Sequence[str] = CALIBRATION_TEXTS,
                       quantile: float = QUANTILE) -> dict[str, Any] | None:
    """The ``text_no_match`` record of ``index`` searched with ``text`` (``vectors``: ``texts`` already embedded by
    it); None for an index of fewer than 2 images (no floor means anything there)."""
    if len(index) < 2:
        return None
    if vectors is None:
        vectors = text.embed(list(texts))
    return calibration_record(best_scores(index, vectors), texts, text.model_hash, model_hash, len(index), quantile)


@dataclass(frozen=True)
class NoMatchFloor:
    """The floor a text query's answer is judged by (``floor``), or why no judgement is made (``problem``)."""

    floor: float | None = None
    problem: str | None = None
    record: Mapping[str, Any] | None = None  # the calibration as index.json keeps it (checked)

    def verdict(self, results: Sequence[Any]) -> bool | None:
        """Whether a text query's ``results`` (best first; each with ``score`` and, where keywords were searched,
        ``source``) hold no good match: no hit has a keyword match and the best vector score is under the floor.
        None where no floor applies (no claim is made)."""
        if self.floor is None:
            return None
        sources = [_field(r, "source") for r in results]
        if any(source in KEYWORD_SOURCES for source in sources):
            return False
        scores = [float(_field(r, "score")) for r, source in zip(results, sources, strict=True) if source != "keyword"]
        return not scores or max(scores) < self.floor

    def answer_field(self, results: Sequence[Any]) -> dict[str, bool]:
        """A text query's answer's ``no_match`` (``verdict``); nothing where no floor applies."""
        verdict = self.verdict(results)
        return {} if verdict is None else {"no_match": verdict}

    def describe(self) -> dict[str, Any]:
        """What /stats and `index stats` say of it: the floor and how it was calibrated, or why there is none."""
        if self.floor is None:
            return {"calibrated": False, "problem": self.problem}
        return {"calibrated": True, **dict(self.record or {})}


def _field(result: Any, name: str) -> Any:
    return result.get(name) if isinstance(result, Mapping) else getattr(result, name, None)


def recalibrate_hint(index_shown: str) -> str:
    """The command that measures the floor again (recording the text model calibrates it)."""
    return f"record the text model again to measure it: `retrieval index text {index_shown} --text-model FILE`"


def read_floor(info: IndexInfo, text_model_hash: str | Sequence[str] | None,
               index_shown: str = "INDEX") -> NoMatchFloor:
    """The floor index.json (``info``) records for the text model ``text_model_hash`` (every hash it goes by:
    ``TextEmbedder.model_hashes``, a floor recorded before names its legacy one; None: no text model), checked: a
    record of another text model or image model, or with values that are not a calibration, makes no floor (its
    ``problem`` says why and how to measure it again)."""
    record = info.calibrations.text_no_match
    hashes = (text_model_hash,) if isinstance(text_model_hash, str) else tuple(text_model_hash or ())
    if not hashes:
        return NoMatchFloor(problem="no text model: text queries are not answered")
    if record is None and info.vectors.vectors_in:  # a Milvus collection holds them
        return NoMatchFloor(problem="not calibrated: the floor is measured with a folder's own vector index, and "
                                    "this index keeps its vectors in a Milvus collection")
    if record is None:
        return NoMatchFloor(problem=f"not calibrated for this index; {recalibrate_hint(index_shown)}")
    if not isinstance(record, Mapping):
        return NoMatchFloor(problem=f"index.json's {TEXT_NO_MATCH} is a {type(record).__name__}, not the record "
                                    f"of a calibration; {recalibrate_hint(index_shown)}")
    floor = record.get("floor")
    if isinstance(floor, bool) or not isinstance(floor, numbers.Real) or not math.isfinite(floor) \
            or not -1.0 <= float(floor) <= 1.0:
        return NoMatchFloor(problem=f"index.json's {TEXT_NO_MATCH} floor is {repr(floor)[:40]}, not a cosine score "
                                    f"in [-1, 1]; {recalibrate_hint(index_shown)}")
    recorded = record.get("text_model_hash")
    if recorded not in hashes:
        return NoMatchFloor(problem=f"calibrated for another text model (text_model_hash {repr(recorded)[:40]}, "
                                    f"not {hashes[0]}); {recalibrate_hint(index_shown)}")
    model = record.get("model_hash")
    if model is not None and model != info.model.hash:
        return NoMatchFloor(problem=f"calibrated on vectors of another image model (model_hash {repr(model)[:40]}, "
                                    f"not {info.model.hash}); {recalibrate_hint(index_shown)}")
    shown = {key: record[key] for key in ("quantile", "texts", "left_out", "images", "source", "best_scores")
             if key in record and _plain(record[key])}
    return NoMatchFloor(float(floor), record={"floor": float(floor), "text_model_hash": recorded, **shown})


def _plain(value: Any) -> bool:
    """A small JSON value a report may repeat (a hostile record's giant lists and strings are not repeated)."""
    if isinstance(value, Mapping):
        return len(value) <= 8 and all(not isinstance(v, (Mapping, str)) and _plain(v) for v in value.values())
    if isinstance(value, str):
        return len(value) <= 200
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
