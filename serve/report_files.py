"""Reading a run's report files (``retrieval train`` or ``retrieval evaluate``: report.json, the readings and
metrics.jsonl beside it) and the results grid's document, checked: a file of another kind is refused, a value no
page can show is left out and named (``RunReport.problems``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrieval.compatibility import KEPT
from retrieval.reports import READINGS_FILE, REPORT_FORMAT, REPORT_KINDS
from retrieval.serve.page_text import percent, shown_text
from retrieval.utils.io import read_capped

MAX_REPORT_BYTES = 50 * 2**20  # a run report is a few KiB: anything this big is not one
MAX_RESULTS_BYTES = 16 * 2**20
# The largest float is about 1.8e308: an integer of more digits cannot be shown, drawn or compared as a number
# (float() overflows), and past 4300 digits Python will not even read it (int() refuses, in quadratic time).
FLOAT_DIGITS = 309
LONG_DIGIT_RUN = re.compile(rb"\d{%d}" % FLOAT_DIGITS)  # a cheap look first: most reports hold no such number
MAX_PROBLEMS_NAMED = 5  # values left out of one file that are named one by one; the rest are counted
MAX_FIELD_CHARS = 120  # a field's name in such a message (its keys are anyone's text)
METRIC_ORDER = ("map@r", "r_precision", "nmi", "f1", "linear_probe", KEPT)


def pretrained_export_column(section: object) -> str:
    """The metrics table's column of a run's pretrained export: its input size and resize mode, as measured."""
    section = section if isinstance(section, dict) else {}
    size, resize = section.get("input_size"), section.get("resize")
    return (f"pretrained export, {known(size) if is_number(size) else '?'} px "
            f"{resize if resize in ('crop', 'pad') else '?'}")


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


def number_at(row: dict[str, Any], key: str) -> bool:
    """Whether ``row`` holds at ``key`` a number the page can show and draw (``is_number``)."""
    return is_number(row.get(key))


@dataclass
class RunReport:
    """A run report as read: its file, its fields, the readings beside it and the values left out of either."""

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
            pretrained = self.data.get("pretrained_export")
            pretrained = pretrained if isinstance(pretrained, dict) else {}
            columns = {
                "start (epoch 0)": self.data.get("baseline"),  # the backbone through the head as it started
                f"best (epoch {known(best.get('epoch'))})": best,
                # what the user serves without training (the pretrained export), on the same test images
                pretrained_export_column(pretrained): {key: pretrained.get(key) for key in ("recall@1", "map@r")}
                if pretrained else None,
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
    """The report at ``path`` with the readings beside it; a clear error when it is missing or of another kind."""
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
