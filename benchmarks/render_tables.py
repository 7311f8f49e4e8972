"""Render the results files into docs/BENCHMARKS.md: each block between ``<!-- table: benchmarks/results/NAME.json -->``
and ``<!-- end table -->`` is rewritten from its file (machine and date, the command, the table).

    .venv/bin/python benchmarks/render_tables.py [DOC ...]      # default docs/BENCHMARKS.md, rewritten in place
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from results_io import read_result  # beside this file: a script's folder comes first on sys.path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- table: (?P<path>[^ ]+) -->\n)(?P<body>.*?)(<!-- end table -->)", re.DOTALL)
NUMBER = re.compile(r"^[-+~]?\d[\d,]*(\.\d+)?(x|%| %)?$")


def align(cells: list[str]) -> str:
    """A column's separator: right-aligned when every filled cell is a number."""
    filled = [cell for cell in cells if cell and cell != "-"]
    return "---:" if filled and all(NUMBER.match(cell) for cell in filled) else "---"


def escape(cell: str) -> str:
    """A cell's text safe inside a Markdown table."""
    return cell.replace("|", "\\|").replace("\n", " ")


def table_markdown(result: dict) -> str:
    """One results file as the doc shows it: machine and date, the command, then the table."""
    columns, rows = result["columns"], result["rows"]
    lines = [f"*{result['machine']}; {result['date']}.*", "", "```sh", result["command"].rstrip(), "```", ""]
    lines.append("| " + " | ".join(escape(column) for column in columns) + " |")
    lines.append("| " + " | ".join(align([row[i] for row in rows]) for i in range(len(columns))) + " |")
    lines += ["| " + " | ".join(escape(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def render(doc_path: str | Path) -> str:
    """The text of ``doc_path`` with every table block rendered from its results file."""

    def block(match: re.Match) -> str:
        result = read_result(ROOT / match["path"])  # relative to the repository; an absolute path stays as it is
        return match.group(1) + table_markdown(result) + match.group(4)

    return BLOCK.sub(block, Path(doc_path).read_text(encoding="utf-8"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("docs", nargs="*", type=Path, default=[ROOT / "docs/BENCHMARKS.md"])
    for doc in parser.parse_args().docs:
        text = render(doc)
        if text != doc.read_text(encoding="utf-8"):
            doc.write_text(text, encoding="utf-8")
            print(f"rendered {doc}")


if __name__ == "__main__":
    main()
