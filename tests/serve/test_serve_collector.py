"""A running server keeps its start-up heap out of the garbage collector's full walks, so that a collection does not
stall /health and every request for as long as it walks a million objects; stopping gives the heap back."""

from __future__ import annotations

import gc
import shutil
import time
import weakref
from pathlib import Path

import pytest
from availability import HealthProbe
from serve_fixtures import BackgroundServer

from retrieval.index.writing.writer import remove_images
from retrieval.serve.collector import frozen_heap
from retrieval.serve.server import ServerConfig, build_app
from retrieval.serve.service import SearchService

pytestmark = pytest.mark.timeout(300)


class Node:
    """An object that can sit in a reference cycle."""

    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref:
    """A reference cycle nothing else holds: only the cyclic collector frees it."""
    first, second = Node(), Node()
    first.other, second.other = second, first
    return weakref.ref(first)


def tracked(thing: object) -> bool:
    """Whether a full collection walks ``thing`` (frozen objects are tracked too, but not walked)."""
    return any(other is thing for other in gc.get_objects())


def test_a_running_server_freezes_its_startup_heap_and_gives_it_back_when_it_stops(artifacts):
    assert gc.get_freeze_count() == 0, "a server of an earlier test in this process still runs"
    app, service = build_app(ServerConfig(index_dir=artifacts.index_dir))
    gradio_app = next(route.app for route in app.routes if hasattr(getattr(route, "app", None), "get_blocks"))
    gc.collect()  # the live heap: garbage an earlier test of this process left would be collected, not frozen
    tracked_before = len(gc.get_objects())
    try:
        with BackgroundServer(app):
            frozen, walked = gc.get_freeze_count(), len(gc.get_objects())
            # a list Gradio's own start-up makes (Queue.start), inside the lifespan this one wraps
            started_by_gradio = tracked(gradio_app.get_blocks()._queue.active_jobs)
    finally:
        service.close()
    assert frozen > 0.9 * tracked_before, (frozen, tracked_before)  # the whole start-up heap
    assert walked < 0.05 * tracked_before, (walked, tracked_before)  # what a full collection still walks
    assert not started_by_gradio
    assert gc.get_freeze_count() == 0


def test_garbage_at_entry_is_collected_not_frozen():
    gc.disable()  # no automatic collection frees the cycle first
    try:
        dead = cycle()
        assert dead() is not None
        with frozen_heap():
            assert dead() is None
    finally:
        gc.enable()
    assert gc.get_freeze_count() == 0


def test_the_heap_stays_frozen_until_the_last_of_two_servers_stops():
    first = Node()
    with frozen_heap():
        second = Node()
        with frozen_heap():
            assert not tracked(first) and not tracked(second)  # the second server's start-up objects join
        assert not tracked(first) and not tracked(second)  # the first server still runs
        later = Node()
        assert tracked(later)
    assert tracked(first) and tracked(second) and gc.get_freeze_count() == 0


def test_a_startup_cycle_dropped_while_serving_waits_for_the_stop_and_a_new_one_does_not():
    held = Node()
    held.other = Node()
    held.other.other = held
    startup_cycle = weakref.ref(held)
    with frozen_heap():
        del held
        new_cycle = cycle()
        gc.collect()
        assert new_cycle() is None  # made while serving: collected as usual
        assert startup_cycle() is not None  # frozen: the price, paid once at the stop
    gc.collect()
    assert startup_cycle() is None


def test_a_replaced_startup_index_state_is_freed_while_the_heap_is_frozen(artifacts, tmp_path):
    index_dir = Path(shutil.copytree(artifacts.index_dir, tmp_path / "index"))
    service = SearchService(index_dir, reload_interval_s=0)
    try:
        with frozen_heap():
            startup_state = weakref.ref(service.current())
            remove_images(index_dir, ids=[1])
            assert service.reload()
            service.live._sweep(force=True)  # closed now, not after its grace period
            gc.collect()
            assert startup_state() is None  # by reference counting: no cycle kept it
    finally:
        service.close()


@pytest.mark.alone
def test_a_full_collection_while_serving_does_not_stall_health(artifacts):
    app, service = build_app(ServerConfig(index_dir=artifacts.index_dir))
    try:
        with BackgroundServer(app) as server, HealthProbe(server.url) as probe:
            time.sleep(0.2)
            started = time.monotonic()
            gc.collect()
            collected_in = time.monotonic() - started
            time.sleep(0.2)
    finally:
        service.close()
    assert probe.failures == [] and len(probe.latencies) >= 3, probe.latencies
    assert collected_in < 0.1 and probe.worst < 0.25, (collected_in, probe.latencies)
