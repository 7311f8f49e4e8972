"""Values as the app's pages show them: text from users as text (escaped for Markdown or HTML, on one line, cut when
long) and fractions as percentages.

Every metric the app shows is a percentage (0-100, one decimal), like the results grid (docs/RESULTS.md);
similarity scores stay cosines in [-1, 1].
"""

from __future__ import annotations

import html
import re

METRIC_UNIT = "%"


# --- text from users on the page -----------------------------------------------------------------------------
# Labels (folder names, a manifest's column), a gallery's info.json, a manifest's column names and a run report's
# fields are anyone's text: the page shows them as text, never as Markdown or HTML, and never whole when long.
MAX_SHOWN_CHARS = 200  # a label, a name, a report's field
MAX_PROSE_CHARS = 500  # a data set's description and purpose, sentences its preparer wrote
ELLIPSIS = "…"
# Every ASCII character Gradio's Markdown (marked with GFM) reads as syntax inside a line: code spans, emphasis,
# strikethrough, links and images, raw HTML, entities, table cells, headings, maths. A backslash before any ASCII
# punctuation shows it as itself (CommonMark), so text escaped this way renders as exactly that text.
MARKDOWN_SPECIAL = re.compile(r"[\\`*_~\[\]()<>&|#!$]")
# GFM links bare URLs and e-mail addresses without any of the above: a backslash inside "://", after "www" and
# before "@" breaks each pattern and still shows the character.
MARKDOWN_AUTOLINK = re.compile(r"(?i)(?<=[a-z0-9])(?=://)|(?<=\bwww)(?=\.)|(?=@)")
# control characters, the line and paragraph separators, and the bidirectional overrides that make text read
# other than it is stored: shown as spaces
UNSHOWN = dict.fromkeys([*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029, *range(0x202A, 0x202F),
                         *range(0x2066, 0x206A)], " ")
# half of a UTF-16 pair (JSON's "\ud800" decodes to one): no UTF-8 encoder takes it, so a page update holding one
# fails in Gradio's event stream; shown as U+FFFD, the replacement character
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def shown_text(value: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """Text from users as one line of at most ``limit`` characters (runs of spaces and line breaks as one space;
    a longer text cut, ending with an ellipsis)."""
    raw = str(value)
    window = limit * 4 + 16  # enough for ``limit`` characters after collapsing spaces; never the whole of 5 MB
    text = " ".join(LONE_SURROGATE.sub("\ufffd", raw[:window]).translate(UNSHOWN).split())
    if len(text) > limit or len(raw) > window:
        text = text[: limit - len(ELLIPSIS)].rstrip() + ELLIPSIS
    return text


def markdown_text(value: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """Text from users for a Markdown component, escaped so that it renders as that text: no tag, link, image,
    code span, emphasis or table of its own, on one line of at most ``limit`` characters."""
    text = MARKDOWN_SPECIAL.sub(r"\\\g<0>", shown_text(value, limit))
    return MARKDOWN_AUTOLINK.sub("\\\\", text)


def markdown_code(value: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """Text from users as a Markdown code span: fenced by more backticks than any run inside it, so that the
    text cannot close it (a code span's content is shown literally: no Markdown, no HTML)."""
    text = shown_text(value, limit)
    if not text:
        return "` `"
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    padded = f" {text} " if fence != "`" or text.startswith(" ") else text  # CommonMark strips one space a side
    return f"{fence}{padded}{fence}"


def html_text(value: object, limit: int | None = MAX_SHOWN_CHARS) -> str:
    """Text from users for HTML (a gr.HTML, an error toast): escaped, and cut at ``limit`` characters."""
    text = str(value)
    if limit is not None and len(text) > limit:
        text = text[: limit - len(ELLIPSIS)] + ELLIPSIS
    return html.escape(LONE_SURROGATE.sub("\ufffd", text), quote=True)


def percent(value: float) -> float:
    """A fraction in [0, 1] as the percentage the app shows (one decimal)."""
    return round(100 * float(value), 1)
