"""A trained text tower (``retrieval.text.tower.TextTower``) -> ``text.onnx``: the graph (token ids and attention
mask in, L2-normalised embeddings out; batch and length dynamic), its tokenizer and record in the metadata
(``retrieval.text.text_onnx.TEXT_METADATA``), verified against PyTorch on real captions."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from retrieval.text import text_onnx
from retrieval.text.sibling_text import IMAGE_TEXT_MODEL, IMAGE_TEXT_MODEL_HASH, TEXT_ORIGIN, TRAINED
from retrieval.text.text_onnx import ATTENTION_MASK, INPUT_IDS, TEXT_OUTPUT, TextEmbedder, TextTowerRecord
from retrieval.text.tokens import TextTokenizer
from retrieval.text.tower import TextTower

MIN_COSINE = 0.9999  # each caption's ONNX embedding against PyTorch's


class TextExportError(RuntimeError):
    """The exported tower does not embed as the PyTorch one does."""


def text_record(tower: TextTower, tokenizer: TextTokenizer, image_model_hash: str,
                encoder: Mapping[str, Any]) -> TextTowerRecord:
    """The record a text.onnx carries in its metadata."""
    return TextTowerRecord(tower.dim, tokenizer.max_length, str(image_model_hash), tokenizer.json, dict(encoder))


def export_text_tower(tower: TextTower, tokenizer: TextTokenizer, path: str | Path, image_model_hash: str,
                      encoder: Mapping[str, Any], captions: Sequence[str], opset: int = 17,
                      origin: str = TRAINED, extra: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Write ``tower`` as ONNX to ``path`` and check it against PyTorch on ``captions`` (cosine >= ``MIN_COSINE``
    each); returns the check's figures. The file is written beside and renamed once verified. Its metadata: the
    record, ``text_origin`` (``origin``: trained on captions, zero-shot, adapted) and ``extra``."""
    path = Path(path)
    tower = tower.eval().float().cpu()
    ids, mask = tokenizer(list(captions[:8]) or ["an example"])
    example = (torch.from_numpy(ids), torch.from_numpy(mask))
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        raw = Path(scratch) / "graph.onnx"
        torch.onnx.export(tower, example, str(raw), dynamo=False, opset_version=opset, do_constant_folding=True,
                          input_names=[INPUT_IDS, ATTENTION_MASK], output_names=[TEXT_OUTPUT],
                          dynamic_axes={INPUT_IDS: {0: "batch", 1: "tokens"}, ATTENTION_MASK: {0: "batch", 1: "tokens"},
                                        TEXT_OUTPUT: {0: "batch"}})
        proto = onnx.load(str(raw))
        del proto.metadata_props[:]
        metadata = {TEXT_ORIGIN: origin, **(extra or {})}
        onnx.helper.set_model_props(proto, metadata | text_record(tower, tokenizer, image_model_hash,
                                                                  encoder).to_metadata())
        written = Path(scratch) / path.name
        onnx.save_model(proto, str(written))
        # the class read from its module when called: a name bound at import would keep whatever stood there then
        check = verify_text_tower(tower, text_onnx.TextEmbedder(written, providers=["CPUExecutionProvider"]),
                                  captions)
        written.replace(path)
    return check


def verify_text_tower(tower: TextTower, exported: TextEmbedder, captions: Sequence[str]) -> dict[str, Any]:
    """The cosine of each caption's ONNX embedding with PyTorch's; TextExportError under ``MIN_COSINE``."""
    texts = list(captions) or ["an example"]
    with torch.no_grad():
        ids, mask = exported.tokenizer(texts)
        reference = tower(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    cosine = (exported.embed(texts) * reference).sum(1)
    worst = int(np.argmin(cosine))
    if cosine[worst] < MIN_COSINE:
        raise TextExportError(f"the ONNX text tower's embedding of {texts[worst]!r} has cosine {cosine[worst]:.6f} "
                              f"with PyTorch's (at least {MIN_COSINE} expected)")
    return {"captions": len(texts), "min_cosine": float(cosine.min()), "mean_cosine": float(cosine.mean())}


def link_text_model(image_model: str | Path, text_model: str | Path) -> dict[str, str]:
    """Name ``text_model`` (a file beside ``image_model``) and its hash in the image model's metadata, so that an
    index of the model finds it (``retrieval.text.sibling_text``); annotations: the model's hash stays. Returns the
    image model's metadata as written."""
    from retrieval.export.onnx_export import rewrite_metadata
    from retrieval.text.sibling_text import read_model_metadata

    image_model, text_model = Path(image_model), Path(text_model)
    if text_model.parent.resolve() != image_model.parent.resolve():
        raise ValueError(f"the text model {text_model} must be beside the image model {image_model}")
    metadata = read_model_metadata(image_model) | {IMAGE_TEXT_MODEL: text_model.name,
                                                   IMAGE_TEXT_MODEL_HASH: text_onnx.file_hash(text_model)}
    rewrite_metadata(image_model, metadata)
    return metadata
