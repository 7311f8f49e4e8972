"""``TextEmbedder``: a text tower exported by ``retrieval text train`` (``text.onnx``), run with onnxruntime and the
``tokenizers`` wheel alone: captions and queries -> L2-normalised vectors in an image model's embedding space.

The file carries everything a search needs in its metadata (``TEXT_FORMAT``): its tokenizer (``tokenizer.json``'s
text), the longest token sequence, the embedding size, and the hash of the image model whose space it maps into
(``image_model_hash``): an index built with another model refuses it, naming both (``check_text_model``). Its own
identity, ``model_hash``, is computed as an image model's is (``retrieval.utils.onnx_hash.proto_model_hash``): its
graph and weights and what prepares its text (``TextTowerRecord.identity``), never its annotations; a record written
before names it by the sha256 of its file's bytes (``legacy_text_hash``), which still recognises it
(``TextEmbedder.model_hashes``). It runs in the image model's session (``retrieval.onnx_runtime``). No torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from retrieval.errors import ParameterError
from retrieval.onnx_runtime import make_session, resolve_providers
from retrieval.text.tokens import TextTokenizer, TokenizerError, first_line
from retrieval.utils.onnx_hash import proto_model_hash
from retrieval.utils.unit_rows import l2_normalize_rows

if TYPE_CHECKING:
    from retrieval.records.index_info import IndexInfo

TEXT_FORMAT = "retrieval-text-onnx/1"
INPUT_IDS, ATTENTION_MASK, TEXT_OUTPUT = "input_ids", "attention_mask", "embeddings"
# metadata_props keys of a text tower; values are strings (JSON for dicts)
TEXT_METADATA = ("format", "kind", "embedding_dim", "max_length", "image_model_hash", "encoder", "tokenizer",
                 "normalized")
MAX_TEXT_MODEL_BYTES = 2**31 - 1  # one protobuf: the tower keeps its weights inside
EMBED_BATCH = 64  # texts tokenized together
# texts x tokens^2 in one session call: attention holds [texts, heads, tokens, tokens] floats per layer; 2^20 keeps
# 64 texts of 128 tokens in one call, and 4 of 512 (MiniLM's 12 heads: 48 MB a layer's scores)
MAX_ATTENTION_CELLS = 1 << 20
PROBE_TEXTS = ("a red apple", "a smiling face")  # embedded when a text model loads


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

    def identity(self) -> dict[str, Any]:
        """What prepares a text for the graph and what the graph must answer: what the tower's hash covers beside its
        graph and weights (the image model hashes its preprocessing so); the space it maps into and the encoder's
        name are labels, not part of what it computes."""
        return {"format": TEXT_FORMAT, "embedding_dim": self.embedding_dim, "max_length": self.max_length,
                "tokenizer": self.tokenizer}

    def identity_digest(self) -> Any:
        """A sha256 object fed with ``identity()``, for ``proto_model_hash`` to add the graph and weights to."""
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode())


class TextModelError(ParameterError):
    """A text model that cannot be used as asked; the message names the problem and the fix."""

    def __init__(self, problem: str) -> None:
        super().__init__("text_model", problem)


def legacy_text_hash(data: bytes) -> str:
    """The hash versions before ``tower_hashes`` recorded for a text tower: the first 16 hex digits of its file's
    sha256. Matched, never recorded anew."""
    return hashlib.sha256(data).hexdigest()[:16]


def tower_hashes(data: bytes, record: TextTowerRecord | None = None) -> tuple[str, ...]:
    """Every hash a record may name the text tower of a file's bytes ``data`` by: its ``model_hash``
    (``proto_model_hash`` over its graph and weights and ``record``'s identity; None: the record its metadata holds),
    then ``legacy_text_hash``; bytes that are no text tower (no ONNX model, no text record) go by the legacy hash
    alone."""
    return _hashed(data, record)[0]


def _hashed(data: bytes, record: TextTowerRecord | None = None) -> tuple[tuple[str, ...], TextTowerRecord | None]:
    """``tower_hashes`` and the record the first was taken with (None where the bytes have none)."""
    import onnx

    try:
        proto = onnx.load_model_from_string(data)
        if record is None:
            record = TextTowerRecord.from_metadata({entry.key: entry.value for entry in proto.metadata_props})
    except Exception:  # protobuf's DecodeError, a damaged record: no graph or record to hash
        return (legacy_text_hash(data),), None
    return (proto_model_hash(proto, record), legacy_text_hash(data)), record


@dataclass(frozen=True)
class TowerFile:
    """A text tower's file read once: its bytes and every hash they go by (``tower_hashes``). What found it by its
    hash hands this on (``TextEmbedder(TowerFile)``), so the bytes run are the bytes hashed, read and hashed once."""

    path: Path
    data: bytes = field(repr=False, compare=False)  # the file whole: never compared or shown
    hashes: tuple[str, ...]
    record: TextTowerRecord | None  # the metadata the first hash was taken with (None: the bytes have none)


def read_tower(path: str | os.PathLike) -> TowerFile:
    """The file at ``path``, read whole once and hashed (the caller bounds its size by ``MAX_TEXT_MODEL_BYTES``)."""
    data = Path(path).read_bytes()
    return TowerFile(Path(path), data, *_hashed(data))


def file_hashes(path: Path) -> tuple[str, ...]:
    """``tower_hashes`` of the file at ``path`` (read whole: the caller bounds its size by ``MAX_TEXT_MODEL_BYTES``)."""
    return read_tower(path).hashes


def file_hash(path: Path) -> str:
    """The ``model_hash`` of the text tower at ``path``, as records name it."""
    return file_hashes(path)[0]


class TextEmbedder:
    """``text.onnx`` at ``path``: ``embed(texts) -> float32 [n, dim]``, L2-normalised, in the space of the image
    model ``image_model_hash``; ``path`` may be a ``TowerFile`` already read and hashed (its bytes are run)."""

    def __init__(self, path: str | os.PathLike | TowerFile, providers: Sequence[str] | str = "auto") -> None:
        read = path if isinstance(path, TowerFile) else None
        self.path = read.path if read is not None else Path(path)
        if read is None and not self.path.is_file():
            raise TextModelError(f"{self.path} is not a file: give the text.onnx that `retrieval text train` wrote")
        if read is None and self.path.stat().st_size > MAX_TEXT_MODEL_BYTES:
            raise TextModelError(f"{self.path} is over 2 GiB: no text tower this toolkit writes is")
        try:
            chosen = resolve_providers(providers)
        except (RuntimeError, ValueError) as exc:  # a provider not here: the image model's words, as a text error
            raise TextModelError(str(exc)) from None
        # hashed and run from the same bytes: a file swapped meanwhile cannot differ
        data = read.data if read is not None else self.path.read_bytes()
        try:
            self.session = make_session(data, chosen, log_severity=3)
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
        # hashed again only where onnxruntime read other metadata than the hash was taken with
        same = read is not None and read.record == self.record
        self.model_hashes = read.hashes if same else tower_hashes(data, self.record)
        if len(self.model_hashes) < 2:  # onnxruntime read it; onnx, which hashes it, could not
            raise TextModelError(f"{self.path} cannot be read as an ONNX model by onnx: export it again with "
                                 "`retrieval text train`")
        self._check_graph()
        self._check_embeds()

    @property
    def model_hash(self) -> str:
        """Its identity as new records name it (``tower_hashes``); ``model_hashes`` also holds the legacy one."""
        return self.model_hashes[0]

    @property
    def dim(self) -> int:
        return self.record.embedding_dim

    @property
    def image_model_hash(self) -> str:
        return self.record.image_model_hash

    def query_tokens(self, texts: Sequence[str]) -> list[int]:
        """Each query's tokens, what embedding it costs (``TextTokenizer.query_tokens``): ``WordlessText`` for a
        query with no word to search by, ``TextEmbeddingError`` where the tokenizer fails."""
        try:
            return self.tokenizer.query_tokens(texts)
        except TokenizerError as exc:
            raise TextEmbeddingError(f"the text model {self.path.name} cannot embed this text: {exc}") from None

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """L2-normalised float32 [n, dim] of ``texts`` (each cut to the tower's limits), in session calls of at most
        ``MAX_ATTENTION_CELLS`` texts x tokens^2 (texts of like length together); ``TextEmbeddingError`` if the model
        fails on them."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for start in range(0, len(texts), EMBED_BATCH):
            chunk = texts[start: start + EMBED_BATCH]
            try:
                ids, mask = self.tokenizer(chunk)
            except TokenizerError as exc:
                raise TextEmbeddingError(f"the text model {self.path.name} cannot embed this text: {exc}") from None
            lengths = mask.sum(axis=1)
            for rows in session_calls(lengths):
                width = max(int(lengths[rows].max()), 1)  # padding is on the right: the longest row's tokens suffice
                out[start + rows] = self._run(ids[rows, :width], mask[rows, :width])
        return l2_normalize_rows(out, zero_rows="keep")

    def _run(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """One session call: [n, dim] finite vectors, or ``TextEmbeddingError`` saying what failed."""
        try:
            vectors = self.session.run([TEXT_OUTPUT], {INPUT_IDS: ids, ATTENTION_MASK: mask}, _run_options())[0]
        except Exception as exc:  # onnxruntime's errors: an id beyond the token table, a shape it cannot take
            raise TextEmbeddingError(f"the text model {self.path.name} failed on {ids.shape[0]} text(s) of "
                                     f"{ids.shape[1]} tokens: {first_line(exc)}") from None
        vectors = np.asarray(vectors)
        if vectors.shape != (len(ids), self.dim) or not np.isfinite(vectors).all():
            raise TextEmbeddingError(f"the text model {self.path.name} answered {len(ids)} text(s) with an array of "
                                     f"shape {list(vectors.shape)}, not {len(ids)} finite vectors of {self.dim}")
        return vectors

    def _check_graph(self) -> None:
        """Refuse a graph that does not take what a text tower takes: input_ids and attention_mask, int64 [batch,
        tokens] (an image model relabelled as text has an image input)."""
        inputs = {i.name: i for i in self.session.get_inputs()}
        wanted = {INPUT_IDS, ATTENTION_MASK}
        shown = ", ".join(f"{i.name} {i.type} {list(i.shape)}" for i in inputs.values())
        if set(inputs) != wanted or any(i.type != "tensor(int64)" or len(i.shape) != 2 for i in inputs.values()):
            raise TextModelError(f"{self.path} is not a text tower: its graph takes {shown}, where a text tower "
                                 f"takes {INPUT_IDS} and {ATTENTION_MASK} (int64, [texts, tokens]); give the "
                                 "text.onnx that `retrieval text train` wrote")
        if TEXT_OUTPUT not in {o.name for o in self.session.get_outputs()}:
            raise TextModelError(f"{self.path} is not a text tower: its graph has no output {TEXT_OUTPUT!r}")
        for i in inputs.values():
            if isinstance(i.shape[1], int) and i.shape[1] != self.record.max_length:
                raise TextModelError(f"{self.path} records a longest token sequence of {self.record.max_length}, "
                                     f"but its graph takes exactly {i.shape[1]} tokens: it was relabelled; export "
                                     "it again with `retrieval text train`")

    def _check_embeds(self) -> None:
        """Embed what a query can reach before any query does: the tokenizer's largest token id, a text of the
        longest token sequence, and a few real texts; a failure refuses the model (``TextModelError``)."""
        longest, largest = self.record.max_length, self.tokenizer.largest_id
        try:
            ids, _ = self.tokenizer(PROBE_TEXTS[:1])
        except TokenizerError as exc:
            raise TextModelError(f"{self.path} cannot embed a test text, so queries would fail: {exc}") from None
        probes = {
            f"its tokenizer's largest token id ({largest})": (np.full((1, 3), largest, np.int64),
                                                              np.ones((1, 3), np.int64)),
            f"a text of its longest token sequence ({longest} tokens)": (
                np.resize(ids[0], (1, longest)), np.ones((1, longest), np.int64)),
        }
        try:
            for what, (probe_ids, probe_mask) in probes.items():
                try:
                    self._run(probe_ids, probe_mask)
                except TextEmbeddingError as exc:
                    raise TextModelError(f"{self.path} cannot embed {what}, so queries would fail: {exc}; its "
                                         "tokenizer, recorded length and graph do not belong together (export it "
                                         "again with `retrieval text train`)") from None
            self.embed(list(PROBE_TEXTS))  # the longest sequence ran above
        except TextEmbeddingError as exc:
            raise TextModelError(f"{self.path} cannot embed a test text, so queries would fail: {exc}") from None


class TextEmbeddingError(RuntimeError):
    """A text model that failed on a query (the server's model, not the query, is at fault: HTTP 503)."""


def session_calls(lengths: np.ndarray, budget: int | None = None) -> list[np.ndarray]:
    """Rows of a batch whose texts have ``lengths`` tokens, grouped into session calls of at most ``budget`` texts x
    tokens^2 (attention's memory grows with the square of the tokens), like lengths together; one text per call at
    the least."""
    budget = MAX_ATTENTION_CELLS if budget is None else budget
    order = np.argsort(lengths, kind="stable")[::-1]
    calls: list[list[int]] = []
    for row in order.tolist():
        width = int(lengths[calls[-1][0]]) if calls else 0  # a call's first row is its longest
        if calls and (len(calls[-1]) + 1) * width * width <= budget:
            calls[-1].append(row)
        else:
            calls.append([row])
    return [np.asarray(sorted(rows)) for rows in calls]


def _run_options() -> Any:
    """A session call's options: the CPU arena shrunk after the call (a long batch's activations go back to the
    system, not kept at their largest), and a failed call's error left to the caller (``TextEmbeddingError``)."""
    import onnxruntime as ort

    options = ort.RunOptions()
    options.log_severity_level = 4
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return options


def check_text_model(text: TextEmbedder, index_info: IndexInfo, declared: Iterable[str] = (),
                     where: str = "the index", model_file: str = "") -> None:
    """Refuse ``text`` for an index whose vectors are not in the space it maps into: it must have been trained
    for the index's model, for a model whose space the index's vectors are in (``model_output_space``), or for one
    the index's model is declared compatible with (``declared``: a compatible upgrade keeps the text model). A
    refusal names both models and the training that fits, with ``model_file`` (the index's model, printable)."""

    recorded = index_info.model
    index_hash = recorded.hash
    if index_hash is None:
        raise TextModelError(f"{where} was built from embeddings, with no image model: a text tower maps text into "
                             "an image model's space, and this index has none to check it against")
    space = set(recorded.output_space or ()) | {str(index_hash)} | set(declared)
    dim = recorded.embedding_dim
    wrong_size = (-1 if dim is None else int(dim)) != text.dim
    if wrong_size or text.image_model_hash not in space:
        model = model_file or "INDEX_MODEL.onnx"
        size = f" and embeds into {text.dim} dimensions, but {where} holds {dim}-dimensional vectors" \
            if wrong_size else f", but {where} holds the vectors"
        raise TextModelError(
            f"{text.path} was trained for image model {text.image_model_hash}{size} of model {index_hash}: a text "
            f"model searches only the space of the image model it was trained for. Train one for the index's model "
            f"with `retrieval text train --model {model} --images MANIFEST --caption-column COLUMN --out RUN`, "
            "then record it with `retrieval index text`")
