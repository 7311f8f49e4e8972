"""``IndexInfo``: the typed record of an index folder's ``index.json`` (timm's ``PretrainedCfg`` and our
``ModelPreprocessing`` are the pattern): read from the file's JSON object in one place (``IndexLayout.read_record``,
``IndexInfo.from_json``), passed through the core, and given back as JSON by ``to_json`` only where the file is
written; the file's keys, order and values are kept (``json_object.KeptJson``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from retrieval.records.json_object import KeptJson, copied_object

FORMAT = "retrieval-index/1"  # index.json's format and version (``format``)


def _key(name: str) -> Any:
    """A record field that holds index.json's key ``name`` (None: the file does not hold it)."""
    return dataclasses.field(default=None, metadata={"key": name})


class _Part:
    """A part of the record: its fields name the index.json keys they hold."""

    KEYS: ClassVar[dict[str, str]]  # index.json key -> field name, set by ``_keyed``

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Any:
        return cls(**{name: data.get(key) for key, name in cls.KEYS.items()})


def _keyed(cls: type) -> type:
    cls.KEYS = {field.metadata["key"]: field.name for field in dataclasses.fields(cls)}
    return cls


@_keyed
@dataclass(frozen=True)
class ModelRecord(_Part):
    """The image model that built the vectors (``records.model_fields`` writes it)."""

    path: str | None = _key("model_path")
    relative: str | None = _key("model_path_relative")  # its path from the index folder (``portable.find_model``)
    hash: str | None = _key("model_hash")
    legacy_hash: str | None = _key("legacy_model_hash")  # what an earlier version's declaration names it by
    source_hash: str | None = _key("source_model_hash")  # the PyTorch weights it was exported from
    parent_hash: str | None = _key("fp32_model_hash")  # an int8 model's fp32 parent, which may search it
    embedding_dim: int | None = _key("embedding_dim")
    normalized: bool | None = _key("model_normalized")
    similarity: str | None = _key("similarity")
    output: str | None = _key("model_output")  # the output that made the vectors (None: the model's own)
    output_space: list[str] | None = _key("model_output_space")  # the old models whose space that output reaches


@_keyed
@dataclass(frozen=True)
class TextModelRecord(_Part):
    """The text model recorded for search by text (``text_index.text_model_fields``), or why an upgrade turned it
    off."""

    path: str | None = _key("text_model_path")
    relative: str | None = _key("text_model_path_relative")
    hash: str | None = _key("text_model_hash")
    off: Mapping[str, Any] | None = _key("text_model_off")  # {"from": HASH, "reason": ...}


@_keyed
@dataclass(frozen=True)
class CatalogueRecord(_Part):
    """What the catalogue was built from and what of its columns the index reads (labels, keywords, display)."""

    gallery_root: str | None = _key("gallery_root")
    gallery_relative: str | None = _key("gallery_root_relative")
    label_column: str | None = _key("label_column")
    source: str | None = _key("source")  # "embeddings": built from vectors, no model
    embeddings_dir: str | None = _key("embeddings_dir")
    text_columns: list[str] | None = _key("text_columns")  # the keyword index's columns
    keyword_index: str | None = _key("keyword_index")  # its file, in the index folder
    display_columns: list[str] | None = _key("display_columns")


@_keyed
@dataclass(frozen=True)
class VectorsRecord(_Part):
    """Where the vectors are searched: the faiss part's key, parameters and measures, or the Milvus collection."""

    index_key: str | None = _key("index_key")
    index_key_requested: str | None = _key("index_key_requested")
    params: Mapping[str, Any] | None = _key("params")
    tuning: Mapping[str, Any] | None = _key("tuning")
    budget: Mapping[str, Any] | None = _key("budget")
    count: int | None = _key("count")
    built_on: str | None = _key("built_on")
    updated_by: str | None = _key("updated_by")
    vectors_in: Mapping[str, Any] | None = _key("vectors_in")  # {"milvus": URI, "collection": NAME, "physical": ...}


@_keyed
@dataclass(frozen=True)
class CalibrationRecord(_Part):
    """What was measured on the index for its readers (the text model's "no good match" floor)."""

    text_no_match: Mapping[str, Any] | None = _key("text_no_match")


@_keyed
@dataclass(frozen=True)
class UpgradeRecord(_Part):
    """An upgrade under way, the last one finished, and the models upgraded from."""

    under_way: Mapping[str, Any] | None = _key("upgrade")
    last: Mapping[str, Any] | None = _key("last_upgrade")
    upgraded_from: list[str] | None = _key("upgraded_from")


_PARTS: dict[str, type[_Part]] = {"model": ModelRecord, "text": TextModelRecord, "catalogue": CatalogueRecord,
                                  "vectors": VectorsRecord, "calibrations": CalibrationRecord,
                                  "upgrade": UpgradeRecord}
# index.json key -> (part, field); ``format`` is the record's own
_WHERE: dict[str, tuple[str, str]] = {key: (part, name) for part, cls in _PARTS.items()
                                      for key, name in cls.KEYS.items()}
KNOWN_KEYS = frozenset(_WHERE) | {"format"}


@dataclass(frozen=True, eq=False)
class IndexInfo(KeptJson):
    """index.json, typed: ``format`` (its version) and its parts; ``extra``: the keys this version does not know;
    ``keys_held``: every key the object held, in its order (what ``to_json`` writes back)."""

    format: str | None = None
    model: ModelRecord = ModelRecord()
    text: TextModelRecord = TextModelRecord()
    catalogue: CatalogueRecord = CatalogueRecord()
    vectors: VectorsRecord = VectorsRecord()
    calibrations: CalibrationRecord = CalibrationRecord()
    upgrade: UpgradeRecord = UpgradeRecord()
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    keys_held: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> IndexInfo:
        """The record of index.json's object ``data`` (copied: the record shares nothing with it)."""
        data = copied_object(data, "index.json")
        parts = {name: part.from_json(data) for name, part in _PARTS.items()}
        extra = {key: value for key, value in data.items() if key not in KNOWN_KEYS}
        return cls(format=data.get("format"), extra=extra, keys_held=tuple(data), **parts)

    def value_of(self, key: str) -> Any:
        """What index.json's ``key`` holds (KeyError: the file does not hold it)."""
        if key not in self.keys_held:
            raise KeyError(key)
        if key == "format":
            return self.format
        where = _WHERE.get(key)
        if where is None:
            return self.extra[key]
        return getattr(getattr(self, where[0]), where[1])

    # --- what several readers ask
    @property
    def requested_index_key(self) -> Any:
        """The faiss key the build was asked for (``index_key_requested``, as held), else the key built (an index.json
        from before the request was recorded): what a rebuild asks for again."""
        return self.vectors.index_key_requested if self.holds("index_key_requested") else self.vectors.index_key

    @property
    def has_model(self) -> bool:
        """Whether a model built the vectors (False: built from embeddings, searched with embeddings only)."""
        return self.catalogue.source != EMBEDDINGS_SOURCE


EMBEDDINGS_SOURCE = "embeddings"  # ``catalogue.source`` of an index built from embeddings
