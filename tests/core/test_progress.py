"""Progress bars: redrawn on a terminal, whole plain lines at intervals in a log, a file or a pipe."""

from __future__ import annotations

import io

from tqdm.std import tqdm

from retrieval.utils import progress
from retrieval.utils.progress import LineProgress, progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_written_to_a_file_writes_whole_lines_without_carriage_returns(monkeypatch):
    log = io.StringIO()
    clock = iter(float(t) for t in range(0, 10_000, 7))  # each reading 7 s after the last
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    bar = progress_bar(total=100, desc="index", unit="img", file=log, interval=30)
    assert isinstance(bar, LineProgress)
    with bar:
        for _ in range(100):
            bar.update(1)
            tqdm.write("a message", file=log)  # refreshes every bar: no extra line for it
    text = log.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = [line for line in text.splitlines() if line.startswith("index")]
    assert lines[-1].startswith("index: 100%") and "100/100" in lines[-1]
    assert 2 <= len(lines) <= 100 * 7 // 30 + 3  # one at the start, one per 30 s, one at the end


def test_a_bar_that_clears_itself_still_ends_with_its_last_state_in_a_log():
    log = io.StringIO()
    with progress_bar(range(5), desc="embed", file=log, leave=False) as bar:
        for _ in bar:
            pass
    assert "\r" not in log.getvalue() and log.getvalue().splitlines()[-1].startswith("embed: 100%")


def test_a_terminal_gets_the_redrawn_bar_and_a_disabled_bar_writes_nothing():
    terminal = Terminal()
    bar = progress_bar(total=3, file=terminal)
    assert not isinstance(bar, LineProgress)
    bar.close()
    quiet = io.StringIO()
    with progress_bar(total=3, file=quiet, disable=True) as bar:
        bar.update(3)
    assert quiet.getvalue() == ""
