"""Hostile text models: real text.onnx files (``text_towers.small_text_model``) altered as an attacker or a broken
export would alter them: a tokenizer whose ids run past the graph's token table, a tokenizer that is not JSON, a
length relabelled beyond the graph's position table, an image graph carrying a text tower's metadata."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import torch

BEYOND_TABLE = "zzqqxxjj"  # a word the altered tokenizer maps to an id past the graph's table


def with_metadata(source: Path, target: Path, **changes: str) -> Path:
    """``source`` written to ``target`` with its metadata_props ``changes`` made (the graph as it is)."""
    proto = onnx.load(str(source))
    props = {p.key: p.value for p in proto.metadata_props} | changes
    del proto.metadata_props[:]
    onnx.helper.set_model_props(proto, props)
    onnx.save_model(proto, str(target))
    return target


def tokenizer_of(model: Path) -> dict:
    """The tokenizer.json a text.onnx carries, as a dict."""
    return json.loads({p.key: p.value for p in onnx.load(str(model)).metadata_props}["tokenizer"])


def vocabulary_beyond_graph(source: Path, target: Path, table: int = 30522) -> Path:
    """``source`` whose tokenizer maps ``BEYOND_TABLE`` to an id past the graph's ``table`` rows."""
    tokenizer = tokenizer_of(source)
    tokenizer["model"]["vocab"][BEYOND_TABLE] = table + 10_000
    return with_metadata(source, target, tokenizer=json.dumps(tokenizer))


def image_graph_as_text(image_model: Path, text_model: Path, target: Path) -> Path:
    """An image model's graph carrying ``text_model``'s metadata (a text tower's format, tokenizer and record)."""
    proto = onnx.load(str(image_model))
    del proto.metadata_props[:]
    onnx.helper.set_model_props(proto, {p.key: p.value for p in onnx.load(str(text_model)).metadata_props})
    onnx.save_model(proto, str(target))
    return target


def short_position_tower(path: Path, image_model_hash: str, dim: int, positions: int = 32) -> Path:
    """A text tower whose graph holds ``positions`` position embeddings, recorded as ``positions`` tokens long
    (relabel its ``max_length`` with ``with_metadata`` to claim more)."""
    from text_towers import minilm_folder

    from retrieval.export.text_export import export_text_tower
    from retrieval.text.encoder import EncoderConfig, SentenceEncoder
    from retrieval.text.tokens import TextTokenizer
    from retrieval.text.tower import TextTower

    torch.manual_seed(0)
    config = EncoderConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=positions, type_vocab_size=2,
                           layer_norm_eps=1e-12)
    tokenizer = TextTokenizer.from_file(str(minilm_folder() / "tokenizer.json"), positions)
    export_text_tower(TextTower(SentenceEncoder(config), dim), tokenizer, path, image_model_hash,
                      {"name": "short-position-bert"}, ["a red apple", "a dog"])
    return path
