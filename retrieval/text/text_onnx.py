"""``TextEmbedder``: a text tower exported by ``retrieval text train`` (``text.onnx``), run with onnxruntime and the
``tokenizers`` wheel alone: captions and queries -> L2-normalised vectors in an image model's embedding space.

The file carries everything a search needs in its metadata (``TEXT_FORMAT``): its tokenizer (``tokenizer.json``'s
text), the longest token sequence, the embedding size, and the hash of the image model whose space it maps into
(``image_model_hash``): an index built with another model refuses it, naming both (``check_text_model``). Its own
identity, ``model_hash``, is the sha256 (16 hex digits) of the bytes it runs, as an index records it. No torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.errors import ParameterError
from retrieval.text.tokens import TextTokenizer

TEXT_FORMAT = "retrieval-text-onnx/1"
INPUT_IDS, ATTENTION_MASK, TEXT_OUTPUT = "input_ids", "attention_mask", "embeddings"
# metadata_props keys of a text tower; values are strings (JSON for dicts)
TEXT_METADATA = ("format", "kind", "embedding_dim", "max_length", "image_model_hash", "encoder", "tokenizer",
                 "normalized")
MAX_TEXT_MODEL_BYTES = 2**31 - 1  # one protobuf: the tower keeps its weights inside
EMBED_BATCH = 64  # texts per session call


@dataclass(frozen=True)
class TextTowerRecord:
    """What a text tower needs to embed a query and what it maps into, as its ONNX metadata records it (the text
    side's ``ModelPreprocessing``): read from the metadata in one place (``from_metadata``), written by the export
    (``to_metadata``)."""

    embedding_dim: int
    max_length: int
    image_model_hash: str
    tokenizer: str  # tokenizer.json's text
    encoder: dict[str, Any] = field(default_factory=dict)  # the sentence encoder's name and the layers tuned

    def __post_init__(self) -> None:
        if self.embedding_dim < 1 or not 2 <= self.max_length <= 512:
            raise ValueError(f"embedding_dim {self.embedding_dim} and max_length {self.max_length} must be >= 1 and "
                             "2 to 512")
        if not self.image_model_hash:
            raise ValueError("no image_model_hash: the space the tower maps into is unknown")

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> TextTowerRecord:
        """The record of a text.onnx's metadata_props (``TEXT_METADATA``); ValueError naming what is missing."""
        missing = [key for key in TEXT_METADATA if key not in metadata]
        if metadata.get("format") != TEXT_FORMAT or metadata.get("kind") != "text" or missing:
            raise ValueError(f"format {metadata.get('format')!r}, missing {', '.join(missing) or 'nothing'}")
        encoder = json.loads(metadata["encoder"])
        if not isinstance(encoder, dict):
            raise ValueError("its encoder record is not a JSON object")
        return cls(int(metadata["embedding_dim"]), int(metadata["max_length"]), str(metadata["image_model_hash"]),
                   str(metadata["tokenizer"]), encoder)

    def to_metadata(self) -> dict[str, str]:
        """The metadata_props a text.onnx carries."""
        return {"format": TEXT_FORMAT, "kind": "text", "embedding_dim": str(self.embedding_dim),
                "max_length": str(self.max_length), "image_model_hash": self.image_model_hash,
                "encoder": json.dumps(self.encoder, sort_keys=True), "tokenizer": self.tokenizer,
                "normalized": "true"}


class TextModelError(ParameterError):
    """A text model that cannot be used as asked; the message names the problem and the fix."""

    def __init__(self, problem: str) -> None:
        super().__init__("text_model", problem)


def file_hash(path: Path) -> str:
    """The first 16 hex digits of a file's sha256, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()[:16]


class TextEmbedder:
    """``text.onnx`` at ``path``: ``embed(texts) -> float32 [n, dim]``, L2-normalised, in the space of the image
    model ``image_model_hash``."""

    def __init__(self, path: str | os.PathLike, providers: Sequence[str] | str = "auto") -> None:
        import onnxruntime as ort

        self.path = Path(path)
        if not self.path.is_file():
            raise TextModelError(f"{self.path} is not a file: give the text.onnx that `retrieval text train` wrote")
        if self.path.stat().st_size > MAX_TEXT_MODEL_BYTES:
            raise TextModelError(f"{self.path} is over 2 GiB: no text tower this toolkit writes is")
        data = self.path.read_bytes()  # hashed and run from the same bytes: a file swapped meanwhile cannot differ
        self.model_hash = hashlib.sha256(data).hexdigest()[:16]
        try:
            options = ort.SessionOptions()
            options.log_severity_level = 3
            self.session = ort.InferenceSession(data, options, providers=_providers(providers))
        except Exception as exc:  # onnxruntime's own kinds: not an ONNX file, unsupported ops
            raise TextModelError(f"{self.path} cannot be loaded as an ONNX model: {str(exc).splitlines()[0]}") from None
        metadata = dict(self.session.get_modelmeta().custom_metadata_map)
        if metadata.get("format") != TEXT_FORMAT or metadata.get("kind") != "text":
            raise TextModelError(f"{self.path} is not a text tower written by `retrieval text train` (format "
                                 f"{metadata.get('format')!r}); an image model searches with images, not text")
        try:
            self.record = TextTowerRecord.from_metadata(metadata)
            self.tokenizer = TextTokenizer(self.record.tokenizer, self.record.max_length)
        except (ValueError, TypeError) as exc:
            raise TextModelError(f"{self.path}: its metadata is damaged ({exc})") from None

    @property
    def dim(self) -> int:
        return self.record.embedding_dim

    @property
    def image_model_hash(self) -> str:
        return self.record.image_model_hash

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """L2-normalised float32 [n, dim] of ``texts`` (each cut to the tower's limits)."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for start in range(0, len(texts), EMBED_BATCH):
            ids, mask = self.tokenizer(texts[start: start + EMBED_BATCH])
            vectors = self.session.run([TEXT_OUTPUT], {INPUT_IDS: ids, ATTENTION_MASK: mask})[0]
            out[start: start + len(vectors)] = vectors
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-12)


def _providers(providers: Sequence[str] | str) -> list[str]:
    import onnxruntime as ort

    if providers != "auto":
        return list(providers)
    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


def check_text_model(text: TextEmbedder, index_info: Mapping[str, Any], declared: Iterable[str] = (),
                     where: str = "the index") -> None:
    """Refuse ``text`` for an index whose vectors are not in the space it maps into: it must have been trained
    for the index's model, for a model whose space the index's vectors are in (``model_output_space``), or for one
    the index's model is declared compatible with (``declared``: a compatible upgrade keeps the text model)."""
    index_hash = index_info.get("model_hash")
    if index_hash is None:
        raise TextModelError(f"{where} was built from embeddings, with no image model: a text tower maps text into "
                             "an image model's space, and this index has none to check it against")
    if int(index_info.get("embedding_dim", -1)) != text.dim:
        raise TextModelError(f"{text.path} embeds into {text.dim} dimensions; {where} holds "
                             f"{index_info.get('embedding_dim')}-dimensional vectors")
    space = set(index_info.get("model_output_space") or ()) | {str(index_hash)} | set(declared)
    if text.image_model_hash not in space:
        raise TextModelError(f"{text.path} was trained for image model {text.image_model_hash}, but {where} holds "
                             f"the vectors of model {index_hash}: train a text tower for that model with `retrieval "
                             "text train`")
