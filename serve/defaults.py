"""Default artifact locations shared by ``make demo`` (the writer) and ``python app.py`` (the reader)."""

from __future__ import annotations

from pathlib import Path

from retrieval.data.decode import DEFAULT_MAX_PIXELS  # noqa: F401  (the one decoder's limit, re-exported)

# `make demo` writes these (relative to the working directory, like `retrieval demo --out artifacts/demo`).
DEMO_DIR = Path("artifacts/demo")
DEFAULT_INDEX_DIR = DEMO_DIR / "index"
DEFAULT_REPORT = DEMO_DIR / "run" / "report.json"
BUILD_COMMAND = "make demo"
# `retrieval results run` writes the results grid here (in the repository, next to docs/RESULTS.md).
DEFAULT_RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results.json"

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7860
DEFAULT_MAX_UPLOAD_BYTES = 10 * 2**20  # 10 MiB per uploaded image
MAX_BATCH_QUERIES = 64  # queries in one POST /search/batch (embedded in one model call)
MAX_BATCH_UPLOAD_BYTES = 32 * 2**20  # a batch's images together: the per-image limit x MAX_BATCH_QUERIES, capped here
API_DOCS_PATH = "/docs"  # the JSON API's Swagger UI (ReDoc at /redoc); the app links here, not to Gradio's API page
LOG_LEVELS = ("debug", "info", "warning", "error")  # `retrieval serve --log-level`; info: the access log too
LOG_FORMATS = ("text", "json")  # `--log-format`


def missing_artifacts_message(index_dir: Path) -> str:
    """What to run when the index the app should open is not there."""
    return (
        f"no search index at {index_dir}. Build the demo artifacts (index in {DEFAULT_INDEX_DIR}, run report "
        f"in {DEFAULT_REPORT}) with `{BUILD_COMMAND}`, or pass your own: "
        "`python app.py --index INDEX_DIR --report REPORT.json`"
    )

# --- exposure and the Gradio upload cache (docs/SECURITY.md lists these) --------------------------------
API_TOKEN_ENV = "RETRIEVAL_API_TOKEN"  # the API's bearer token, when not given by --token-file
MIN_TOKEN_CHARS = 16  # shorter tokens are refused: guessable
PUBLIC_PATHS = ("/health",)  # answered without the token: load balancers probe them and hold no secret
DEFAULT_UPLOAD_MAX_AGE_S = 3600  # uploads and Gradio's result copies older than this are deleted
DEFAULT_UPLOAD_CACHE_BYTES = 512 * 2**20  # beyond this on disk, the oldest files in the cache are deleted
UPLOAD_PRUNE_INTERVAL_S = 10  # how often the cache is pruned (between prunes it may grow by the uploads made)
GRADIO_JSON_BODY_LIMIT = 2**20  # Gradio event bodies only name uploaded files: 1 MiB is ample (413 beyond)

# --- availability: what the API takes in at once (docs/SECURITY.md "Availability") ----------------------------
BATCH_CONCURRENCY = 1  # image batches searched at once, in threads of their own: single searches never wait for them
BATCH_QUEUE_IMAGES = 2 * MAX_BATCH_QUERIES  # images of batches waiting for their turn; beyond: 503
# Re-ranked work in units of about 1 ms of one core (``retrieval.rerank.work_units``): a request costs its queries
# times its method's units; up to RERANK_CHEAP_UNITS it is as cheap as a search and runs in the searches lane
RERANK_CONCURRENCY = 1  # costlier re-ranked requests run at once, in threads of their own
RERANK_QUEUE_UNITS = 4_000  # their units waiting for a turn (about 4 s of one core); beyond: 503
RERANK_CLIENT_UNITS = 1_000  # one client's units running and waiting (one request of any size always fits)
RERANK_CHEAP_UNITS = 4  # a request of at most this many units is as cheap as a plain search
# A batch's texts are charged to the batches lane by their tokens (``retrieval.serve.service.text.text_work``):
# a MiniLM-L6 tower's tokens that cost one efficientnet_lite0 image (224 px) on a CPU core, and the tokens where its
# attention's square term costs as much again as the rest (measured; docs/SERVING.md, "Searching by text")
TEXT_TOKENS_PER_IMAGE = 64
TEXT_ATTENTION_TOKENS = 512
BODY_BUDGET_BYTES = 128 * 2**20  # request bodies held at once (read, parsed, waiting); beyond: wait, then 503
BODY_READ_TIMEOUT_S = 60.0  # a body arrives within this (43 MB at 1 MB/s does); nginx buffers bodies before us
