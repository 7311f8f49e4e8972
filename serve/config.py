"""The server's settings: one dataclass whose fields are declared once (``retrieval.options``), so that
``retrieval serve``'s options, their checks and docs/SERVING.md's table are made from the same declaration.

Light on purpose (no Gradio, no uvicorn): the command line reads these declarations to build its options.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from retrieval.gallery_option import gallery_root_option
from retrieval.index.live import RELOAD_INTERVAL_S
from retrieval.options import REQUIRED, TRUSTED_MODEL, declared_options, field_problem, hint_members, option
from retrieval.serve.defaults import (
    API_TOKEN_ENV,
    DEFAULT_HOST,
    DEFAULT_INDEX_DIR,
    DEFAULT_MAX_PIXELS,
    DEFAULT_MAX_UPLOAD_BYTES,
    DEFAULT_PORT,
    DEFAULT_REPORT,
    DEFAULT_RESULTS,
    DEFAULT_UPLOAD_CACHE_BYTES,
    DEFAULT_UPLOAD_MAX_AGE_S,
    LOG_FORMATS,
    LOG_LEVELS,
    MIN_TOKEN_CHARS,
    PUBLIC_PATHS,
    UPLOAD_PRUNE_INTERVAL_S,
)
from retrieval.serve.exposure import is_loopback

MIB = 2**20


@dataclass
class ServerConfig:
    """What one server serves and how. Each field is declared once, here: its ``option`` says the flag, help,
    choices and range of ``retrieval serve``; the fields declared ``command_line=False`` are set by a command option
    of another form (cli/serve.py's ``COMMAND_FORMS``: a file that holds a secret, MiB for bytes)."""

    # index
    index_dir: Path = option(REQUIRED, "index", "the index folder (`retrieval index build`).", flag="--index",
                             path="dir", default_text=f"{DEFAULT_INDEX_DIR} (`make demo`)")
    report: Path | None = option(
        None, "index", "the report.json of `retrieval train` or `evaluate` that the Evaluation tab shows.",
        path="file", default_text=f"{DEFAULT_REPORT} when serving the default index")
    results: Path | None = option(
        None, "index", "the results grid (`retrieval results run`) that the Results tab shows; without one the tab "
        "is left out.", path="file", default_text=f"this project's {DEFAULT_RESULTS.name} when serving the default "
        "index")
    model: Path | None = option(
        None, "index", "the query model (.onnx): a model declared compatible with the index's (`retrieval train "
        "--compatible-with`, then `retrieval export`) serves it before `retrieval index upgrade`, through its "
        "compatible output where its own embedding has another size. " + TRUSTED_MODEL, path="file",
        metavar="MODEL.onnx",
        default_text="the model index.json records")
    text_model: Path | None = option(
        None, "index", "the text tower (text.onnx, `retrieval text train`) that embeds text queries (POST /search "
        "with \"text\", the app's \"or describe it\"); it must have been trained for the index's image model (or "
        "one that model is declared compatible with), else the server refuses to start. " + TRUSTED_MODEL,
        path="file", metavar="TEXT.onnx",
        default_text="the one index.json records (`retrieval index text`); none: no text search")
    gallery_root: Path | None = gallery_root_option("index")
    milvus: str | None = option(
        None, "index", "serve a Milvus collection instead of an index folder: http://HOST:19530 (a Milvus server or "
        "cluster; several servers may serve one collection) or a FILE.db (Milvus Lite, this process only); with "
        "--collection. Searches read the collection as it is: `retrieval index add|remove --milvus` show at the "
        "next request.", metavar="URI")
    collection: str | None = option(None, "index", "the collection --milvus serves (`retrieval index push` names it).",
                                    metavar="NAME")
    reload_interval_s: float | None = option(
        RELOAD_INTERVAL_S, "index", "seconds between checks of the index folder: once a writer (`retrieval index "
        "add/remove/...`) finishes, the server swaps in the new index without a restart; 0 turns it off.",
        flag="--reload-interval", low=0, high=3600)
    # network
    host: str = option(DEFAULT_HOST, "network", "the interface to bind (loopback by default). Any other host needs "
                       "--token-file (and --auth-file unless --no-ui), or --insecure.")
    port: int = option(DEFAULT_PORT, "network", "the port to listen on.", low=0, high=65535)
    allowed_hosts: tuple[str, ...] = option(
        (), "network", "a host name clients reach the server by (e.g. search.example.com, the name nginx passes on); "
        "repeatable. localhost and IP addresses are always answered; any other Host header gets 400 (a web page "
        "could otherwise point its own name at this server: DNS rebinding).", flag="--allowed-host", metavar="NAME")
    cors_origins: tuple[str, ...] = option(
        (), "network", "another web origin (e.g. https://app.example.com) whose pages may call this server from a "
        "browser; repeatable. Requests from any other origin get 403.", flag="--cors-origin", metavar="ORIGIN")
    # uvicorn's syntax; without a proxy named, the headers are ignored, else any local client could forge the
    # address the access log records
    forwarded_allow_ips: str | None = option(
        None, "network", "the proxy in front of the server (comma-separated IP addresses or networks, e.g. "
        "127.0.0.1 for deploy/nginx.conf on this machine): from it the client address (access log) and scheme are "
        "taken from X-Forwarded-For/-Proto.", metavar="IPS",
        default_text="no proxy, those headers are ignored (any client could forge them)")
    # access: the token and the logins never come from the command line itself (`ps` shows it to every user)
    api_token: str | None = option(
        None, "access", f"the bearer token every API call must send (`Authorization: Bearer TOKEN`; "
        f"{', '.join(PUBLIC_PATHS)} stays open for load balancers), at least {MIN_TOKEN_CHARS} characters: the "
        f"first line of this file, or {API_TOKEN_ENV}. Never on the command line: `ps` shows it to every user.",
        flag="--token-file", command_line=False, default_text=f"{API_TOKEN_ENV}, else the API is open")
    ui_auth: list[tuple[str, str]] | None = option(
        None, "access", "the Gradio app's logins: a file of `user:password` lines (blank lines and # comments "
        "skipped). Keep it readable by you only (chmod 600).", flag="--auth-file", command_line=False,
        default_text="the Gradio app is open")
    insecure: bool = option(False, "access", "serve a non-loopback --host without authentication (anyone who "
                            "reaches the port can search).", negatable=False)
    # limits
    max_upload_bytes: int = option(
        DEFAULT_MAX_UPLOAD_BYTES, "limits", "the largest image upload accepted, in MiB on the command line (larger: "
        "HTTP 413).", flag="--max-upload-mb", command_line=False, default_text=f"{DEFAULT_MAX_UPLOAD_BYTES // MIB} MiB")
    max_pixels: int = option(DEFAULT_MAX_PIXELS, "limits", "the largest image accepted, in pixels "
                             "(decompression-bomb guard, HTTP 400).")
    concurrency: int = option(8, "limits", "API searches running at once; more wait in a queue.", low=1, high=256)
    max_queue: int = option(64, "limits", "API searches waiting for their turn; beyond them HTTP 503.", low=0)
    max_batch: int = option(32, "limits", "the largest micro-batch of query images embedded together.", low=1,
                            high=1024)
    max_wait_ms: float = option(5.0, "limits", "how long a micro-batch waits for more queries that are already on "
                                "their way, in milliseconds.", low=0, high=1000)
    # the app
    ui: bool = option(True, "app", "serve the Gradio app at / besides the HTTP API (--no-ui: the API only).")
    upload_dir: Path | None = option(
        None, "app", "the Gradio app's upload and cache folder, this server's alone (its old files are deleted).",
        path="dir", default_text="a new private folder per start, removed at exit")
    upload_max_age_s: float = option(DEFAULT_UPLOAD_MAX_AGE_S, "app", "seconds an uploaded or cached file is kept.",
                                     flag="--upload-max-age", low=1)
    upload_cache_bytes: int = option(
        DEFAULT_UPLOAD_CACHE_BYTES, "app", "the upload folder's size bound, in MiB on the command line (at least 1); "
        "beyond it the oldest files are deleted.", flag="--upload-cache-mb", command_line=False,
        default_text=f"{DEFAULT_UPLOAD_CACHE_BYTES // MIB} MiB")
    upload_prune_interval_s: float = option(
        UPLOAD_PRUNE_INTERVAL_S, "app", "seconds between prunes of the upload folder (between them it may grow by the "
        "uploads made).", flag="--upload-prune-interval", low=0, low_open=True)
    # logs
    observe: bool = option(True, "logs", "GET /metrics (Prometheus) and the access log.")
    log_level: str = option("info", "logs", "the server's log lines on stderr: info adds one access-log line per "
                            "request (request id, method, route, status, milliseconds, client; never bodies or "
                            "tokens).", choices=LOG_LEVELS)
    log_format: str = option("text", "logs", "json: one object per line (for a log shipper).", choices=LOG_FORMATS)

    def __post_init__(self) -> None:
        self._read_loose_values()
        problems = [problem for declared in declared_options(type(self))
                    if (problem := field_problem(declared, getattr(self, declared.name))) is not None]
        if (self.milvus is None) != (self.collection is None):
            problems.append("--milvus URI and --collection NAME go together")
        elif self.milvus is not None:  # checked before anything loads or connects
            from retrieval.index.milvus.milvus_collection import MilvusError, MilvusPlace

            try:
                MilvusPlace.checked(self.milvus, self.collection)
            except MilvusError as exc:
                problems.append(f"--{exc.param} {exc.problem}")
        if problems:
            raise ValueError("; ".join(problems))

    def _read_loose_values(self) -> None:
        """Values a caller may give loosely, read as the declared type: a path as a string, a list as a tuple;
        an origin without its trailing slash (browsers send none, so it could never match)."""
        for declared in declared_options(type(self)):
            value = getattr(self, declared.name)
            if isinstance(value, str) and Path in hint_members(declared.hint):
                setattr(self, declared.name, Path(value))
            elif isinstance(value, list) and isinstance(declared.default, tuple):
                setattr(self, declared.name, tuple(value))
        if isinstance(self.cors_origins, tuple) and all(isinstance(origin, str) for origin in self.cors_origins):
            self.cors_origins = tuple(origin.rstrip("/") for origin in self.cors_origins)

    def access_summary(self) -> str:
        """How the server is protected, for the start-up message."""
        api = (f"API needs `Authorization: Bearer <token>` (from --token-file or {API_TOKEN_ENV}; "
               f"{', '.join(PUBLIC_PATHS)} open)" if self.api_token else "API open, no token")
        ui = ("" if not self.ui else f"; Gradio app needs one of {len(self.ui_auth)} logins" if self.ui_auth
              else "; Gradio app open, no login")
        if is_loopback(self.host):
            where = "loopback only"
        elif self.api_token and (self.ui_auth or not self.ui):
            where = "on the network"
        else:
            where = "ON THE NETWORK WITHOUT AUTHENTICATION (--insecure)"
        origins = f" except from {', '.join(self.cors_origins)}" if self.cors_origins else ""
        names = ", ".join(("localhost", "loopback addresses" if is_loopback(self.host) else "IP addresses",
                           *self.allowed_hosts))
        summary = f"{where}: {api}{ui}; cross-origin browser calls refused{origins}; host names answered: {names}"
        if not is_loopback(self.host):
            summary += ("\nOn a network, serve through nginx (deploy/nginx.conf; docs/SECURITY.md): uvicorn alone has "
                        "no header timeout, and a few slow clients (slowloris) can hold every connection")
        return summary
