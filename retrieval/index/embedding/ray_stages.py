"""The Ray Data stages of ``--engine ray`` (``ray_engine``): the decode task and the embedding actor, in a module
of their own that never imports torch.

Ray runs them in worker processes that import the module defining them: every actor in a fresh process, the
decode tasks in the job's new workers. The decode task uses the local engine's ``gallery_file.decode_file``
with the torch-free ``EvalPreprocess`` (its crop; the actor normalises), and the actor runs onnxruntime, so
these imports (numpy, PIL, onnxruntime) keep torch and torchvision (~3-5 s to import on a 2-core machine) off
each command's start.
``tests/index/test_index_ray.py`` checks that it stays so.
"""

from __future__ import annotations

import functools
import json

import numpy as np

from retrieval.data.eval_preprocess import EvalPreprocess
from retrieval.data.preprocessing import ModelPreprocessing
from retrieval.index.embedding.gallery_file import decode_file
from retrieval.index.query_embedder import ModelMismatchError, load_model, prepare_vectors, with_output

FACTS = ("id", "ok", "sha256", "size", "error", "node")  # what the driver reads of a row written to a collection


def carried(batch: dict[str, np.ndarray], used: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The columns of ``batch`` a stage passes on untouched (a later stage's, e.g. a collection row's fields)."""
    return {key: value for key, value in batch.items() if key not in used}


@functools.lru_cache(maxsize=4)
def _preprocess(preprocessing: ModelPreprocessing) -> EvalPreprocess:
    return EvalPreprocess(preprocessing)  # the record is frozen, so it keys the cache


def decode_rows(batch: dict[str, np.ndarray], preprocessing: ModelPreprocessing, max_pixels: int
                ) -> dict[str, np.ndarray]:
    """Ray Data task: hash, decode and crop a batch of (id, path) rows with ``gallery_file.decode_file``.

    The pixels leave as uint8 crops (``EvalPreprocess.crop``) and the actor normalises them: a quarter of the
    bytes through Arrow and the object store, and the float work off the decode CPUs.
    """
    preprocess = _preprocess(preprocessing)
    size = preprocess.size
    rows = zip(batch["id"], batch["path"], strict=True)
    records = [decode_file(int(i), str(path), preprocess.crop, max_pixels) for i, path in rows]
    pixels = np.zeros((len(records), 3, size, size), np.uint8)  # unreadable rows stay zero and are not embedded
    for row, record in enumerate(records):
        if record.array is not None:
            pixels[row] = record.array
    return carried(batch, ("id", "path")) | {
        "id": np.asarray(batch["id"], np.int64),
        "ok": np.array([r.error is None for r in records]),
        "sha256": np.array([r.sha256 or "" for r in records], object),
        "size": np.array([-1 if r.size is None else r.size for r in records], np.int64),
        "error": np.array([r.error or "" for r in records], object),
        "pixels": pixels,
    }


class BatchEmbedder:
    """Ray Data actor: loads the ONNX model once, normalises and embeds the readable rows of each batch
    (``decode_rows``' uint8 crops) into unit vectors, each row marked with the id of the node that embedded it."""

    def __init__(self, model_path: str, model_hash: str, threads: int, output: str | None = None) -> None:
        """``output``: the model output to embed with (None: its own embedding)."""
        import onnxruntime
        import ray

        on_gpu = bool(ray.get_gpu_ids()) and "CUDAExecutionProvider" in onnxruntime.get_available_providers()
        model = load_model(model_path, providers="cuda" if on_gpu else "cpu", intra_op_threads=threads)
        if model.model_hash != model_hash:
            raise ModelMismatchError(
                f"{model_path} on this node has model_hash {model.model_hash}, the driver's has "
                f"{model_hash}; give every node the same model file"
            )
        self.embedder = with_output(model, output)
        self.preprocess = EvalPreprocess(self.embedder.preprocessing)
        # which node embedded each row: the driver records it per shard (the shard's ``embedded_on`` metadata)
        self.node_id = ray.get_runtime_context().get_node_id()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ok = np.asarray(batch["ok"], bool)
        dim = int(self.embedder.embedding_dim)
        vectors = np.zeros((len(ok), dim), np.float32)
        if ok.any():
            pixels = self.preprocess.normalize(np.asarray(batch["pixels"])[ok])
            vectors[ok] = prepare_vectors(self.embedder.embed(pixels), dim)
        return carried(batch, ("pixels",)) | {
            "embedding": vectors,
            "node": np.full(len(ok), self.node_id, object),
        }


class CollectionWriter:
    """Ray Data actor: writes the readable rows of each embedded batch into a Milvus collection and passes on only
    the facts the driver records (``FACTS``), so the vectors go from the actors to Milvus, never to the driver.

    Each row's scalar fields (path, label, manifest columns) arrive as the JSON the driver made of them (column
    ``fields``). Rows are upserted, never inserted: Milvus keeps a repeated primary key as a second row, and a row
    may be written again (a resumed build re-embeds the rows whose facts never reached the catalogue; Ray runs a
    batch again whose actor died after writing it).
    """

    def __init__(self, uri: str, collection: str, batch_rows: int) -> None:
        from retrieval.index.milvus.milvus_collection import MilvusPlace, connect

        self.client = connect(MilvusPlace(uri, collection))  # credentials: RETRIEVAL_MILVUS_TOKEN of the job's env
        self.collection, self.batch_rows = collection, max(1, batch_rows)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from retrieval.index.milvus.milvus_collection import ID, SHA256, SHARD, SIZE, VECTOR

        ok = np.asarray(batch["ok"], bool)
        rows = [
            {ID: int(i), VECTOR: vector.tolist(), SHA256: str(sha), SIZE: int(size), SHARD: None,
             **json.loads(str(fields))}
            for i, vector, sha, size, fields in zip(
                batch["id"][ok], np.asarray(batch["embedding"])[ok], batch["sha256"][ok], batch["size"][ok],
                batch["fields"][ok], strict=True)
        ]
        for start in range(0, len(rows), self.batch_rows):
            self.client.upsert(self.collection, rows[start: start + self.batch_rows])
        return {key: batch[key] for key in FACTS}
