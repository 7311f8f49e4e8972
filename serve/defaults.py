"""Default artifact locations shared by ``make demo`` (the writer) and ``python app.py`` (the reader)."""

from __future__ import annotations

from pathlib import Path

# `make demo` writes these (relative to the working directory, like `retrieval demo --out artifacts/demo`).
DEMO_DIR = Path("artifacts/demo")
DEFAULT_INDEX_DIR = DEMO_DIR / "index"
DEFAULT_REPORT = DEMO_DIR / "run" / "report.json"
BUILD_COMMAND = "make demo"
# `python benchmarks/quality.py` writes the results grid here (in the repository, next to docs/RESULTS.md).
DEFAULT_RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results.json"
RESULTS_COMMAND = "python benchmarks/quality.py"

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7860
DEFAULT_MAX_UPLOAD_BYTES = 10 * 2**20  # 10 MiB per uploaded image
DEFAULT_MAX_PIXELS = (
    40_000_000  # a decoded query larger than this is refused as a possible decompression bomb
)
MAX_K = 1000


def missing_artifacts_message(index_dir: Path) -> str:
    """What to run when the index the app should open is not there."""
    return (
        f"no search index at {index_dir}. Build the demo artifacts (index in {DEFAULT_INDEX_DIR}, run report "
        f"in {DEFAULT_REPORT}) with `{BUILD_COMMAND}`, or pass your own: "
        "`python app.py --index INDEX_DIR --report REPORT.json`"
    )
