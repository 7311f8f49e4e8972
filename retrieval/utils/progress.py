"""Progress bars: the one place that decides how long work shows its progress.

On a terminal (or in a notebook) a bar is tqdm's, redrawn in place. Written to a file or a pipe (a log, ``2>
run.log``, a CI job, a container's log), a redrawn bar is one line of carriage returns that grows with every update;
there each bar writes whole plain lines instead, one every ``LOG_INTERVAL_S`` seconds and one at its end.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import IO, Any

from tqdm import tqdm as _terminal_tqdm
from tqdm.autonotebook import tqdm as _notebook_or_terminal
from tqdm.std import tqdm as std_tqdm

LOG_INTERVAL_S = 30.0  # seconds between two lines of a bar written to a log


class LineProgress(std_tqdm):
    """A tqdm bar that writes a whole line now and then (never a carriage return): for logs, files and pipes."""

    def __init__(self, *args: Any, interval: float | None = None, **kwargs: Any) -> None:
        self.line_interval = LOG_INTERVAL_S if interval is None else float(interval)
        self._last_line: float | None = None
        kwargs.update(mininterval=self.line_interval, maxinterval=self.line_interval, dynamic_ncols=False,
                      ascii=True)
        kwargs.setdefault("ncols", 100)
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        """A line when the interval has passed, and the last state when the bar closes; never a redraw."""
        closing = self.disable  # tqdm.close() sets it before its last display
        if msg is not None and not closing:
            return False  # a clear or a message: nothing to take back in a log
        now = time.monotonic()
        if not closing and self._last_line is not None and now - self._last_line < self.line_interval:
            return False  # tqdm.write() refreshes every bar after a message: not a line each time
        self._last_line = now
        text = self.__str__()
        # tqdm.close() ends a kept bar's line itself (leave=True): only a cleared bar needs its newline here
        self.fp.write(text if closing and msg is None else text + "\n")
        self.fp.flush()
        return False  # so that close() writes no carriage return after a cleared bar

    def clear(self, nolock: bool = False) -> None:
        """Nothing to clear: the lines above stay as they were written."""

    def moveto(self, n: int) -> None:
        """Lines are never moved to (no cursor movement in a log)."""


def is_terminal(stream: IO[str] | None) -> bool:
    """Whether ``stream`` is a terminal (closed, absent or odd streams are not)."""
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def progress_bar(iterable: Iterable | None = None, *, file: IO[str] | None = None, interval: float | None = None,
                 **kwargs: Any) -> std_tqdm:
    """A progress bar on ``file`` (default stderr): tqdm's on a terminal or in a notebook, plain lines elsewhere (one
    every ``interval`` seconds, default ``LOG_INTERVAL_S``); ``kwargs`` are tqdm's."""
    stream = sys.stderr if file is None else file
    if kwargs.get("disable"):
        return _terminal_tqdm(iterable, file=stream, **kwargs)
    if _notebook_or_terminal is not std_tqdm:  # a notebook: its widget, wherever stderr goes
        return _notebook_or_terminal(iterable, file=stream, **kwargs)
    if is_terminal(stream):
        return _terminal_tqdm(iterable, file=stream, **kwargs)
    return LineProgress(iterable, file=stream, interval=interval, **kwargs)
