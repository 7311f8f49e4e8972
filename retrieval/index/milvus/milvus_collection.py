"""An index held in a Milvus collection: where it is (``MilvusPlace``), what it records (``CollectionRecord``, in the
collection's properties), its schema and vector index, and ``where`` filters as Milvus boolean expressions.

One collection holds one index: a row per indexed image with its ``id`` (the primary key, the local catalogue's id),
``vector`` (L2-normalised, searched by inner product = cosine), ``path`` (as the API shows it: relative to the gallery
root), ``label``, ``sha256``, ``size`` (the file's bytes) and ``shard`` (the index's shard its vector came from: a
re-embedded row has another; nullable), and one nullable scalar field per manifest column (``c0``, ``c1``, ...: a
manifest's column names are anyone's text, so fields are numbered and the properties map names to them), and, for an
index with keywords, their text and its BM25 vector (``milvus_keywords``). A Milvus server or cluster is
``http://host:19530``; Milvus Lite, the same engine in a local process, is a ``*.db`` file. Read side: nothing here
writes a collection (``milvus_push`` does).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from retrieval.errors import ParameterError
from retrieval.index.filters import (
    Both,
    Either,
    Filter,
    FilterError,
    InSet,
    Node,
    Not,
    check_value_type,
    unknown_column,
)
from retrieval.index.milvus.milvus_client import CollectionClient, quiet_pymilvus_logs, short_reason
from retrieval.records.index_info import IndexInfo

FORMAT = 1
ID, VECTOR, PATH, LABEL, SHA256, SIZE, SHARD = "id", "vector", "path", "label", "sha256", "size", "shard"
MAX_PATH_CHARS = 4096  # Milvus' VARCHAR needs a bound; a longer path is refused when pushed, naming it
MAX_LABEL_CHARS = 1024
MAX_TEXT_CHARS = 4096  # a manifest column's text
# the properties (strings) a collection built here carries; RECORD holds the rest as JSON
MODEL_HASH, EMBEDDING_DIM, PREPROCESSING, RECORD = (
    "retrieval.model_hash", "retrieval.embedding_dim", "retrieval.preprocessing", "retrieval.index")
PUSHING, COMPLETE = "pushing", "complete"
MAX_EXPRESSION_DEPTH = 80  # nested parentheses of a translated filter (Milvus Lite's parser failed past ~120)
INDEX_TYPES = ("AUTOINDEX", "FLAT", "HNSW", "IVF_FLAT", "IVF_PQ")
COLLECTION_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}")  # Milvus' rule for collection and alias names
MILVUS_TOKEN_ENV = "RETRIEVAL_MILVUS_TOKEN"  # a cluster's credentials, read from the environment only
MILVUS_URI_HELP = ("http://HOST:19530 (a Milvus server or cluster; https:// with TLS) or a NAME.db path (Milvus "
                   "Lite: the engine in this process; a folder since Milvus Lite 3, one file before)")
LITE_MARKERS = frozenset({"LOCK", "collections", "aliases.json", "databases"})  # what Milvus Lite 3 keeps in its folder


class MilvusError(ParameterError):
    """A collection that cannot be used as asked; the message names the problem and the fix."""


@dataclass(frozen=True)
class MilvusPlace:
    """Where an index lives in Milvus: ``uri`` (a server or a Milvus Lite file) and ``collection`` (or alias)."""

    uri: str
    collection: str

    @classmethod
    def checked(cls, uri: str, collection: str) -> MilvusPlace:
        """Both checked before anything connects (``check_uri``, ``check_name``)."""
        return cls(check_uri(uri), check_name(collection))

    @property
    def is_lite(self) -> bool:
        return not self.uri.startswith(("http://", "https://"))

    def __str__(self) -> str:
        return f"{self.uri} collection {self.collection}"


def check_uri(uri: str) -> str:
    """A Milvus URI: ``http(s)://host[:port]`` without credentials, or a ``*.db`` path whose folder exists (Milvus
    Lite: a folder since Milvus Lite 3, one file before; the one this install's Milvus Lite reads)."""
    if not isinstance(uri, str) or not uri.strip() or len(uri) > 2048:
        raise MilvusError("milvus", f"must be {MILVUS_URI_HELP}, got {uri!r:.80}")
    if uri.startswith(("http://", "https://")):
        parts = urlsplit(uri)
        if "@" in parts.netloc:  # never echoed: the URI is printed in start lines and connection errors
            raise MilvusError("milvus", f"holds credentials (user:password@): give them in the environment as "
                                        f"{MILVUS_TOKEN_ENV}=user:password (or an API key), never in the URI, which "
                                        "every process listing and log shows")
        if not parts.hostname or parts.path not in ("", "/") or parts.query or parts.fragment:
            raise MilvusError("milvus", f"{uri!r}: a server is http://HOST:PORT with nothing after the port")
        return uri.rstrip("/")
    path = Path(uri).expanduser()
    if path.suffix != ".db":
        raise MilvusError("milvus", f"{uri!r} is neither a server URL nor a Milvus Lite file: give {MILVUS_URI_HELP}")
    if not path.parent.is_dir():
        raise MilvusError("milvus", f"{uri!r}: the folder {path.parent} does not exist; create it first")
    check_lite_store(path)
    return str(path.resolve())


def lite_version() -> str | None:
    """The installed Milvus Lite's version; None when it is not installed."""
    try:
        return importlib.metadata.version("milvus-lite")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_lite_store(path: Path) -> None:
    """Refuse a ``*.db`` path the installed Milvus Lite cannot open: Milvus Lite 3 keeps a folder (and would fill
    any folder it is given), earlier versions one file; neither reads the other's."""
    version = lite_version()
    keeps_folder = None if version is None else int(version.split(".")[0]) >= 3
    if not path.exists():
        return
    if path.is_dir():
        if keeps_folder is False:
            raise MilvusError("milvus", f"{path} is a folder, but the Milvus Lite installed here ({version}) keeps a "
                                        "database in one file: give another NAME.db, or install milvus-lite>=3")
        with os.scandir(path) as entries:
            names = {entry.name for _, entry in zip(range(64), entries, strict=False)}
        if names and not names & LITE_MARKERS:
            raise MilvusError("milvus", f"{path} is a folder that holds no Milvus Lite database; Milvus Lite would "
                                        "write its files among yours: give a new NAME.db path")
    elif path.is_file():
        if keeps_folder:
            raise MilvusError("milvus", f"{path} is a Milvus Lite 2 database (one file), which the Milvus Lite "
                                        f"installed here ({version}) cannot read (it keeps a folder): push the index "
                                        "again into a new NAME.db")
    else:
        raise MilvusError("milvus", f"{path} is neither a file nor a folder")


def check_name(name: str) -> str:
    """A collection or alias name Milvus accepts: a letter or _, then letters, digits or _ (at most 255)."""
    if not isinstance(name, str) or not COLLECTION_NAME.fullmatch(name):
        raise MilvusError("collection", f"{name!r:.80} is not a Milvus collection name: a letter or _, then "
                                        "letters, digits or _ (at most 255)")
    return name


def connect(place: MilvusPlace, timeout_s: float = 30.0) -> CollectionClient:
    """A ``pymilvus.MilvusClient`` for ``place`` (as a ``CollectionClient``: it loads a released collection and
    raises ``MilvusUnavailable`` when the server cannot be reached), with the credentials of ``MILVUS_TOKEN_ENV``
    when set (``user:password`` or an API key); the extra named when pymilvus (or Milvus Lite) is missing."""
    from retrieval.extras import MissingExtra

    try:
        from pymilvus import MilvusClient
    except ModuleNotFoundError as exc:
        raise MissingExtra("a Milvus collection", "pymilvus") from exc
    if place.is_lite:
        try:
            import milvus_lite  # noqa: F401  (pymilvus starts it for a *.db URI)
        except ModuleNotFoundError as exc:
            raise MissingExtra("a Milvus Lite file", "milvus_lite") from exc
    quiet_pymilvus_logs()
    token = os.environ.get(MILVUS_TOKEN_ENV, "")  # never an argument: `ps` shows every process's arguments
    try:
        client = MilvusClient(uri=place.uri, timeout=timeout_s, **({"token": token} if token else {}))
    except Exception as exc:  # pymilvus raises its own kinds for a refused or unreachable server
        raise MilvusError("milvus", f"cannot connect to {place.uri}: {short_reason(exc)}; is the server running "
                                    "and reachable from here?") from None
    return CollectionClient(client, place.uri)


# --- what a collection records ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ColumnField:
    """A manifest column as a Milvus field: ``name`` as filters spell it, ``field`` in the schema, ``kind``
    ``number`` (DOUBLE) or ``text`` (VARCHAR), as ``filters.infer_column`` reads the local index's values."""

    name: str
    field: str
    kind: str

    @property
    def is_text(self) -> bool:
        return self.kind == "text"


@dataclass
class CollectionRecord:
    """What a collection built here says about itself: the index.json fields of its model (``info``), its manifest
    columns, the vector index type, whether a push finished (``state``) and the rows it was to send."""

    info: dict[str, Any]
    columns: list[ColumnField] = field(default_factory=list)
    index_type: str = "AUTOINDEX"
    state: str = PUSHING
    rows: int = 0  # the local index's rows when the push started
    text_columns: list[str] = field(default_factory=list)  # the columns its keywords hold (``milvus_keywords``)

    @property
    def index_info(self) -> IndexInfo:
        """The collection's copy of index.json (``info``, as the collection's properties hold it), typed."""
        return IndexInfo.from_json(self.info)

    @property
    def model_hash(self) -> str | None:
        value = self.index_info.model.hash
        return None if value is None else str(value)

    @property
    def dim(self) -> int:
        return int(self.index_info.model.embedding_dim)  # type: ignore[arg-type]  # a pushed index records it

    def properties(self, preprocessing: Mapping[str, Any] | None = None) -> dict[str, str]:
        """The collection's properties: the model's hash, the embedding size and the preprocessing as their own
        properties (an operator reads them with any Milvus tool), the rest as one JSON document."""
        body = {"format": FORMAT, "info": self.info, "index_type": self.index_type, "state": self.state,
                "rows": self.rows,
                "columns": [[c.name, c.field, c.kind] for c in self.columns], "text_columns": self.text_columns}
        properties = {MODEL_HASH: self.model_hash or "none (built from embeddings)",
                      EMBEDDING_DIM: str(self.dim), RECORD: json.dumps(body, separators=(",", ":"))}
        if preprocessing is not None:
            properties[PREPROCESSING] = json.dumps(dict(preprocessing), sort_keys=True)
        return properties

    @classmethod
    def from_properties(cls, properties: Mapping[str, Any]) -> CollectionRecord | None:
        """The record in a collection's properties; None for a collection this toolkit did not build."""
        raw = properties.get(RECORD)
        if raw is None:
            return None
        try:
            body = json.loads(raw)
            columns = [ColumnField(str(n), str(f), str(k)) for n, f, k in body.get("columns", [])]
            return cls(dict(body["info"]), columns, str(body["index_type"]), str(body["state"]),
                       int(body.get("rows", 0)), [str(c) for c in body.get("text_columns") or []])
        except (TypeError, ValueError, KeyError) as exc:
            raise MilvusError("collection", f"its property {RECORD} is damaged ({exc}); push the index into a new "
                                            "collection") from None

    def column_names(self) -> list[str]:
        """Every column a ``where`` may name, in the local index's order."""
        return [ID, PATH, LABEL, *(c.name for c in self.columns)]

    def output_fields(self) -> list[str]:
        """The scalar fields a result row reads."""
        return [PATH, LABEL, SHA256, SIZE, *(c.field for c in self.columns)]


def read_record(client: Any, collection: str) -> CollectionRecord | None:
    """The record of ``collection`` (a name or an alias); None when the collection does not exist."""
    if not client.has_collection(collection):
        return None
    described = client.describe_collection(collection)
    record = CollectionRecord.from_properties(described.get("properties") or {})
    if record is None:
        raise MilvusError("collection", f"{collection!r} exists but was not built by `retrieval index push` (it has "
                                        f"no {RECORD} property); choose another name")
    return record


def refuse_other_model(record: CollectionRecord, model_hash: str | None, collection: str, fix: str) -> None:
    """MilvusError naming both hashes when ``collection`` holds another model's vectors."""
    if record.model_hash != model_hash:
        raise MilvusError("collection", f"{collection!r} holds the vectors of model {record.model_hash or 'none'}, "
                                        f"not {model_hash or 'none'} (this index's); {fix}")


# --- the schema and the vector index ----------------------------------------------------------------------------
def column_fields(kinds: Sequence[tuple[str, bool]]) -> list[ColumnField]:
    """Manifest columns ``(name, is_text)`` as numbered fields ``c0, c1, ...``."""
    return [ColumnField(name, f"c{n}", "text" if is_text else "number") for n, (name, is_text) in enumerate(kinds)]


def collection_schema(dim: int, columns: Sequence[ColumnField]) -> Any:
    """The Milvus schema of an index of ``dim``-dimensional vectors with these manifest columns."""
    from pymilvus import DataType, MilvusClient

    schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field(ID, DataType.INT64, is_primary=True)
    schema.add_field(VECTOR, DataType.FLOAT_VECTOR, dim=int(dim))
    schema.add_field(PATH, DataType.VARCHAR, max_length=MAX_PATH_CHARS)
    schema.add_field(LABEL, DataType.VARCHAR, max_length=MAX_LABEL_CHARS, nullable=True)
    schema.add_field(SHA256, DataType.VARCHAR, max_length=64, nullable=True)
    schema.add_field(SIZE, DataType.INT64, nullable=True)
    schema.add_field(SHARD, DataType.VARCHAR, max_length=256, nullable=True)  # where its vector came from
    for column in columns:
        if column.is_text:
            schema.add_field(column.field, DataType.VARCHAR, max_length=MAX_TEXT_CHARS, nullable=True)
        else:
            schema.add_field(column.field, DataType.DOUBLE, nullable=True)
    return schema


def vector_index_params(client: Any, index_type: str, rows: int, dim: int) -> Any:
    """The vector index of ``index_type`` for ``rows`` vectors of ``dim`` (inner product): IVF lists ~ 4 sqrt(n)
    (faiss' rule of thumb), PQ with 8-bit codes of 4 dimensions each where ``dim`` allows, HNSW M=32."""
    if index_type not in INDEX_TYPES:
        raise MilvusError("index_type", f"{index_type!r}: choose one of {', '.join(INDEX_TYPES)}")
    nlist = int(min(65536, max(1, 4 * math.isqrt(max(rows, 1)))))
    params: dict[str, Any] = {"FLAT": {}, "AUTOINDEX": {}, "HNSW": {"M": 32, "efConstruction": 200},
                              "IVF_FLAT": {"nlist": nlist},
                              "IVF_PQ": {"nlist": nlist, "m": pq_subquantizers(dim), "nbits": 8}}[index_type]
    index_params = client.prepare_index_params()
    index_params.add_index(VECTOR, index_type=index_type, metric_type="IP", params=params)
    return index_params


def pq_subquantizers(dim: int) -> int:
    """PQ's sub-vectors: the divisor of ``dim`` nearest dim / 4 (Milvus needs one that divides it)."""
    wanted = max(1, dim // 4)
    return min((m for m in range(1, dim + 1) if dim % m == 0), key=lambda m: (abs(m - wanted), m))


def search_params(index_type: str, k: int) -> dict[str, Any]:
    """Search-time settings: HNSW's ef and IVF's nprobe widened with k, as the local auto policy widens faiss'."""
    if index_type == "HNSW":
        return {"params": {"ef": max(64, 2 * k)}}
    if index_type in ("IVF_FLAT", "IVF_PQ"):
        return {"params": {"nprobe": 32}}
    return {}


# --- where filters as Milvus expressions ------------------------------------------------------------------------
def milvus_filter(where: Filter, record: CollectionRecord) -> str:
    """``where`` (the local filter language, parsed) as a Milvus boolean expression over ``record``'s fields, with
    the local refusals (an unknown column, a value of the wrong kind) and Milvus' own (``MAX_EXPRESSION_DEPTH``, a
    string it cannot carry). Missing values make a comparison unknown and unknown never matches (``filters``): each
    node is translated into the expression of the rows where it is true and the one where it is false, a missing
    value in neither. A chain of ``and`` (or of ``or``) is one flat expression, as deep as one of its terms."""
    fields = {ID: (ID, False), PATH: (PATH, True), LABEL: (LABEL, True),
              **{c.name: (c.field, c.is_text) for c in record.columns}}
    for name in where.columns():
        if name not in fields:
            raise unknown_column(name, record.column_names())
    true, _, depth = _truth(where.root, fields)
    if depth > MAX_EXPRESSION_DEPTH:
        raise FilterError(f"where: nests {depth} parentheses deep once translated for Milvus, whose parser takes at "
                          f"most {MAX_EXPRESSION_DEPTH}; write it with fewer nested groups")
    return true


def _chain(node: Node) -> list[Node]:
    """The terms of a chain of the same connective (``a and b and c``), left to right."""
    kind, terms, pending = type(node), [], [node]
    while pending:
        item = pending.pop()
        if type(item) is kind:
            pending.extend((item.right, item.left))
        else:
            terms.append(item)
    return terms


def _truth(node: Node, fields: Mapping[str, tuple[str, bool]]) -> tuple[str, str, int]:
    """(where ``node`` is true, where it is false, the parentheses they nest), as Milvus expressions."""
    if isinstance(node, Not):
        true, false, depth = _truth(node.operand, fields)
        return false, true, depth
    if isinstance(node, (Both, Either)):
        parts = [_truth(term, fields) for term in _chain(node)]
        # both true where every term is, false where any is; either the other way round
        joins = (") and (", ") or (") if isinstance(node, Both) else (") or (", ") and (")
        trues, falses = (joins[0].join(t for t, _, _ in parts), joins[1].join(f for _, f, _ in parts))
        return f"(({trues}))", f"(({falses}))", 2 + max(d for _, _, d in parts)
    name, is_text = fields[node.column]
    values = node.values if isinstance(node, InSet) else (node.value,)
    for value in values:
        check_value_type(is_text, node.column, value)
    if isinstance(node, InSet):
        listed = "[" + ", ".join(_literal(v) for v in node.values) + "]"
        holds = f"{name} in {listed}" if node.values else "false"
        holds, fails = (holds, f"not ({holds})") if not node.negated else (f"not ({holds})", holds)
    else:
        op = "==" if node.op == "=" else node.op
        holds, fails = f"{name} {op} {_literal(node.value)}", f"not ({name} {op} {_literal(node.value)})"
    if node.column in (ID, PATH):  # never missing
        return holds, fails, 1
    known = f"{name} is not null"
    return f"({known} and {holds})", f"({known} and {fails})", 2


_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _literal(value: str | float) -> str:
    """A Milvus literal: a double-quoted string (``\\`` ``"`` and newline, tab, carriage return escaped; other
    control characters refused, as Milvus' parser has no escape for them) or a number."""
    if not isinstance(value, str):
        return repr(float(value))
    if any(ord(c) < 32 and c not in _ESCAPES for c in value):
        raise FilterError(f"where: the string {value!r:.60} holds a control character, which a Milvus "
                          "expression cannot carry")
    if any(0xD800 <= ord(c) <= 0xDFFF for c in value):  # not text in UTF-8, which Milvus speaks
        raise FilterError(f"where: the string {value!r:.60} holds a lone surrogate (half of a UTF-16 pair), which "
                          "is not text a Milvus expression can carry")
    return '"' + "".join(_ESCAPES.get(c, c) for c in value) + '"'
