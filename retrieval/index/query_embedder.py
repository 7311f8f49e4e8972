"""What the index needs from a model: the ``ImageEmbedder`` protocol, loading an ONNX file, normalisation, and which
model (and which of its outputs) may embed into an index's space.

Similarity is the inner product of L2-normalised vectors (cosine). A model that does not normalise its
output (``normalized`` False) is normalised here, before indexing and before searching, so that stored
and query vectors always live on the unit sphere.

A model trained ``--compatible-with`` an old model of another embedding size has a second output, its embedding
projected into the old space (``OnnxEmbedder.compatible_output``): that is the output it searches, serves and
upgrades an index of the old model with. index.json records which output built its vectors (``model_output``) and,
for a compatible output, whose space they are in (``model_output_space``: the old models' hashes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

# index.json's ``source`` of an index built from embeddings: the record's, imported from here too
from retrieval.records.index_info import EMBEDDINGS_SOURCE as EMBEDDINGS_SOURCE
from retrieval.records.index_info import IndexInfo
from retrieval.utils.unit_rows import l2_normalize_rows

if TYPE_CHECKING:
    from retrieval.data.preprocessing import ModelPreprocessing


@runtime_checkable
class ImageEmbedder(Protocol):
    """The interface of ``retrieval.onnx_runtime.OnnxEmbedder`` that indexing and search use."""

    @property
    def embedding_dim(self) -> int: ...

    @property
    def model_hash(self) -> str: ...

    @property
    def normalized(self) -> bool: ...

    @property
    def preprocessing(self) -> ModelPreprocessing: ...

    def embed(self, images: Any) -> np.ndarray: ...


class ModelMismatchError(ValueError):
    """A query model differs from the model that built the index."""


def model_hashes(embedder: ImageEmbedder) -> tuple[str, ...]:
    """Every hash a record may name ``embedder``'s model by: its ``model_hash`` and, for an ONNX file, the hash
    earlier versions recorded for the same file (``OnnxEmbedder.model_hashes``)."""
    return tuple(getattr(embedder, "model_hashes", None) or (embedder.model_hash,))


def hash_matches(recorded: str | None, embedder: ImageEmbedder) -> bool:
    """Whether a recorded model hash (an index's, a collection's, a declaration's) names ``embedder``'s model: every
    comparison of a record with a model goes through here."""
    return recorded is not None and recorded in model_hashes(embedder)


def legacy_hash(embedder: ImageEmbedder) -> str | None:
    """The hash versions before the current one recorded for ``embedder``'s model (None: it has no other)."""
    return next(iter(model_hashes(embedder)[1:]), None)


class NoModelError(ValueError):
    """The index was built from embeddings: it has no model, so nothing that needs one (embedding an image) works."""


def built_without_model(index_dir: str | Path) -> str:
    """The start of every refusal of an index built from embeddings, naming it."""
    return f"the index in {index_dir} was built from embeddings and has no model"


class NoModel:
    """The query embedder of an index built from embeddings: it knows the dimension, and refuses every use that
    needs a model (embedding, the preprocessing settings) with a ``NoModelError`` that says what works instead."""

    normalized = True
    model_hash = None  # no model: index.json's model_hash is null too

    def __init__(self, dim: int, index_dir: str | Path) -> None:
        self.embedding_dim, self.index_dir = int(dim), index_dir

    def refusal(self) -> NoModelError:
        """The error every model-needing use raises."""
        return NoModelError(f"{built_without_model(self.index_dir)}: it cannot embed a query image; search it with "
                            f"embeddings of its own space ({self.embedding_dim} numbers each: Index.search, or POST "
                            "/search with an \"embedding\")")

    @property
    def preprocessing(self) -> ModelPreprocessing:
        """No preprocessing exists without a model: refused."""
        raise self.refusal()

    def embed(self, images: Any) -> np.ndarray:
        """Refused: there is no model to embed with."""
        raise self.refusal()


def load_model(
    path: str | Path, providers: str = "auto", spin: bool = False, intra_op_threads: int | None = None
) -> ImageEmbedder:
    """Open an exported ONNX embedder (``retrieval export``).

    Indexing is a throughput job whose decoding workers need the CPU between batches, so onnxruntime's idle
    threads sleep rather than spin by default.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file {path} not found; give the path of an exported .onnx model (`retrieval "
                                "export` writes one)")
    try:
        from retrieval.onnx_runtime import OnnxEmbedder
    except ModuleNotFoundError as exc:  # the ONNX runtime wrapper is its own part of the toolkit
        raise RuntimeError(f"cannot load ONNX models: {exc}; is retrieval.onnx_runtime installed?") from exc
    return OnnxEmbedder(str(path), providers=providers, spin=spin, intra_op_threads=intra_op_threads)


def prepare_vectors(vectors: np.ndarray, dim: int) -> np.ndarray:
    """Check the dimension and normalise (cheap, and a no-op for a model that already normalises)."""
    vectors = np.asarray(vectors, dtype=np.float32)
    if vectors.ndim == 1:
        vectors = vectors[None, :]
    if vectors.ndim != 2 or vectors.shape[1] != dim:
        raise ValueError(f"expected embeddings of shape [n, {dim}], got {tuple(vectors.shape)}")
    return l2_normalize_rows(vectors)


COMPATIBLE_WITH = "compatible_with"  # ONNX metadata: JSON list of the model hashes a model was trained to match
# ONNX metadata and index.json: the model_hash of the fp32 model an int8 model was quantized from
PARENT_MODEL_KEY = "fp32_model_hash"
# index.json: the hash versions before the current model hash recorded for the index's model, which declarations
# written by those versions name it by
LEGACY_MODEL_KEY = "legacy_model_hash"


def declared_compatible(embedder: ImageEmbedder) -> frozenset[str]:
    """The model hashes ``embedder``'s metadata declares it compatible with (trained ``compatible-with`` them:
    its embeddings may be compared with theirs); empty for a model that declares none."""
    return compatible_hashes(getattr(embedder, "metadata", None) or {})


def compatible_hashes(metadata: Mapping[str, str]) -> frozenset[str]:
    """The model hashes a model's ONNX ``metadata`` declares it compatible with; empty if none or unreadable."""
    raw = metadata.get(COMPATIBLE_WITH)
    try:
        hashes = json.loads(raw) if raw else []
    except ValueError:
        return frozenset()
    return frozenset(h for h in hashes if isinstance(h, str) and h) if isinstance(hashes, list) else frozenset()


OUTPUT_FIELDS = ("model_output", "model_output_space")  # index.json: the output that built the vectors, its space


def with_output(embedder: ImageEmbedder, output: str | None) -> ImageEmbedder:
    """``embedder`` embedding with its graph output ``output`` (None: the model's own embedding); an embedder
    without named outputs has only its own."""
    choose = getattr(embedder, "with_output", None)
    if choose is not None:
        return choose(output)
    if output is not None and output != getattr(embedder, "output_name", output):
        raise ModelMismatchError(f"the model {embedder.model_hash} has no output {output!r}")
    return embedder


def output_fields(embedder: ImageEmbedder) -> dict[str, Any]:
    """index.json's record of the output ``embedder`` embeds with: its name (None for an embedder without named
    outputs) and, for a compatible output, the old models whose space it embeds into."""
    name = getattr(embedder, "output_name", None)
    compatible = name is not None and name == getattr(embedder, "compatible_output", None)
    return {"model_output": name, "model_output_space": sorted(declared_compatible(embedder)) if compatible else None}


def same_output(embedder: ImageEmbedder, info: IndexInfo) -> bool:
    """Whether ``embedder`` embeds with the output that built the index (an index.json from before outputs were
    recorded: the model's own)."""
    recorded = info.model.output or getattr(embedder, "primary_output", None)
    return getattr(embedder, "output_name", None) == recorded


def is_compatible(embedder: ImageEmbedder, info: IndexInfo) -> bool:
    """Whether ``embedder`` may search (and be added to) an index whose index.json is ``info``: the same model,
    or one declared compatible with its model (by the ONNX file's hash or its PyTorch weights' hash), or the fp32
    parent of the int8 model that built it. Vectors a
    model's compatible output made are in the old models' space: there a model must be declared compatible with
    those (``model_output_space``), not with the model that projected into it."""
    model = info.model
    if hash_matches(model.hash, embedder) or hash_matches(model.parent_hash, embedder):
        return True  # the same model, or the fp32 parent of the int8 model that built it (measured when quantized)
    space = model.output_space
    built_by = set(space) if space else {model.hash, model.legacy_hash, model.source_hash} - {None}
    return bool(declared_compatible(embedder) & built_by)


def compatible_view(embedder: ImageEmbedder, info: IndexInfo) -> ImageEmbedder | None:
    """``embedder`` as it embeds into the space of the index whose index.json is ``info``: the index's own model
    with the output that built it; a model declared compatible with its own output where the sizes agree, else
    with its compatible output where that has the index's size (a new size projected into the old space). None:
    it has no way into that space."""
    model = with_output(embedder, None)
    if hash_matches(info.model.hash, model):
        return with_output(model, info.model.output)
    if not is_compatible(model, info):
        return None
    dim = int(info.model.embedding_dim)  # type: ignore[arg-type]  # every finished index records it
    if int(model.embedding_dim) == dim:
        return model
    compatible = getattr(model, "compatible_output", None)
    if compatible is not None and int(getattr(model, "compatible_dim", 0) or 0) == dim:
        return with_output(model, compatible)
    return None


def check_model_match(info: IndexInfo, embedder: ImageEmbedder, index_dir: Path) -> None:
    """Refuse a query model other than the one that built the index, unless it is declared compatible with it."""
    model = info.model
    if not is_compatible(embedder, info):
        space = model.output_space
        through = (f" (its vectors are that model's projection into the space of model(s) {', '.join(space)}, so a "
                   "model must be declared compatible with those)" if space else "")
        raise ModelMismatchError(
            f"the index in {index_dir} was built by model {model.path or '?'} (model_hash "
            f"{model.hash}){through}, but the query model has model_hash {embedder.model_hash} and is not "
            "declared compatible with it; embeddings of different models are not comparable. Search with the same "
            "model, or upgrade the index to this one (retrieval index upgrade), which re-embeds the gallery while "
            "it keeps answering"
        )


def index_embedder(info: IndexInfo, embedder: ImageEmbedder, index_dir: Path) -> ImageEmbedder:
    """The embedder that embeds queries for the index whose index.json is ``info`` (``compatible_view``), or a
    ModelMismatchError that says why there is none and what to run."""
    if not info.has_model:  # vectors from elsewhere: no model is known to embed into their space
        if isinstance(embedder, NoModel):
            return embedder
        raise NoModelError(f"{built_without_model(index_dir)}: its vectors came from another program, and no model "
                           "is known to embed into their space, so it cannot be searched with a model's query "
                           "embeddings; search it with embeddings of its own space (Index.search), or build an index "
                           "of the images with this model (retrieval index build)")
    view = compatible_view(embedder, info)
    if view is not None:
        return view
    check_model_match(info, embedder, index_dir)  # not declared compatible: refused as such
    model = with_output(embedder, None)
    compatible = getattr(model, "compatible_output", None)
    sizes = f"{model.embedding_dim}" + (f" (and {model.compatible_dim} through its compatible output "
                                        f"{compatible})" if compatible else "")
    raise ModelMismatchError(
        f"the query model {model.model_hash} is declared compatible with the model that built the index in "
        f"{index_dir}, but it embeds in {sizes} dimensions and the index's vectors have {info.model.embedding_dim}; "
        "re-embed the gallery in the new size (retrieval index upgrade, a swap: the index keeps answering with its "
        "model until the new vectors are all in)"
    )
