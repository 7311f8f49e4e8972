"""A small real index for the serving tests: emoji (or digits) PNGs, an ONNX EfficientNet-Lite0 at 64 px,
a faiss index built by ``retrieval.index.build_index``, and a run report written by ``train.report``; and
``BackgroundServer``, an app served on a loopback port for the tests that speak HTTP; ``serve_with_json_logs``, the
`retrieval serve` command itself."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from PIL import Image
from sample_images import png_bytes

IMAGE_SIZE = 64
EMOJI_CANDIDATES = 30  # -> about 25 classes x 2 styles
REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")


@dataclass(frozen=True)
class ServeArtifacts:
    root: Path
    gallery: Path  # a folder or a manifest.csv
    model: Path
    index_dir: Path
    report: Path
    query_paths: list[Path]  # some gallery images, labelled by their class folder
    labels: list[str]


def write_gallery(root: Path) -> tuple[Path, list[Path], list[str]]:
    """Emoji in two styles per class (real retrieval task); digits when the emoji fonts are missing."""
    try:
        from retrieval.data.emoji import prepare_emoji

        prepare_emoji(root / "emoji", image_size=IMAGE_SIZE, limit=EMOJI_CANDIDATES, progress=False)
        manifest = root / "emoji" / "manifest.csv"
        rows = [line.split(",") for line in manifest.read_text().splitlines()[1:]]
        return manifest, [root / "emoji" / r[0] for r in rows], [r[1] for r in rows]
    except FileNotFoundError:  # no emoji fonts: sklearn's digits are always there
        from sklearn.datasets import load_digits

        digits = load_digits()
        paths, labels = [], []
        for i in range(40):
            path = root / "digits" / str(digits.target[i]) / f"digit_{i:04d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            pixels = (digits.images[i] * 255 / 16).astype(np.uint8)
            Image.fromarray(pixels).resize((32, 32), Image.NEAREST).convert("RGB").save(path)
            paths.append(path)
            labels.append(str(digits.target[i]))
        return root / "digits", paths, labels


def export_model(path: Path, image_size: int = IMAGE_SIZE) -> Path:
    import torch

    from retrieval.export import export_embedder
    from retrieval.models import create_embedder

    torch.manual_seed(0)  # the random head: the same model (and model_hash) on every run
    model = create_embedder("efficientnet_lite0", embedding_dim=32, pretrained=True).eval()
    model.config = model.config.with_fields({"input_size": image_size})
    export_embedder(model, path, verify=False, log=lambda _: None)
    return path


def write_run_report(run_dir: Path, index_dir: Path) -> Path:
    """A training report over the index's own embeddings, through the real report writer (plots included)."""
    from retrieval.index.catalogue import Catalogue
    from retrieval.index.shards import ShardStore
    from retrieval.index.vectors import done_chunks
    from retrieval.metrics import evaluate
    from retrieval.records.run_config import RunFolderConfig
    from retrieval.train.report import write_report

    run_dir.mkdir(parents=True, exist_ok=True)
    with Catalogue(index_dir / "catalogue.sqlite") as catalogue:
        done = catalogue.done_shards()
        rows = catalogue.rows(list(done))
    ids, vectors = zip(*done_chunks(ShardStore(index_dir / "shards"), done), strict=True)
    ids, vectors = np.concatenate(ids), np.concatenate(vectors)
    names = sorted({rows[int(i)]["label"] for i in ids})
    labels = np.array([names.index(rows[int(i)]["label"]) for i in ids])
    last = evaluate(vectors, labels)
    noise = np.random.default_rng(0).normal(size=vectors.shape).astype(np.float32)
    baseline = evaluate(noise, labels)
    history = [{"epoch": 0, **baseline}, {"epoch": 1, "loss": 0.9}, {"epoch": 2, "loss": 0.6, **last}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in history))
    write_report(
        run_dir,
        RunFolderConfig.from_json({"train": {"dataset": "fixture", "backbone": "efficientnet_lite0", "loss": "none",
                                             "epochs": 2}}),
        history,
        baseline,
        {"epoch": 2, **last},
        last,
        (vectors, labels),
        None,
    )
    return run_dir / "report.json"


def write_full_report(run_dir: Path, artifacts: ServeArtifacts) -> Path:
    """A training report with every picture the demo's has (out-of-domain and WiSE-FT curves, the query grid and
    the embedding map) and a --compatible-with run's, over the index's own embeddings; the map draws at most 20 of
    the gallery's classes."""
    from retrieval.analysis.pictures import draw_evaluation_pictures
    from retrieval.compatibility import compatibility_verdict
    from retrieval.index.catalogue import Catalogue
    from retrieval.index.shards import ShardStore
    from retrieval.index.vectors import done_chunks
    from retrieval.metrics import evaluate
    from retrieval.records.run_config import RunFolderConfig
    from retrieval.train.report import write_report

    run_dir.mkdir(parents=True, exist_ok=True)
    with Catalogue(artifacts.index_dir / "catalogue.sqlite") as catalogue:
        done = catalogue.done_shards()
        rows = catalogue.rows(list(done))
    ids, vectors = zip(*done_chunks(ShardStore(artifacts.index_dir / "shards"), done), strict=True)
    ids, vectors = np.concatenate(ids), np.concatenate(vectors)
    names = sorted({rows[int(i)]["label"] for i in ids})
    labels = np.array([names.index(rows[int(i)]["label"]) for i in ids])
    paths = [rows[int(i)]["path"] for i in ids]
    last = evaluate(vectors, labels)
    baseline = evaluate(np.random.default_rng(0).normal(size=vectors.shape).astype(np.float32), labels)
    other = {"recall@1": 0.7, "map@r": 0.3}  # an --eval-extra set, as the demo's fashion-mnist
    def blocks(new: float, cross: float) -> dict:  # --compatible-with's three blocks and their verdict
        def per_query(value: float) -> dict:  # 40 queries that all score the block's mean
            return {"recall@1": np.full(40, value), "map@r": np.full(40, value / 2)}

        return {"new": {"recall@1": new, "map@r": new / 2}, "old": {"recall@1": 0.6, "map@r": 0.3},
                "cross_model": {"recall@1": cross, "map@r": cross / 2},
                **compatibility_verdict(per_query(cross), per_query(0.6))}

    history = [{"epoch": 0, **baseline, "extra": {"other": other}, "compatibility": blocks(0.6, 0.6)},
               {"epoch": 1, "loss": 0.9},
               {"epoch": 2, "loss": 0.6, **last, "extra": {"other": dict(other, **{"recall@1": 0.65})},
                "compatibility": blocks(0.7, 0.55)}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in history))
    reference = {"input_size": 224, "sets": {"other": {"test": {"recall@1": 0.72}}}}
    curve = [{"alpha": a, "in_domain": 0.5 + 0.3 * a, "out_of_domain": 0.7 - 0.1 * a} for a in (0, 0.5, 1)]
    wise = {"alpha": 0.5, "chosen": "auto", "curve": curve, "metrics": last}

    def pictures() -> dict[str, str]:
        def load(row: int) -> Image.Image:
            return Image.open(paths[row]).convert("RGB")

        return draw_evaluation_pictures(run_dir, vectors, labels, load, label_names=lambda i: names[i],
                                        method="tsne")

    config = {"train": {"dataset": "fixture", "backbone": "efficientnet_lite0", "loss": "none", "epochs": 2}}
    write_report(run_dir, RunFolderConfig.from_json(config),
                 history, baseline, {"epoch": 2, **last}, {**last, "compatibility": history[-1]["compatibility"]},
                 (vectors, labels), None, reference=reference,
                 wise=wise, pictures=pictures,
                 class_split={"test": {"classes": len(names), "images": len(ids)}})
    return run_dir / "report.json"


def build_artifacts(root: Path, image_size: int = IMAGE_SIZE) -> ServeArtifacts:
    from retrieval.index import IngestOptions, build_index

    gallery, paths, labels = write_gallery(root / "data")
    model = export_model(root / "model.onnx", image_size)
    build_index(
        gallery, root / "index", model=model, options=IngestOptions(batch_size=16, workers=0, progress=False)
    )
    report = write_run_report(root / "run", root / "index")
    return ServeArtifacts(root, gallery, model, root / "index", report, paths, labels)


QUERY_COLOUR = (200, 40, 40)
# the image the serving tests upload when any valid image will do: a flat red square
QUERY_PNG = png_bytes((48, 48), QUERY_COLOUR)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the tests' servers and nginx bind it next)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def first_health(url: str, process: subprocess.Popen, seconds: float = 120):
    """The first answer of a starting server's /health (an httpx response), waiting up to ``seconds``; fails with
    the end of the process's output when it exits or the time runs out."""
    import httpx

    deadline = time.monotonic() + seconds
    while True:
        try:
            return httpx.get(f"{url}/health", timeout=5)
        except httpx.TransportError:
            if process.poll() is not None or time.monotonic() > deadline:
                output = process.communicate(timeout=30)
                pytest.fail(f"the server at {url} did not answer: {''.join(o or '' for o in output)[-3000:]}")
            time.sleep(0.3)


def serve_with_json_logs(index_dir: Path, options: list[str], use: Callable[[str], T]) -> tuple[T, list[dict]]:
    """Start `retrieval serve --log-format json` on a free port with ``options``, wait for its /health (request id
    "probe"), call ``use`` with its URL, stop it with SIGTERM; ``use``'s answer and every line it logged, as JSON
    (every line must be one JSON object)."""
    import httpx

    port = free_port()
    command = [sys.executable, "-m", "retrieval", "serve", "--index", str(index_dir), "--no-ui", "--port", str(port),
               "--reload-interval", "0", "--log-format", "json", "--log-level", "info", *options]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=os.environ | {"PYTHONUNBUFFERED": "1", "PYTHONIOENCODING": "utf-8"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", headers={"X-Request-ID": "probe"}, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
            time.sleep(0.2)
        answer = use(url)
        time.sleep(0.5)  # the access lines of the last requests are written after their responses
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    return answer, [json.loads(line) for line in stderr.splitlines() if line.strip()]


class BackgroundServer:
    """uvicorn in a thread on a loopback port, for the time of a ``with`` block."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None,
                 limit_concurrency: int | None = None) -> None:
        import uvicorn

        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(
            app, host=self.host, port=self.port, log_level="warning", limit_concurrency=limit_concurrency
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


_BUILT: dict[str, ServeArtifacts] = {}


def shared_artifacts(tmp_path_factory) -> ServeArtifacts:
    """Built once per pytest session, whichever test module asks first (session fixtures are per module)."""
    if "artifacts" not in _BUILT:
        _BUILT["artifacts"] = build_artifacts(tmp_path_factory.mktemp("serve"))
    return _BUILT["artifacts"]


def shared_full_report(tmp_path_factory) -> Path:
    """``write_full_report`` over the shared artifacts, written once per pytest session."""
    if "full_report" not in _REPORTS:
        artifacts = shared_artifacts(tmp_path_factory)
        _REPORTS["full_report"] = write_full_report(tmp_path_factory.mktemp("full-run"), artifacts)
    return _REPORTS["full_report"]


_REPORTS: dict[str, Path] = {}


def require_emoji_labels(labels: list[str]) -> None:
    """Skip the calling test, saying why, unless every label is an emoji code-point sequence: without the emoji fonts
    the shared gallery is digits, and an emoji check must not pass by checking digits instead."""
    from retrieval.data.emoji import is_code_point_sequence

    if not all(is_code_point_sequence(label) for label in labels):
        pytest.skip("the gallery's labels are not emoji code points: digits where the emoji fonts are missing "
                    "(apt-get install fonts-noto-color-emoji), or the demo's index labelled by Unicode subgroup")


class Records(logging.Handler):
    """A logging handler that keeps the records it is given."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def access_records() -> Iterator[list[logging.LogRecord]]:
    """The access log's records while the block runs (the logger at INFO, as `retrieval serve` sets it; it is the
    process's logger: filter by request id)."""
    from retrieval.serve.observability import ACCESS_LOGGER

    logger, handler = logging.getLogger(ACCESS_LOGGER), Records()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


BACKENDS = ("folder", "milvus")  # the index folder, and the same index pushed into a Milvus Lite collection


def served_by(backend: str, artifacts: ServeArtifacts, tmp_path_factory) -> Iterator[Any]:
    """A ``SearchService`` of ``artifacts``' index served from ``backend`` (a fixture's body: yields, then closes)."""
    from retrieval.serve.service import SearchService

    milvus = None
    if backend == "milvus":
        pytest.importorskip("milvus_lite")
        from retrieval.index.milvus.milvus_collection import MilvusPlace
        from retrieval.index.milvus.milvus_push import push_index

        milvus = MilvusPlace.checked(str(tmp_path_factory.mktemp("milvus") / "gallery.db"), "gallery")
        push_index(artifacts.index_dir, milvus, index_type="FLAT", progress=False)
    service = SearchService(artifacts.index_dir, max_upload_bytes=200_000, max_pixels=4_000_000, milvus=milvus)
    yield service
    service.close()
