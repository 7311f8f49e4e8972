"""The served index's near-duplicate groups and label suspects, for the app's Evaluation tab beside its per-class
analysis: computed when asked for, bounded (a seeded sample of ``APP_MAX_IMAGES`` images searched, ``APP_K``
neighbours each), and kept for the state they were computed on, so that a reload of the index computes them afresh.
``auto`` verifies copies (``find_copies``, calibrated on copies planted of ``APP_CALIBRATION_SAMPLE`` images) once
per state, one verification at a time: a click while one runs is told so at once (it never waits behind it, holding
a place in the app's queue that searches share), and the answer is kept for the last ``VERIFICATIONS_KEPT``
states. The label audit and the neighbour graph are computed once per state too, so a second click costs
nothing."""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from PIL import Image

from retrieval.analysis.neighbour_pictures import copies_picture, duplicates_picture, similar_picture, suspects_picture
from retrieval.data.decode import read_image
from retrieval.errors import ParameterError
from retrieval.index.curation.audit import audit_index
from retrieval.index.curation.catalogued_images import picture_background
from retrieval.index.curation.copy_calibration import calibrate_verification
from retrieval.index.curation.duplicates import DuplicateOptions, find_duplicates
from retrieval.index.curation.neighbour_graph import NeighbourGraph, index_graph
from retrieval.serve.service import SearchService, ServedIndex

APP_MAX_IMAGES = 20_000  # images searched: about 30 s on 2 cores at 1M vectors (docs/BENCHMARKS.md)
APP_K = 10
APP_CALIBRATION_SAMPLE = 50  # auto embeds 5 copies of each with the served model and compares them
# candidate pairs a state's verification compares at most: a minute at 100 pairs/s on 2 cores, minutes where the
# images' features do not stay cached (docs/SERVING.md); the page says when it stopped there, and `retrieval index
# duplicates` does them all
APP_MAX_PAIRS = 6_000
VERIFICATIONS_KEPT = 2  # states whose verified groups are kept: the one served and the one it replaced
APP_WORKERS = 2  # threads comparing pairs (OpenCV releases the GIL): the server's other requests keep the rest
GROUPS_LISTED = 100  # also the similar pairs listed
SUSPECTS_LISTED = 100
Load = Callable[[int], Image.Image | None]
Answer = tuple[dict[str, Any], Image.Image | None, Image.Image | None]


class ThresholdError(ValueError):
    """The threshold typed is neither auto nor a cosine."""


class VerificationRunning(RuntimeError):
    """A verification runs already (one at a time): of the state served, whose answer is kept for the next click,
    or of the state a reload replaced."""

    def __init__(self, seconds: float, this_state: bool) -> None:
        what = "this index" if this_state else "the index as it was before it was reloaded"
        then = "its answer then shows at once" if this_state else "this index as it is now is then verified"
        super().__init__(f"the copies in {what} are being verified already (for {seconds:.0f} s so far; one "
                         f"verification runs at a time): press the button again once it is done, {then}")


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
    """Near-duplicate groups and label suspects of the service's current state: the neighbour graph, the verified
    copies and the label audit each computed once per state."""

    def __init__(self, service: SearchService) -> None:
        self.service = service
        self._lock = threading.Lock()  # the graph and the audit: a second click waits for the first's answer
        self._state_key: object = None
        self._graph: NeighbourGraph | None = None
        self._audit: tuple[dict[str, Any], Image.Image | None] | None = None
        self._jobs = threading.Lock()  # the verified answers kept and the verifications running
        self._verified: OrderedDict[object, Answer] = OrderedDict()
        self._running: dict[object, float] = {}  # state identity -> when its verification began (monotonic)

    def _for(self, state: ServedIndex) -> None:
        """Forget what was computed on another state (the index was reloaded since)."""
        if self._state_key != state.identity:
            self._state_key, self._graph, self._audit = state.identity, None, None

    def _graph_of(self, state: ServedIndex) -> NeighbourGraph:
        if self._graph is None:
            self._graph = index_graph(state.index, APP_K, APP_MAX_IMAGES)
        return self._graph

    def loader(self, state: ServedIndex) -> Load:
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

    def _graph_held(self, state: ServedIndex) -> NeighbourGraph:
        with self._lock:
            self._for(state)
            return self._graph_of(state)

    def duplicates(self, threshold: float | str) -> Answer:
        """``find_duplicates`` of the current state at ``threshold``, the picture of its groups and, for ``auto``
        (verified copies, once per state: ``VerificationRunning`` while a verification runs, one at a time), the
        picture of its similar pairs that are not copies (None for a cosine: its groups are not verified)."""
        with self.service.acquire() as state:
            if threshold != "auto":
                summary = find_duplicates(state.index, DuplicateOptions(float(threshold), max_groups=GROUPS_LISTED),
                                          graph=self._graph_held(state))
                return summary, duplicates_picture(summary, self.loader(state),
                                                   background=picture_background(state.embedder)), None
            key = state.identity
            with self._jobs:
                if key in self._verified:
                    self._verified.move_to_end(key)
                    return self._verified[key]
                if self._running:  # one at a time: each takes the cores searches need
                    began = self._running.get(key, min(self._running.values()))
                    raise VerificationRunning(time.monotonic() - began, key in self._running)
                self._running[key] = time.monotonic()
            answer = None
            try:
                answer = self._verify(state)
            finally:
                with self._jobs:  # kept as it stops running: a click in between never starts it again
                    del self._running[key]
                    if answer is not None:
                        self._verified[key] = answer
                        while len(self._verified) > VERIFICATIONS_KEPT:
                            self._verified.popitem(last=False)
            return answer

    def _verify(self, state: ServedIndex) -> Answer:
        """The verified copies of ``state`` (calibrated on copies planted in it) and the pictures of its groups and
        of its similar pairs."""
        graph, load = self._graph_held(state), self.loader(state)
        background = picture_background(state.embedder)
        calibration = calibrate_verification(state.index, graph, load, state.embedder, APP_CALIBRATION_SAMPLE,
                                             workers=APP_WORKERS)
        options = DuplicateOptions("auto", max_groups=GROUPS_LISTED, workers=APP_WORKERS, max_pairs=APP_MAX_PAIRS)
        summary = find_duplicates(state.index, options, graph=graph, load=load, embedder=state.embedder,
                                  verification=calibration)
        return summary, copies_picture(summary, load, background), similar_picture(summary, load, background)

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
