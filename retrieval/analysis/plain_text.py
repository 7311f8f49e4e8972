"""Text in pictures drawn as written. Labels, folder and file names, data set and run names are anyone's text, and
matplotlib reads a string holding two dollar signs as mathtext: a bad formula fails the whole picture (a parse
error, a RecursionError on deep braces) and a good one is drawn as mathematics, not as the label it is. A label
of any length is cut to a few lines of bounded length, so that it cannot stretch the picture."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# rc_context sets matplotlib's global rcParams and puts them back on leaving: two pictures drawn at once (the app's
# worker threads) would put the setting back under each other mid-picture, so pictures are drawn one at a time
_LOCK = threading.RLock()


@contextmanager
def plain_text() -> Iterator[None]:
    """Every matplotlib Text made inside draws its string as written (``text.parse_math`` off); a picture's own
    formula opts back in with ``parse_math=True``. Wrap a picture from its figure's creation to its saving: a Text
    reads the setting when it is made, and axes make their titles with the figure and tick labels while saving."""
    import matplotlib

    with _LOCK, matplotlib.rc_context({"text.parse_math": False}):
        yield


MAX_LINE_CHARS = 100  # a label's line drawn longer would widen the picture by thousands of pixels
MAX_LINES = 4


def cut_long_texts(figure: Any) -> None:
    """Cut every text of ``figure`` to ``MAX_LINES`` lines of ``MAX_LINE_CHARS`` characters, "…" where cut. Call it
    before laying out and saving: a label of a thousand characters would otherwise make a picture tens of thousands
    of pixels wide (which PIL then refuses to open as a decompression bomb)."""
    from matplotlib.text import Text

    for text in figure.findobj(Text):
        value = text.get_text()
        lines = value.split("\n")
        kept = [line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS - 1] + "…" for line in lines[:MAX_LINES]]
        if len(lines) > MAX_LINES:
            kept[-1] = kept[-1][:MAX_LINE_CHARS - 1] + "…"
        if "\n".join(kept) != value:
            text.set_text("\n".join(kept))
