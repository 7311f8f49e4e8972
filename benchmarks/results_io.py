"""Benchmark results as files: one table a file, benchmarks/results/<benchmark>-<machine>.json, with the command that
measured it, the machine and the date. docs/BENCHMARKS.md shows them (benchmarks/render_tables.py, `make docs`).

A benchmark script given ``--save MACHINE`` calls ``record_tables``: the Markdown tables it prints are written as
results files when it ends (a script that prints JSON instead has it written as a table: a row for each object it
printed, or the key and value rows of its one document). MACHINE is one of ``MACHINES``' keys or a short description
of another machine.
"""

from __future__ import annotations

import atexit
import datetime
import io
import json
import os
import re
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REQUIRED = ("benchmark", "command", "machine", "date", "columns", "rows")
# The machines the recorded tables ran on: file-name key -> what the machine is.
MACHINES = {
    "cpu-2core": "2-core CPU, 24 GiB, no GPU",
    "h100": "NVIDIA H100 80GB HBM3, 16 CPU cores",
    "h200": "NVIDIA H200, 16 CPU cores",
}
SAVE_HELP = f"also write the printed tables to benchmarks/results/ for MACHINE ({', '.join(MACHINES)} or words)"
SEPARATOR = re.compile(r"^\|(\s*:?-{3,}:?\s*\|)+\s*$")


def machine_key(machine: str) -> str:
    """The file-name part for ``machine``: its key in ``MACHINES``, else the description made file-safe."""
    for key, description in MACHINES.items():
        if machine in (key, description):
            return key
    return re.sub(r"[^a-z0-9]+", "-", machine.lower()).strip("-") or "machine"


def result_path(benchmark: str, machine: str) -> Path:
    """Where ``write_result`` puts the table of ``benchmark`` measured on ``machine``."""
    return RESULTS / f"{benchmark}-{machine_key(machine)}.json"


def dump_result(result: dict) -> str:
    """``result`` as JSON text: metadata a line each, then one line a row (readable diffs)."""
    lines = []
    for key, value in result.items():
        if key == "rows":
            rows = ",\n".join("    " + json.dumps(row, ensure_ascii=False) for row in value)
            lines.append(f'  "rows": [\n{rows}\n  ]' if rows else '  "rows": []')
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write_result(benchmark: str, machine: str, command: str, columns: list[str], rows: list[list],
                 notes: str | None = None, date: str | None = None, path: Path | None = None) -> Path:
    """Write one table to benchmarks/results/<benchmark>-<machine>.json (or ``path``) and return where it went."""
    columns = [str(column) for column in columns]
    rows = [[str(cell) for cell in row] for row in rows]
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"a row of {len(row)} cells for {len(columns)} columns: {row}")
    result = {"benchmark": benchmark, "command": command, "machine": MACHINES.get(machine, machine),
              "date": date or datetime.date.today().isoformat(), "columns": columns, "rows": rows}
    if notes:
        result["notes"] = notes
    path = path or result_path(benchmark, machine)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_result(result), encoding="utf-8")
    return path


def read_result(path: str | Path) -> dict:
    """A results file, checked: the metadata every table needs and rows as long as its columns."""
    result = json.loads(Path(path).read_text(encoding="utf-8"))
    missing = [key for key in REQUIRED if not result.get(key)]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)}")
    width = len(result["columns"])
    for row in result["rows"]:
        if len(row) != width:
            raise ValueError(f"{path}: a row of {len(row)} cells for {width} columns: {row}")
    return result


def split_row(line: str) -> list[str]:
    """The cells of one Markdown table line."""
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def markdown_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every Markdown table in ``text``, as (columns, rows)."""
    tables, lines = [], text.splitlines()
    i = 0
    while i < len(lines) - 1:
        if lines[i].lstrip().startswith("|") and SEPARATOR.match(lines[i + 1].strip()):
            columns, rows = split_row(lines[i]), []
            i += 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                cells = split_row(lines[i])
                rows.append((cells + [""] * len(columns))[: len(columns)])
                i += 1
            tables.append((columns, rows))
        else:
            i += 1
    return tables


def flatten(value, prefix: str = "") -> list[list[str]]:
    """A JSON document as [key path, value] rows (lists of scalars stay one value)."""
    if isinstance(value, dict):
        return [row for key, item in value.items() for row in flatten(item, f"{prefix}{key}.")]
    if isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value):
        return [row for i, item in enumerate(value) for row in flatten(item, f"{prefix}{i}.")]
    return [[prefix.rstrip("."), cell_text(value)]]


def json_documents(text: str) -> list:
    """The JSON documents printed in ``text``: one a line, or one indented over several lines."""
    decoder, found, end = json.JSONDecoder(), [], 0
    for match in re.finditer(r"^[\[{]", text, re.MULTILINE):
        if match.start() < end:  # inside the document found last
            continue
        try:
            document, length = decoder.raw_decode(text[match.start():])
        except ValueError:
            continue
        found.append(document)
        end = match.start() + length
    return found


def cell_text(value) -> str:
    """A JSON value as a table cell: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def json_table(documents: list) -> tuple[list[str], list[list[str]]] | None:
    """Printed JSON as a table: one row a document where several flat objects were printed, else key and value rows
    of the last document."""
    if len(documents) > 1 and all(isinstance(document, dict) for document in documents):
        columns = list(dict.fromkeys(key for document in documents for key in document))
        return columns, [[cell_text(document.get(column, "")) for column in columns] for document in documents]
    return (["key", "value"], flatten(documents[-1])) if documents else None


class Tee(io.TextIOBase):
    """Writes to the real stdout and keeps a copy."""

    def __init__(self, stream) -> None:
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def record_tables(benchmark: str | list[str], machine: str | None) -> None:
    """With ``machine`` set (``--save``), write the tables this process prints as results files when it ends.

    ``benchmark`` names them, a name a table (tables past the names get -2, -3, ...); the command is this process's
    command line without ``--save``. Without ``machine`` nothing happens."""
    if not machine:
        return
    names = [benchmark] if isinstance(benchmark, str) else list(benchmark)
    tee, pid = Tee(sys.stdout), os.getpid()
    sys.stdout = tee
    argv, skip = [], False
    for arg in sys.argv[1:]:
        if skip or arg == "--save" or arg.startswith("--save="):
            skip = arg == "--save"
            continue
        argv.append(arg)
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(RESULTS.parent.parent) if script.is_relative_to(RESULTS.parent.parent) else script
    command = shlex.join(["python", str(shown), *argv])

    def write_all() -> None:
        if os.getpid() != pid:  # a forked child (a DataLoader worker, a pool) exiting
            return
        sys.stdout = tee.stream
        printed = tee.copy.getvalue()
        tables = markdown_tables(printed) or [table for table in [json_table(json_documents(printed))] if table]
        for i, (columns, rows) in enumerate(tables):
            name = names[i] if i < len(names) else f"{names[-1]}-{i + 1}"
            print(f"saved {write_result(name, machine, command, columns, rows)}", file=sys.stderr)

    atexit.register(write_all)
