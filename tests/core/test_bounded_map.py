"""``bounded_map``: every item's result handed back once, never more calls in flight than asked, and on Ctrl-C or a
call's error the calls not started are cancelled while those that finished are still handed back."""

from __future__ import annotations

import threading
import time

import pytest

from retrieval.utils.bounded_map import bounded_map


def test_every_item_is_mapped_once_with_at_most_the_calls_in_flight_asked():
    running, most, lock = [0], [0], threading.Lock()

    def square(x: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.002)
        with lock:
            running[0] -= 1
        return x * x

    results: dict[int, int] = {}
    submitted = []

    def items():
        for x in range(60):
            submitted.append(x)
            # items are drawn only as room frees up: never more than 3 ahead of those handed back
            assert len(submitted) - len(results) <= 3
            yield x

    bounded_map(square, items(), results.__setitem__, workers=2, in_flight=3)
    assert results == {x: x * x for x in range(60)} and most[0] <= 2


@pytest.mark.parametrize("stop", [KeyboardInterrupt, ValueError])
def test_a_stop_cancels_the_calls_not_started_and_keeps_those_that_finished(stop):
    started: list[int] = []

    def call(x: int) -> int:
        started.append(x)
        if x == 5:
            raise stop("stop")
        time.sleep(0.01)
        return x

    results: dict[int, int] = {}
    with pytest.raises(stop):
        bounded_map(call, range(1000), results.__setitem__, workers=2, in_flight=4)
    assert len(started) < 20  # the rest never started
    assert set(results) <= set(started) - {5} and all(results[x] == x for x in results)
    assert set(range(5)) <= set(results)  # finished before the stop, or while the pool wound down


def test_no_worker_or_no_room_is_refused():
    with pytest.raises(ValueError, match="at least one worker"):
        bounded_map(abs, [1], print, workers=0, in_flight=1)
