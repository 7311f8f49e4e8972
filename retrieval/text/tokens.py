"""``TextTokenizer``: captions and queries as token ids and attention masks (NumPy int64), with the encoder's own
WordPiece vocabulary (a ``tokenizer.json`` read by the ``tokenizers`` wheel; no torch, no download).

Text is hostile input: a query is cut to ``MAX_TEXT_CHARS`` characters before it is tokenized, and to the tower's
``max_length`` tokens after, so a request's cost is bounded before any work.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from retrieval.errors import ParameterError

MAX_TEXT_CHARS = 1000  # a caption or query; longer text is refused (the API) or cut (captions)
MAX_TOKENIZER_BYTES = 16 << 20  # a tokenizer.json (MiniLM's: 466 KB)


class TextTokenizer:
    """The WordPiece tokenizer of ``tokenizer.json`` text (``json``), padding a batch to its longest text and
    truncating each to ``max_length`` tokens ([CLS] and [SEP] included)."""

    def __init__(self, json: str, max_length: int) -> None:
        from tokenizers import Tokenizer

        if len(json) > MAX_TOKENIZER_BYTES:
            raise ParameterError("text_model", f"its tokenizer is {len(json)} bytes; at most {MAX_TOKENIZER_BYTES}")
        if not 2 <= int(max_length) <= 512:
            raise ParameterError("max_tokens", f"must be 2 to 512 tokens, got {max_length}")
        self.json, self.max_length = json, int(max_length)
        self._tokenizer = Tokenizer.from_str(json)
        self._tokenizer.enable_truncation(max_length=self.max_length)
        pad = self._tokenizer.token_to_id("[PAD]")
        self._tokenizer.enable_padding(pad_id=0 if pad is None else pad, pad_token="[PAD]")

    @classmethod
    def from_file(cls, path: str, max_length: int) -> TextTokenizer:
        """The tokenizer of a ``tokenizer.json`` file."""
        with open(path, encoding="utf-8") as handle:
            return cls(handle.read(MAX_TOKENIZER_BYTES + 1), max_length)

    def __call__(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and attention masks, int64 [n, L] (L: the longest text's tokens, at most ``max_length``)."""
        if not texts:
            return np.zeros((0, 2), np.int64), np.zeros((0, 2), np.int64)
        encoded = self._tokenizer.encode_batch([str(text)[:MAX_TEXT_CHARS] for text in texts])
        ids = np.asarray([e.ids for e in encoded], dtype=np.int64)
        mask = np.asarray([e.attention_mask for e in encoded], dtype=np.int64)
        return ids, mask


def check_query_text(text: object) -> str:
    """A text query: a non-empty string of at most ``MAX_TEXT_CHARS`` characters, or ValueError naming why."""
    if not isinstance(text, str):
        kind = {bool: "true or false", int: "a number", float: "a number", list: "a list", dict: "an object",
                type(None): "null"}.get(type(text), type(text).__name__)
        raise ValueError(f"text must be a string (words, in quotes), got {kind}")
    stripped = text.strip()
    if not stripped:
        raise ValueError("text is empty: type what you are looking for, e.g. \"a red apple\"")
    if len(text) > MAX_TEXT_CHARS:
        raise ValueError(f"text is {len(text)} characters; at most {MAX_TEXT_CHARS}")
    if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        raise ValueError("text holds a lone surrogate (half of a UTF-16 pair), which is not text")
    return stripped
