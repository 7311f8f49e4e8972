"""A text model is checked when it is loaded (so also when `retrieval index text` records it): a graph that is no text
tower, a tokenizer that is no tokenizer or whose ids run past the graph's token table, a length the graph cannot
take are refused naming the problem; a tokenizer file is read only when it is a bounded regular JSON file; queries
that leave the tokenizer no word are refused; a long batch runs in session calls of bounded texts x tokens^2 and
gives its memory back. Real ONNX files (tests/hostile_text_models.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from embedders import write_projection_onnx
from hostile_text_models import (
    BEYOND_TABLE,
    image_graph_as_text,
    short_position_tower,
    vocabulary_beyond_graph,
    with_metadata,
)
from text_towers import small_text_model

from retrieval.text.text_onnx import MAX_ATTENTION_CELLS, TextEmbedder, TextModelError
from retrieval.text.tokens import TextTokenizer, TokenizerError, WordlessText

pytestmark = pytest.mark.timeout(300)
HASH = "0123456789abcdef"


@pytest.fixture(scope="module")
def tower(tmp_path_factory) -> Path:
    return small_text_model(tmp_path_factory.mktemp("tower") / "text.onnx", HASH, 16)


@pytest.fixture(scope="module")
def long_tower(tmp_path_factory) -> Path:
    return small_text_model(tmp_path_factory.mktemp("long") / "text.onnx", HASH, 16, max_length=512)


def refusal(path: Path) -> str:
    with pytest.raises(TextModelError) as refused:
        TextEmbedder(path)
    return str(refused.value)


def test_a_tokenizer_whose_ids_run_past_the_token_table_is_refused_when_loaded(tower, tmp_path):
    message = refusal(vocabulary_beyond_graph(tower, tmp_path / "text.onnx"))
    assert "largest token id (40522)" in message and "so queries would fail" in message


def test_an_image_graph_with_text_metadata_is_refused_naming_its_inputs(tower, tmp_path):
    image_model = write_projection_onnx(tmp_path / "image.onnx")
    message = refusal(image_graph_as_text(image_model, tower, tmp_path / "text.onnx"))
    assert "is not a text tower" in message and "input_ids and attention_mask" in message


def test_a_length_the_graph_cannot_take_is_refused(tmp_path):
    short = short_position_tower(tmp_path / "short.onnx", HASH, 16, positions=32)
    assert TextEmbedder(short).record.max_length == 32  # as exported: taken
    message = refusal(with_metadata(short, tmp_path / "relabelled.onnx", max_length="512"))
    assert "longest token sequence (512 tokens)" in message and "so queries would fail" in message


@pytest.mark.parametrize("tokenizer", ["not json", "{}", "[1, 2]"])
def test_a_tokenizer_that_is_no_tokenizer_is_refused_naming_why(tower, tmp_path, tokenizer):
    message = refusal(with_metadata(tower, tmp_path / "text.onnx", tokenizer=tokenizer))
    assert "its tokenizer is not a tokenizer.json" in message


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fifo", "folder", "proc", "not json", "not utf-8"])
def test_a_tokenizer_file_is_read_only_when_it_is_a_regular_json_file(tmp_path, kind):
    path = tmp_path / "tokenizer.json"
    if kind == "fifo":
        os.mkfifo(path)  # a blocking open would wait for a writer forever
    elif kind == "folder":
        path.mkdir()
    elif kind == "proc":
        path.symlink_to(f"/proc/{os.getpid()}/fd/0")
    else:
        path.write_bytes(b"\xff\xfe{}" if kind == "not utf-8" else b"vocab: [a, b]")
    with pytest.raises(TokenizerError) as refused:
        TextTokenizer.from_file(str(path), 32)
    assert str(path) in str(refused.value)


@pytest.mark.parametrize("text", ["\u200b", "\x00", "\x01\x1f", "\u00ad", "\u0301\u0302", "\ufffd", "\u200b \u00ad",
                                  "\U0001f34e"])
def test_a_query_with_no_word_to_search_by_is_refused(tower, text):
    embedder = TextEmbedder(tower)
    with pytest.raises(WordlessText) as refused:
        embedder.query_tokens(["a red apple", text])
    assert refused.value.position == 1 and "has no word to search by" in str(refused.value)
    assert len(embedder.query_tokens(["a red apple", f"{text} apple"])) == 2  # a word beside them: searched


def test_a_word_beyond_the_table_never_reaches_a_query(tower, tmp_path):
    with pytest.raises(TextModelError):
        TextEmbedder(vocabulary_beyond_graph(tower, tmp_path / "text.onnx"))
    assert TextEmbedder(tower).embed([BEYOND_TABLE]).shape == (1, 16)  # the sound tower embeds it as pieces


class Recording:
    """A session that records the shape of each call."""

    def __init__(self, session) -> None:
        self.session, self.shapes = session, []

    def run(self, outputs, feeds, *options):
        self.shapes.append(feeds["input_ids"].shape)
        return self.session.run(outputs, feeds, *options)


def test_a_long_batch_runs_in_session_calls_of_bounded_texts_times_tokens_squared(long_tower):
    embedder = TextEmbedder(long_tower)
    texts = [" ".join("abcdefghij"[(i + j) % 10] for j in range(60 * (i % 9) + 1)) for i in range(40)]
    one_by_one = np.stack([embedder.embed([text])[0] for text in texts])
    embedder.session = Recording(embedder.session)
    together = embedder.embed(texts)
    assert all(rows * tokens**2 <= MAX_ATTENTION_CELLS for rows, tokens in embedder.session.shapes)
    assert sum(rows for rows, _ in embedder.session.shapes) == len(texts)
    assert len(embedder.session.shapes) < len(texts)  # short texts still share a call
    np.testing.assert_allclose(together, one_by_one, atol=1e-5)


RSS_CHILD = """
import sys, threading
from retrieval.text.text_onnx import TextEmbedder
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
embedder = TextEmbedder(sys.argv[1])
texts = [" ".join("abcdefghijklmnopqrstuvwxyz"[(i + j) % 26] for j in range(500)) for i in range(16)]
embedder.embed(texts[:1])
before, peak, done = rss(), [0], threading.Event()
def sample():
    while not done.wait(0.002):
        peak[0] = max(peak[0], rss())
sampler = threading.Thread(target=sample)
sampler.start()
embedder.embed(texts)
done.set()
sampler.join()
print(peak[0] - before, rss() - before)
"""


def test_a_long_batch_holds_bounded_memory_and_gives_it_back(long_tower):
    # 16 texts of 512 tokens in one call hold 16 x 4 heads x 512^2 floats (64 MB) per attention: 128 MB more at the
    # peak, all of it kept by the session's arena after; in calls of 4, 40-60 MB
    done = subprocess.run([sys.executable, "-c", RSS_CHILD, str(long_tower)], capture_output=True, text=True,
                          timeout=120, check=True)
    peak, kept = (int(v) for v in done.stdout.split())
    assert peak < 90, f"the batch took {peak} MB more at its peak"
    assert kept < 90, f"{kept} MB stayed held after the batch"
