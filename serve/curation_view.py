"""The served index's near-duplicate groups and label suspects, for the app's Evaluation tab beside its per-class
analysis: computed when asked for, bounded (a seeded sample of ``APP_MAX_IMAGES`` images searched, ``APP_K``
neighbours each; ``auto`` plants copies of ``APP_CALIBRATION_SAMPLE`` images), and kept for the state they were
computed on, so a second click costs nothing and a reload of the index computes them afresh."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

from PIL import Image

from retrieval.analysis.neighbour_pictures import duplicates_picture, suspects_picture
from retrieval.data.decode import read_image
from retrieval.errors import ParameterError
from retrieval.index.curation.audit import audit_index
from retrieval.index.curation.catalogued_images import picture_background
from retrieval.index.curation.duplicates import advice, find_duplicates
from retrieval.index.curation.duplicates_threshold import Calibration, calibrate_on_index
from retrieval.index.curation.neighbour_graph import NeighbourGraph, index_graph
from retrieval.serve.service import SearchService, ServedIndex

APP_MAX_IMAGES = 20_000  # images searched: about 30 s on 2 cores at 1M vectors (docs/BENCHMARKS.md)
APP_K = 10
APP_CALIBRATION_SAMPLE = 50  # auto embeds 4 copies of each with the served model
GROUPS_LISTED = 100
SUSPECTS_LISTED = 100


class ThresholdError(ValueError):
    """The threshold typed is neither auto nor a cosine."""


def parse_threshold(text: str | None) -> float | str:
    """``auto`` (also empty) or a cosine within [-1, 1]; anything else is a ThresholdError that says what to type."""
    cleaned = (text or "").strip().lower()
    if cleaned in ("", "auto"):
        return "auto"
    try:
        value = float(cleaned)
    except ValueError:
        value = math.nan
    if not -1.0 <= value <= 1.0:
        raise ThresholdError(f"the threshold is auto or a cosine between -1 and 1 (e.g. 0.95), not "
                             f"{(text or '')[:40]!r}")
    return value


class CurationView:
    """Near-duplicate groups and label suspects of the service's current state, each computed once per state."""

    def __init__(self, service: SearchService) -> None:
        self.service = service
        self._lock = threading.Lock()  # one computation at a time: a second click waits for the first's answer
        self._state_key: object = None
        self._graph: NeighbourGraph | None = None
        self._calibration: Calibration | None = None
        self._audit: tuple[dict[str, Any], Image.Image | None] | None = None

    def _for(self, state: ServedIndex) -> None:
        """Forget what was computed on another state (the index was reloaded since)."""
        if self._state_key != state.identity:
            self._state_key, self._graph, self._calibration, self._audit = state.identity, None, None, None

    def _graph_of(self, state: ServedIndex) -> NeighbourGraph:
        if self._graph is None:
            self._graph = index_graph(state.index, APP_K, APP_MAX_IMAGES)
        return self._graph

    def loader(self, state: ServedIndex) -> Callable[[int], Image.Image | None]:
        """``load(id)``: an indexed image of ``state`` read as the app reads it (a regular file, the one decoder)."""
        def load(image_id: int) -> Image.Image | None:
            path = self.service.image_path(image_id, state)
            if path is None:
                return None
            try:
                return read_image(path).image
            except Exception:  # noqa: BLE001  (an unreadable file is passed over or drawn grey)
                return None

        return load

    def duplicates(self, threshold: float | str) -> tuple[dict[str, Any], Image.Image | None]:
        """``find_duplicates`` of the current state at ``threshold`` (auto: calibrated once per state), and its
        picture."""
        with self.service.acquire() as state, self._lock:
            self._for(state)
            graph = self._graph_of(state)
            load = self.loader(state)
            if threshold == "auto":
                if self._calibration is None:
                    self._calibration = calibrate_on_index(state.index, graph, load, state.embedder,
                                                           APP_CALIBRATION_SAMPLE)
                cut: float = self._calibration.threshold
            else:
                cut = float(threshold)
            summary = find_duplicates(state.index, cut, graph=graph, max_groups=GROUPS_LISTED)
            if threshold == "auto" and self._calibration is not None:
                summary["calibration"] = self._calibration.to_dict()
                summary |= advice(summary["calibration"], summary["groups"])  # its warning too
            return summary, duplicates_picture(summary, load, background=picture_background(state.embedder))

    def suspects(self) -> tuple[dict[str, Any] | None, Image.Image | None, str | None]:
        """``audit_index`` of the current state (once per state) and its picture; or why there is none."""
        with self.service.acquire() as state, self._lock:
            self._for(state)
            if self._audit is None:
                try:
                    summary = audit_index(state.index, top=SUSPECTS_LISTED, graph=self._graph_of(state))
                except ParameterError as exc:  # no labels
                    return None, None, exc.problem
                self._audit = summary, suspects_picture(summary, self.loader(state),
                                                        background=picture_background(state.embedder))
            return *self._audit, None
