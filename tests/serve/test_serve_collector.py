"""A running server keeps its start-up heap out of the garbage collector's full walks, so that a collection does not
stall /health and every request for as long as it walks a million objects; stopping gives the heap back."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
from availability import HealthProbe
from serve_fixtures import BackgroundServer

from retrieval.serve.collector import frozen_heap
from retrieval.serve.server import ServerConfig, build_app

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


def test_a_running_server_freezes_its_startup_heap_and_gives_it_back_when_it_stops(artifacts):
    assert gc.get_freeze_count() == 0
    app, service = build_app(ServerConfig(index_dir=artifacts.index_dir))
    tracked_before = len(gc.get_objects())
    try:
        with BackgroundServer(app):
            frozen, tracked = gc.get_freeze_count(), len(gc.get_objects())
    finally:
        service.close()
    assert frozen > 0.9 * tracked_before, (frozen, tracked_before)  # the whole start-up heap, Gradio's too
    assert tracked < 0.05 * tracked_before, (tracked, tracked_before)  # what a full collection still walks
    assert gc.get_freeze_count() == 0


def test_garbage_at_entry_is_collected_not_frozen():
    dead = cycle()
    with frozen_heap():
        assert dead() is None
    assert gc.get_freeze_count() == 0


def test_the_heap_stays_frozen_until_the_last_of_two_servers_stops():
    with frozen_heap():
        live = Node()
        with frozen_heap():
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() > 0  # the other server still runs
        later = Node()
        assert gc.is_tracked(live) and gc.is_tracked(later)
    assert gc.get_freeze_count() == 0


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
