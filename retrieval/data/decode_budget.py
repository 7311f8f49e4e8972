"""The process-wide decode budget: what keeps many decodes at once bounded in memory.

``read_image`` reserves its estimate (``retrieval.data.decode_memory``) of ``DECODE_BUDGET`` for the decode, and
after a large one (``TRIM_BYTES``) gives the freed heap back (``retrieval.utils.heap.trim_heap``), whatever the number
of threads or requests.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Iterator

from retrieval.data.decode_memory import MAX_DECODE_BYTES, MIB

DECODE_BUDGET_BYTES = 2 * MAX_DECODE_BYTES  # what the decodes running at once in a process may hold together
TRIM_BYTES = 32 * MIB  # after a decode estimated at this or more, freed heap is given back to the system


class DecodeBudget:
    """Bytes the decodes running at once may hold together: ``reserve`` waits, in arrival order, until one fits.

    A reservation larger than the whole budget is clamped to it (it then runs alone), so none waits forever.
    """

    def __init__(self, total_bytes: int) -> None:
        self.total, self.held = int(total_bytes), 0
        self._changed = threading.Condition()
        self._queue: collections.deque[object] = collections.deque()

    @contextlib.contextmanager
    def reserve(self, nbytes: int) -> Iterator[int]:
        """Hold ``nbytes`` of the budget (clamped to 0..total) for the ``with`` block; waits until they fit."""
        nbytes, ticket = min(max(int(nbytes), 0), self.total), object()
        with self._changed:
            self._queue.append(ticket)
            try:  # first come, first served: a large decode is not starved by a stream of small ones
                self._changed.wait_for(lambda: self._queue[0] is ticket and self.held + nbytes <= self.total)
                self.held += nbytes
            finally:
                self._queue.remove(ticket)
                self._changed.notify_all()  # the next in line may fit too
        try:
            yield nbytes
        finally:
            with self._changed:
                self.held -= nbytes
                self._changed.notify_all()


DECODE_BUDGET = DecodeBudget(DECODE_BUDGET_BYTES)
if hasattr(os, "register_at_fork"):  # a forked worker (DataLoader) has memory of its own, and no lock held in it
    os.register_at_fork(after_in_child=lambda: DECODE_BUDGET.__init__(DECODE_BUDGET.total))
