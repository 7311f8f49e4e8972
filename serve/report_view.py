"""Reading a run report (``retrieval train`` or ``retrieval evaluate``) for the Evaluation tab, and its plots.

Every metric the app shows is a percentage (0-100, one decimal), like the results grid (docs/RESULTS.md);
similarity scores stay cosines in [-1, 1]. Plots are drawn here, each line with its own marker and line style
so that lines lying on top of each other (MAP@R = Recall@1 when each query has one relevant item) stay visible.
"""

from __future__ import annotations

import html
import io
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from retrieval.analysis.plain_text import cut_long_texts, plain_text
from retrieval.compatibility import KEPT, KEPT_K
from retrieval.reports import READINGS_FILE, REPORT_FORMAT, REPORT_KINDS, read_steps
from retrieval.utils.io import read_capped

MAX_REPORT_BYTES = 50 * 2**20  # a run report is a few KiB: anything this big is not one
MAX_RESULTS_BYTES = 16 * 2**20
# The largest float is about 1.8e308: an integer of more digits cannot be shown, drawn or compared as a number
# (float() overflows), and past 4300 digits Python will not even read it (int() refuses, in quadratic time).
FLOAT_DIGITS = 309
LONG_DIGIT_RUN = re.compile(rb"\d{%d}" % FLOAT_DIGITS)  # a cheap look first: most reports hold no such number
MAX_PROBLEMS_NAMED = 5  # values left out of one file that are named one by one; the rest are counted
MAX_FIELD_CHARS = 120  # a field's name in such a message (its keys are anyone's text)
KEPT_EPOCHS_SHOWN = 12  # a run without labels: the epochs whose neighbours kept the summary lists
METRIC_ORDER = ("map@r", "r_precision", "nmi", "f1", "linear_probe", KEPT)
METRIC_UNIT = "%"
# (marker, line style) per line: overlapping lines stay distinguishable, in colour and in grey
LINE_STYLES = (("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."), ("v", (0, (5, 1))), ("P", (0, (3, 1, 1, 1))))
MAP_EQUALS_RECALL_NOTE = (
    "**Why MAP@R equals Recall@1 here:** every query has exactly one relevant item (R = 1; in the emoji test "
    "split the only other image of an emoji is its drawing in the other style), so MAP@R averages the precision "
    "at rank 1 alone, 1 when the top result is right and 0 otherwise, which is Recall@1 (and R-precision)."
)


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


def shown_text(value: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """Text from users as one line of at most ``limit`` characters (runs of spaces and line breaks as one space;
    a longer text cut, ending with an ellipsis)."""
    raw = str(value)
    window = limit * 4 + 16  # enough for ``limit`` characters after collapsing spaces; never the whole of 5 MB
    text = " ".join(raw[:window].translate(UNSHOWN).split())
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
    return html.escape(text, quote=True)


def percent(value: float) -> float:
    """A fraction in [0, 1] as the percentage the app shows (one decimal)."""
    return round(100 * float(value), 1)


def known(value: object) -> object:
    """A report's value as the page names it: "?" where it is missing (or was left out, ``RunReport.problems``)."""
    return "?" if value is None else value


def is_number(value: object) -> bool:
    """Whether the page can show and draw ``value``: an int or a float (not a bool) that a float can hold (NaN and
    infinity included: they are shown as such)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


@dataclass
class RunReport:
    path: Path
    data: dict[str, Any]
    readings: dict[str, Any] | None = None  # READINGS_FILE beside the report, when one is there and well formed
    problems: list[str] = field(default_factory=list)  # values of either file left out, each named (the summary's)

    @property
    def kind(self) -> str:
        return str(self.data.get("kind"))

    @property
    def folder(self) -> Path:
        return self.path.parent

    def metric_columns(self) -> dict[str, dict[str, float]]:
        """Column name -> metrics: before/best/last for a training run, the metrics of an evaluation."""
        if self.kind == "train":
            best = self.data.get("best") or {}
            wise = self.data.get("wise") or {}
            reference = self.data.get("reference") or {}
            alpha = wise.get("alpha", 0)
            columns = {
                "pretrained only": self.data.get("baseline"),
                f"best (epoch {known(best.get('epoch'))})": best,
                "last": self.data.get("last"),
                f"WiSE-FT (alpha {f'{alpha:g}' if is_number(alpha) else known(alpha)})": wise.get("metrics"),
                # what a user would otherwise take: out-of-domain rows only
                f"pretrained backbone, {known(reference.get('input_size'))} px": {"extra": {
                    name: parts.get("test") for name, parts in (reference.get("sets") or {}).items()}}
                if reference.get("sets") else None,
            }
        else:
            columns = {"metrics": self.data.get("metrics")}
        return {name: values for name, values in columns.items() if values}

    def metrics_table(self) -> tuple[list[str], list[list[Any]]]:
        """Header and rows (metric, then one value per column), values in percent; the out-of-domain sets'
        (--eval-extra) rows follow the test split's, named ``SET: metric``. Names are the report's text, cut for
        the page (``shown_text``): show them as text, not Markdown."""
        columns = {name: flat_metrics(values) for name, values in self.metric_columns().items()}
        keys: list[str] = []
        for values in columns.values():
            keys += [k for k in values if k not in keys and is_number(values[k])]

        def ordered_keys(prefix: str) -> list[str]:
            own = [k.removeprefix(prefix) for k in keys if k.startswith(prefix) and ": " not in k.removeprefix(prefix)]
            recalls = sorted((k for k in own if recall_k(k) is not None), key=recall_k)
            return [prefix + k for k in recalls + [k for k in METRIC_ORDER if k in own]]

        extra_sets = sorted({k.split(": ", 1)[0] for k in keys if ": " in k})
        ordered = ordered_keys("") + [key for name in extra_sets for key in ordered_keys(f"{name}: ")]
        rows = [[shown_text(key)] + [percent(v[key]) if is_number(v.get(key)) else None for v in columns.values()]
                for key in ordered]
        return ["metric", *(shown_text(name) for name in columns)], rows

    def map_equals_recall(self) -> bool:
        """MAP@R and Recall@1 agree in every column that has both (one relevant item per query)."""
        columns = self.metric_columns().values()
        pairs = [(v["map@r"], v["recall@1"]) for v in columns if is_number(v.get("map@r")) and
                 is_number(v.get("recall@1"))]
        return bool(pairs) and all(abs(float(a) - float(b)) < 1e-9 for a, b in pairs)

    def plot_file(self, name: str) -> Path | None:
        """A picture the report lists under ``plots``; only files inside the report's own folder."""
        relative = (self.data.get("plots") or {}).get(name)
        if not relative:
            return None
        path = (self.folder / relative).resolve()
        if not path.is_relative_to(self.folder.resolve()) or not path.is_file():
            return None
        return path

    def history(self) -> list[dict[str, Any]]:
        """Per-epoch rows of metrics.jsonl next to the report (or checkpoint), else the report's history."""
        folders = [self.folder]
        if self.data.get("checkpoint"):  # as given on the command line: absolute, or relative to where it ran
            checkpoint = Path(str(self.data["checkpoint"]))
            folders += [checkpoint.parent, (self.folder / checkpoint).parent]
        for folder in folders:
            log = folder / "metrics.jsonl"
            if log.is_file():
                try:
                    lines = read_capped(log, MAX_REPORT_BYTES, "metrics log").splitlines()
                except (OSError, ValueError):
                    continue
                return [row for row in map(_json_line, lines) if isinstance(row, dict)]
        return [row for row in self.data.get("history") or [] if isinstance(row, dict)]


def recall_k(key: str) -> int | None:
    """The K of a ``recall@K`` metric's name; None for any other name (a report's keys are anyone's text)."""
    k = key.removeprefix("recall@")
    return int(k) if k != key and k.isdecimal() and len(k) <= 9 else None


VALIDATION_KEY = "validation"  # an epoch row's metrics of the validation classes (train.checkpointing.VALIDATION)


def flat_metrics(values: dict[str, Any]) -> dict[str, Any]:
    """A metrics dict with its out-of-domain sets (``extra``: set -> metrics) as ``SET: metric`` keys, and its
    validation classes' metrics as ``validation: metric``."""
    flat = {k: v for k, v in values.items() if k not in ("extra", VALIDATION_KEY)}
    for name, metrics in (values.get("extra") or {}).items():
        flat.update({f"{name}: {k}": v for k, v in (metrics or {}).items()})
    if isinstance(values.get(VALIDATION_KEY), dict):
        flat.update({f"{VALIDATION_KEY}: {k}": v for k, v in values[VALIDATION_KEY].items()})
    return flat


def load_report(path: str | Path) -> RunReport:
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"report {path} not found; `retrieval train` writes RUN_DIR/report.json and "
            "`retrieval evaluate` writes eval_report.json next to the checkpoint"
        )
    problems: list[str] = []
    data = _read_json(path, "report", MAX_REPORT_BYTES, problems)
    if (
        not isinstance(data, dict)
        or data.get("format") != REPORT_FORMAT
        or data.get("kind") not in REPORT_KINDS
    ):
        raise ValueError(
            f"{path} is not a report of `retrieval train` or `retrieval evaluate` "
            f"(format {REPORT_FORMAT}, kind {'|'.join(REPORT_KINDS)})"
        )
    readings = load_readings(path.with_name(READINGS_FILE), problems)
    return RunReport(path, data, readings, problems)


def load_readings(path: Path, problems: list[str] | None = None) -> dict[str, Any] | None:
    """``READINGS_FILE``'s figures: ``labels`` (key -> words) and the ``pretrained`` and ``delivered`` values
    of the keys both have, numbers only; None when the file is missing or not of that shape (it is anyone's file).
    A number too large to read is left out, named in ``problems``."""
    if not path.is_file():
        return None
    try:
        data = _read_json(path, "readings", MAX_REPORT_BYTES, problems)
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), dict)
                                             for k in ("labels", "pretrained", "delivered")):
        return None
    keys = [key for key, text in data["labels"].items() if isinstance(text, str)
            and is_number(data["pretrained"].get(key)) and is_number(data["delivered"].get(key))]
    if not keys:
        return None
    return {"labels": {key: data["labels"][key] for key in keys},
            "pretrained": {key: float(data["pretrained"][key]) for key in keys},
            "delivered": {key: float(data["delivered"][key]) for key in keys}}


def readings_markdown(report: RunReport) -> str:
    """The model's figures measured outside training (``READINGS_FILE``: the demo's test subgroups read by
    subgroup and by twin, and real photos), the pretrained backbone beside the delivered model, as a table."""
    readings = report.readings
    if not readings:
        return ""
    rows = [f"| {markdown_text(text)} | {percent(readings['pretrained'][key])} | "
            f"{percent(readings['delivered'][key])} | "
            f"{percent(readings['delivered'][key]) - percent(readings['pretrained'][key]):+.1f} |"
            for key, text in readings["labels"].items()]
    return (f"\n\n**Read two ways and on real photos** ({markdown_code(READINGS_FILE)}, {METRIC_UNIT}):\n\n"
            "| figure | pretrained backbone | this model | change |\n|---|---:|---:|---:|\n" + "\n".join(rows))


def _read_json(path: Path, what: str, limit: int, problems: list[str] | None = None) -> Any:
    """A JSON file of at most ``limit`` bytes, read only if it is a regular file (never blocks on a FIFO). With
    ``problems``: every integer too large for a float is None, each named there (``_numbers_read``)."""
    try:
        raw = read_capped(path, limit, f"JSON {what}")
        return json.loads(raw) if problems is None else _numbers_read(raw, path.name, problems)
    except OSError as exc:
        raise FileNotFoundError(f"{what} {path} cannot be read ({exc.strerror or exc})") from exc
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"{path} is not a JSON {what} ({exc})") from exc


class _TooLarge:
    """An integer in a JSON text that no float can hold, as read: replaced by None once its place is known."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _parse_int(text: str) -> int | _TooLarge:
    digits = len(text.lstrip("-"))
    if digits > FLOAT_DIGITS:  # never int() of it: past 4300 digits Python refuses, and the cost is quadratic
        return _TooLarge(digits)
    value = int(text)
    return value if is_number(value) else _TooLarge(digits)


def _numbers_read(raw: bytes, name: str, problems: list[str]) -> Any:
    """JSON text (of the file ``name``) whose integers too large for a float are None, each named in ``problems``
    by its file and key with the fix: one such value leaves out its field, never the whole report."""
    if not LONG_DIGIT_RUN.search(raw):
        return json.loads(raw)
    data = json.loads(raw, parse_int=_parse_int)
    found: list[tuple[tuple[str | int, ...], int]] = []
    stack: list[tuple[Any, Any, Any, tuple[str | int, ...]]] = [(None, None, data, ())]
    while stack:  # not recursive: the JSON may nest as deep as json.loads reads
        parent, key, value, where = stack.pop()
        if isinstance(value, _TooLarge):
            if parent is not None:
                parent[key] = None
            found.append((where, value.digits))
        elif isinstance(value, dict | list):
            children = list(value.items() if isinstance(value, dict) else enumerate(value))
            stack.extend((value, k, v, (*where, k)) for k, v in reversed(children)  # popped in the file's order
                         if isinstance(v, dict | list | _TooLarge))
    for where, digits in found[:MAX_PROBLEMS_NAMED]:
        problems.append(f"{name}, {_field_name(where)}: an integer of {digits} digits is too large to read as a "
                        "number and is left out; write a plain number there (such as 0.42), or remove it")
    if len(found) > MAX_PROBLEMS_NAMED:
        problems.append(f"{name}: {len(found) - MAX_PROBLEMS_NAMED} more integers too large to read as numbers are "
                        "left out; write plain numbers there, or remove them")
    return None if isinstance(data, _TooLarge) else data


def _field_name(where: tuple[str | int, ...]) -> str:
    """A place in a JSON document as one line, ``best.recall@1`` or ``history[3].loss`` (keys cut: anyone's)."""
    text = "".join(f"[{key}]" if isinstance(key, int) else f".{shown_text(key, 40)}" for key in where)
    return shown_text(text.removeprefix(".") or "(the whole file)", MAX_FIELD_CHARS)


def _json_line(line: bytes) -> Any:
    """One row of a JSON-lines log, its integers too large for a float None; None for a line that is not JSON."""
    try:
        return _numbers_read(line, "", []) if line.strip() else None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return None


def problems_markdown(report: RunReport) -> str:
    """The values left out of the report or its readings, named, as Markdown (their keys escaped); empty if none."""
    if not report.problems:
        return ""
    return "\n\n**Left out of this report:**\n" + "\n".join(
        f"- {markdown_text(problem, 2 * MAX_FIELD_CHARS + 200)}" for problem in report.problems)


def _figure(width: float, height: float, panels: int = 1):
    """A matplotlib figure without pyplot (no figure manager shared between Gradio's worker threads), its axes."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height))
    axes = figure.subplots(1, panels, squeeze=False)[0]
    return figure, list(axes)


def _image(figure) -> Image.Image:
    cut_long_texts(figure)  # model, set and block names: never a picture stretched by one
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight", pad_inches=0.15)
    buffer.seek(0)
    with Image.open(buffer) as image:
        return image.convert("RGB")


def _lines(ax, series: dict[str, tuple[Sequence[float], Sequence[float]]]) -> None:
    """One line per series, each with its own marker and line style, and a legend."""
    for i, (name, (xs, ys)) in enumerate(series.items()):
        marker, style = LINE_STYLES[i % len(LINE_STYLES)]
        marker = marker if len(xs) <= 60 else None  # a per-step curve: a line, not thousands of markers
        ax.plot(xs, ys, marker=marker, linestyle=style, markersize=6 - (i % 3), linewidth=1.6, label=name,
                markerfacecolor="none" if i % 2 else None)
    if series:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _open(path: Path | None) -> Image.Image | None:
    if path is None:
        return None
    with Image.open(path) as image:
        return image.convert("RGB")


@plain_text()  # model, set and block names in legends and titles: drawn as written, one picture at a time
def recall_plot(report: RunReport) -> Image.Image | None:
    """Recall@K (%) against K, one line per model (pretrained only, best, last; or the evaluated one)."""
    series = {}
    for name, values in report.metric_columns().items():
        points = sorted((recall_k(k), percent(v)) for k, v in values.items() if recall_k(k) is not None and
                        is_number(v))
        if points:
            series[name] = ([k for k, _ in points], [y for _, y in points])
    if not series:
        return None
    figure, (ax,) = _figure(5.8, 3.9)
    _lines(ax, series)
    for i, (xs, ys) in enumerate(series.values()):
        offset = (0, -13) if i == 0 and len(series) > 1 else (0, 6)  # first line's numbers below its points
        for x, y in zip(xs, ys, strict=True):
            ax.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=offset, ha="center", fontsize=7)
    ks = sorted({k for xs, _ in series.values() for k in xs})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set(xlabel="K", ylabel=f"Recall@K ({METRIC_UNIT})", ylim=(0, 105), title="Recall@K on the test split")
    return _image(figure)


Series = dict[str, tuple[list[float], list[float]]]  # name -> (epochs, values)


def curve_panels(history: list[dict[str, Any]], steps: list[dict[str, Any]] | None = None
                 ) -> list[tuple[str, str, Series]]:
    """The training curves' panels from metrics.jsonl's rows, (title, unit, series), only for what the rows hold:
    the loss (per step too, where ``steps`` has it); the evaluation metrics (%): the test split where it was
    measured, the validation classes (``validation: recall@1``, every epoch where best.pt is chosen on them) and each
    --eval-extra set; the hard-triplet share (%)."""
    history = [r for r in history if isinstance(r, dict) and _number_at(r, "epoch")]  # a row's x: its epoch
    trained = [r for r in history if r["epoch"] > 0 and _number_at(r, "loss")]
    if not trained:
        return []
    steps = [r for r in steps or [] if isinstance(r, dict) and _number_at(r, "epoch") and _number_at(r, "loss")]
    rows = [flat_metrics(r) for r in history]
    extra = sorted({k for r in rows for k in r if k.endswith(": recall@1") and not k.startswith(VALIDATION_KEY)})
    losses = {"loss": ([r["epoch"] for r in trained], [r["loss"] for r in trained])}
    if steps:  # per optimizer step, each at its place in its epoch
        losses = {"loss per step": ([r["epoch"] for r in steps], [r["loss"] for r in steps]),
                  "epoch mean": losses["loss"]}
    panels = [("training loss", "", losses)]
    validation = (f"{VALIDATION_KEY}: recall@1", f"{VALIDATION_KEY}: map@r")
    for title, keys in (("evaluation (epoch 0 = before training)", ("recall@1", "map@r", "nmi", *validation, *extra)),
                        ("hard triplets (S_an > S_ap)", ("hard_fraction_train", "hard_fraction_test"))):
        series = {key: ([r["epoch"] for r in rows if _number_at(r, key)],
                        [percent(r[key]) for r in rows if _number_at(r, key)])
                  for key in keys if any(_number_at(r, key) for r in rows)}
        if series:  # a panel only for what the log has
            panels.append((title, METRIC_UNIT, series))
    return panels


def _number_at(row: dict[str, Any], key: str) -> bool:
    return is_number(row.get(key))


@plain_text()
def curves_plot(report: RunReport) -> Image.Image | None:
    """Training curves from metrics.jsonl: loss, evaluation metrics (%) and hard-triplet share (%) per epoch
    (``curve_panels``)."""
    panels = curve_panels(report.history(), read_steps(report.folder))
    if not panels:
        return None
    from matplotlib.ticker import MaxNLocator

    figure, axes = _figure(4.5 * len(panels), 3.8, len(panels))
    for ax, (title, unit, series) in zip(axes, panels, strict=True):
        _lines(ax, series)
        ax.set(title=title, xlabel="epoch", ylabel=unit)
        if unit:
            ax.set_ylim(0, 100)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    cut_long_texts(figure)  # before the layout: a long name would stretch it
    figure.tight_layout()
    return _image(figure)


def triplet_plot(report: RunReport) -> Image.Image | None:
    return _open(report.plot_file("triplet_test") or report.plot_file("triplet_train"))


def domains_plot(report: RunReport) -> Image.Image | None:
    """The run's in-domain vs out-of-domain Recall@1 per epoch (--eval-extra), as the training drew it."""
    return _open(report.plot_file("domains"))


def compatibility_plot(report: RunReport) -> Image.Image | None:
    """--compatible-with: Recall@1 per epoch of new/new, new queries against the old gallery, and old/old."""
    return _open(report.plot_file("compatibility"))


def wise_plot(report: RunReport) -> Image.Image | None:
    """The run's WiSE-FT curve: validation Recall@1 against the mixing weight (--wise-alpha)."""
    return _open(report.plot_file("wise"))


def moved_plot(report: RunReport) -> Image.Image | None:
    """A run without labels: the images whose neighbourhood moved most, with their neighbours before and after."""
    return _open(report.plot_file("moved"))


def pseudo_labels_plot(report: RunReport) -> Image.Image | None:
    """A run without labels: the pseudo-labels' group sizes and their stability, epoch by epoch."""
    return _open(report.plot_file("pseudo_labels"))


def retrieval_plot(report: RunReport) -> Image.Image | None:
    """Queries of the evaluation with their top 5, right and wrong marked, as the run or evaluation drew them."""
    return _open(report.plot_file("retrieval"))


def embedding_map_plot(report: RunReport) -> Image.Image | None:
    """The evaluation's embeddings in 2-D (UMAP or t-SNE), coloured by class."""
    return _open(report.plot_file("embedding_map"))


def embedding_map_note(report: RunReport) -> str | None:
    """Which classes and images the embedding map draws out of how many, and how they were chosen, as Markdown
    (None when the report has no map): from what the map recorded in its PNG, else from the report's class count."""
    from retrieval.analysis.pictures import MAP_MAX_CLASSES, MAP_MAX_POINTS, MAP_METADATA_KEY

    path = report.plot_file("embedding_map")
    if path is None:
        return None
    try:
        with Image.open(path) as image:
            facts = json.loads(getattr(image, "text", {}).get(MAP_METADATA_KEY, "null"))
    except (OSError, ValueError):
        facts = None
    if not isinstance(facts, dict) or not all(isinstance(facts.get(key), int) for key in
                                              ("classes_shown", "classes", "images_shown", "images")):
        classes = ((report.data.get("class_split") or {}).get("test") or {}).get("classes")
        if isinstance(classes, int) and classes > MAP_MAX_CLASSES:  # drawn before maps recorded their sample
            return (f"**The map shows {MAP_MAX_CLASSES} of the {classes} classes evaluated** (a random sample of "
                    f"them: more colours could not be told apart) and at most {MAP_MAX_POINTS} of their images; "
                    "each point is one image, coloured by class.")
        return "Each point is one image evaluated, coloured by class." + (
            f" All {classes} classes evaluated are shown." if isinstance(classes, int) else "")
    shown, total = facts["classes_shown"], facts["classes"]
    method = markdown_text(facts.get("method", "a 2-D projection"))
    seed = facts.get("seed")
    how = f" (a random sample, seed {seed}: more colours could not be told apart)" if isinstance(seed, int) else \
        " (a random sample: more colours could not be told apart)"
    classes_text = (f"**The map shows {shown} of the {total} classes evaluated**{how}" if shown < total
                    else f"**The map shows all {total} classes evaluated**")
    images_text = f"{facts['images_shown']:,} of the {facts['images']:,} images"
    return (f"{classes_text}, {images_text}; {method} of their embeddings, each point one image coloured by class "
            "(nearby points: embeddings the model finds alike).")


def summary_markdown(report: RunReport, shown: str | None = None) -> str:
    """The report's kind, where it is (``shown``: as the reader named it; default its file name) and its setup,
    as Markdown with every field of the report escaped (a report is anyone's file)."""
    train = run_settings(report)
    facts = [f"**{markdown_text(report.kind)}** report {markdown_code(shown or report.path.name)}"]
    for key in ("dataset", "backbone", "loss", "epochs", "embedding_dim"):
        value = train.get(key)
        value = value if value is not None else report.data.get(key)
        if value is not None:
            facts.append(f"{key}: {markdown_code(value)}")
    if report.kind == "evaluate":
        facts.append(f"split: {markdown_code(report.data.get('split'))}, "
                     f"queries: {markdown_text(report.data.get('num_queries'))}")
    return " · ".join(facts) + selection_markdown(report) + label_free_markdown(report) + \
        out_of_domain_markdown(report) + readings_markdown(report) + compatibility_markdown(report) + \
        problems_markdown(report)


def selection_markdown(report: RunReport) -> str:
    """A training run's choice of best.pt: on the validation split, or on the test split (its numbers optimistic,
    with the report's reason); empty for a report that does not say (an evaluation, or a run before it was
    recorded)."""
    selected_on = report.data.get("selected_on") if report.kind == "train" else None
    if selected_on == "validation":
        return "\n\n**best.pt chosen on:** the validation split (held-out train classes), not the test split."
    if selected_on == "test":
        note = report.data.get("selection_note") or "chosen on the test split: its numbers are optimistic"
        return f"\n\n**best.pt chosen on the test split:** {markdown_text(note)}."
    if selected_on == "kept":
        floor = run_settings(report).get("kept_floor")
        floor_text = f"{percent(floor):g}%" if is_number(floor) else "the --kept-floor share"
        return ("\n\n**best.pt chosen without labels:** the latest epoch whose images keep at least "
                f"{floor_text} of their {KEPT_K} nearest neighbours from the pretrained backbone (--kept-floor); the "
                "start where none does.")
    return ""


def label_free_markdown(report: RunReport) -> str:
    """A run without labels: the neighbours its images keep from the pretrained backbone, epoch by epoch, and the
    pseudo-labels' groups and their stability; empty for any other report."""
    section = report.data.get("label_free") if report.kind == "train" else None
    if not isinstance(section, dict):
        return ""
    kept = [row for row in section.get("kept") or [] if isinstance(row, dict) and _number_at(row, KEPT)]
    lines = []
    if kept:
        shown = kept[:KEPT_EPOCHS_SHOWN]
        steps = " → ".join(f"{percent(row[KEPT]):.0f}%" for row in shown)
        lines.append(f"the images keep {steps} of their {KEPT_K} nearest pretrained neighbours (epoch "
                     f"{markdown_text(known(shown[0].get('epoch')))} to "
                     f"{markdown_text(known(shown[-1].get('epoch')))})")
    groups = [row for row in section.get("groups") or [] if isinstance(row, dict)]
    if groups:
        last = groups[-1]
        stability = f", stability {last['stability']:.2f} (adjusted Rand index with the epoch before)" \
            if _number_at(last, "stability") else ""
        lines.append(f"pseudo-labels ({markdown_text(known(section.get('pseudo_labels')))}): "
                     f"{markdown_text(known(last.get('clusters')))} groups holding "
                     f"{markdown_text(known(last.get('clustered_images')))} of "
                     f"{markdown_text(known(last.get('images')))} images, "
                     f"the largest {markdown_text(known(last.get('largest_cluster')))}{stability}")
    return "\n\n**Without labels:** " + "; ".join(lines) + "." if lines else ""


def compatibility_markdown(report: RunReport) -> str:
    """A run trained --compatible-with an old model (or evaluated against its gallery): BCT's verdict, said plainly
    with the numbers it compares and their interval (``compatibility_sentence``); empty otherwise."""
    from retrieval.compatibility import compatibility_sentence

    blocks = (report.data.get("last") or {}).get("compatibility") or report.data.get("compatibility")
    try:
        sentence = compatibility_sentence(blocks) if isinstance(blocks, dict) else None
    except (KeyError, TypeError, ValueError, IndexError):  # a report is anyone's file: a block it lacks is no sentence
        sentence = None
    return f"\n\n**Compatibility with the old model:** {markdown_text(sentence)}." if sentence else ""


def run_settings(report: RunReport) -> dict[str, Any]:
    """The run's settings: a training run's config, or an evaluation's model with its data set and data."""
    if report.kind == "evaluate":
        return {**(report.data.get("model") or {}), "dataset": report.data.get("dataset"),
                "data": report.data.get("data")}
    config = report.data.get("config") or {}
    train = config.get("train", config) if isinstance(config, dict) else {}
    return train if isinstance(train, dict) else {}


def report_data(report: RunReport) -> tuple[str | None, str | None]:
    """The data set name and the data folder (or manifest) the run was measured on, as the report records them."""
    settings = run_settings(report)
    dataset, data = settings.get("dataset"), settings.get("data")
    return (str(dataset) if dataset is not None else None), (str(data) if data else None)


def same_data(data: str | None, gallery_root: str | None) -> bool:
    """Whether a run's data folder and an index's gallery folder are the same files (one holds the other)."""
    if not data or not gallery_root:
        return False
    run, gallery = Path(data).expanduser().resolve(), Path(gallery_root).expanduser().resolve()
    run = run.parent if run.suffix else run  # a manifest file: its folder
    return run == gallery or gallery.is_relative_to(run) or run.is_relative_to(gallery)


def data_relation_markdown(report: RunReport, gallery_root: str | None, index_name: str) -> str:
    """One line saying whether the report measured the images of the index being served, so that a run on
    another data set is not read as this index's quality."""
    dataset, data = report_data(report)
    named = markdown_code(dataset) + (f" ({markdown_code(Path(data).name)})" if data else "") if dataset \
        else "its own data"
    index = markdown_code(index_name)
    if same_data(data, gallery_root):
        return f"\n\n**Data:** this run measured {named}, the images of the index being served ({index})."
    return (f"\n\n**Another data set:** this run measured {named}, not the images of the index being served "
            f"({index}, below). Its metrics and pictures describe that run only.")


def out_of_domain_markdown(report: RunReport) -> str:
    """One line per --eval-extra set: Recall@1 of the pretrained backbone at its own resolution, before training,
    after it and of the WiSE-FT mix, so the in-domain gain is read beside what the other domain lost; then the share
    of each image's neighbours the fine-tuned models kept from the backbone's (label-free: the same measure works on
    a folder of unlabelled images, `retrieval compare`)."""
    reference = report.data.get("reference") or {}
    columns = [(name, values) for name, values in report.metric_columns().items() if values.get("extra")]
    lines = []
    for name in (reference.get("sets") or {}):
        shown = [f"{markdown_text(column)} {percent(values['extra'][name]['recall@1'])} {METRIC_UNIT}"
                 for column, values in columns if is_number((values["extra"].get(name) or {}).get("recall@1"))]
        kept = [f"{markdown_text(column)} {percent(values['extra'][name][KEPT])} {METRIC_UNIT}"
                for column, values in columns if isinstance((values["extra"].get(name) or {}).get(KEPT), float)]
        if shown:
            lines.append(f"- **{markdown_text(name)}**: " + " · ".join(shown) +
                         (f"; top-{KEPT_K} neighbours kept from the pretrained backbone's: " + " · ".join(kept)
                          if kept else ""))
    return ("\n\n**Out of domain (--eval-extra), Recall@1:**\n" + "\n".join(lines)) if lines else ""


# --- the results grid (retrieval results run) -----------------------------------------------------------------
def load_results(path: str | Path) -> dict[str, Any]:
    """The results document of the grid; a clear error when it is missing or of another kind."""
    from retrieval.analysis.results import RESULTS_FORMAT

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no results grid at {path}")
    data = _read_json(path, "results file", MAX_RESULTS_BYTES)
    if not isinstance(data, dict) or data.get("format") != RESULTS_FORMAT:
        raise ValueError(f"{path} is not a results file (expected format {RESULTS_FORMAT!r})")
    return data


@plain_text()
def results_curve_image(results: dict[str, Any], table_id: str) -> Image.Image | None:
    """The per-epoch curve figure of one table (e.g. SCT Figure 6) in percent; None when it has none."""
    curve = next((c for c in results.get("curves", []) if c.get("id") == table_id), None)
    if curve is None or not curve.get("series"):
        return None
    from matplotlib.ticker import MaxNLocator

    blocks = curve["series"]
    figure, axes = _figure(5.8 * len(blocks), 4.2, len(blocks))
    for ax, (block, lines) in zip(axes, blocks.items(), strict=True):
        _lines(ax, {label: (range(1, len(ys) + 1), [percent(y) for y in ys]) for label, ys in lines.items()})
        ax.set(title=block, xlabel="epoch", ylabel=f"{curve.get('ylabel', '')} ({METRIC_UNIT})", ylim=(0, None))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.suptitle(curve.get("title", ""))
    cut_long_texts(figure)  # before the layout: a long name would stretch it
    figure.tight_layout()
    return _image(figure)
