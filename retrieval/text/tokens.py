"""``TextTokenizer``: captions and queries as token ids and attention masks (NumPy int64), with the encoder's own
WordPiece vocabulary (a ``tokenizer.json`` read by the ``tokenizers`` wheel; no torch, no download).

Text is hostile input: a query is cut to ``MAX_TEXT_CHARS`` characters before it is tokenized, and to the tower's
``max_length`` tokens after, so a request's cost is bounded before any work. A query that leaves the tokenizer no
word (only characters it drops, or only ones its vocabulary lacks) is refused (``WordlessText``): every such query
would embed alike and answer one fixed list.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Sequence
from typing import Any

import numpy as np

from retrieval.errors import ParameterError

MAX_TEXT_CHARS = 1000  # a caption or query; longer text is refused (the API) or cut (captions)
MAX_TOKENIZER_BYTES = 16 << 20  # a tokenizer.json (MiniLM's: 466 KB)


class WordlessText(ValueError):
    """A query with no word the tokenizer reads: its tokens are [CLS], [SEP] and [UNK] alone (``position``: which
    of the texts asked about)."""

    def __init__(self, message: str, position: int = 0) -> None:
        super().__init__(message)
        self.position = position


class TokenizerError(ValueError):
    """A tokenizer that cannot be read, or that fails on a text."""


def tokenizer_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is a tokenizer's own failure: an Exception, or the Rust library's panic (a BaseException)."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"


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
        try:
            self._tokenizer = Tokenizer.from_str(json)
            self._tokenizer.enable_truncation(max_length=self.max_length)
            pad = self._tokenizer.token_to_id("[PAD]")
            self._tokenizer.enable_padding(pad_id=0 if pad is None else pad, pad_token="[PAD]")
            unknown = getattr(self._tokenizer.model, "unk_token", None)
            self._unknown = self._tokenizer.token_to_id(unknown) if isinstance(unknown, str) else None
            self.largest_id = max(self._tokenizer.get_vocab(with_added_tokens=True).values(), default=0)
        except BaseException as exc:
            if not tokenizer_failed(exc):
                raise
            raise TokenizerError(f"its tokenizer is not a tokenizer.json the `tokenizers` library reads: "
                                 f"{first_line(exc)}") from None

    @classmethod
    def from_file(cls, path: str, max_length: int) -> TextTokenizer:
        """The tokenizer of a ``tokenizer.json`` file: a regular file of at most ``MAX_TOKENIZER_BYTES``, UTF-8 JSON
        (opened without blocking: a FIFO or a device is refused, never read); else ``TokenizerError`` naming why."""
        try:
            handle = os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb")
        except OSError as exc:
            raise TokenizerError(f"{path} cannot be opened ({exc.strerror or exc}): `encoder` must hold the "
                                 "sentence encoder's tokenizer.json") from None
        with handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise TokenizerError(f"{path} is not a regular file: `encoder` must hold the sentence encoder's "
                                     "tokenizer.json")
            data = handle.read(MAX_TOKENIZER_BYTES + 1)
        if len(data) > MAX_TOKENIZER_BYTES:
            raise TokenizerError(f"{path} is over {MAX_TOKENIZER_BYTES} bytes: no tokenizer.json is this large; "
                                 "`encoder` must hold the sentence encoder's tokenizer.json")
        try:
            text = data.decode("utf-8")
            if not isinstance(json.loads(text), dict):
                raise ValueError("it holds no JSON object")
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError included
            raise TokenizerError(f"{path} is not a tokenizer.json (UTF-8 JSON: {first_line(exc)}): `encoder` must "
                                 "hold the sentence encoder's tokenizer.json") from None
        return cls(text, max_length)

    def encode(self, texts: Sequence[str]) -> list[Any]:
        """The ``tokenizers`` encodings of ``texts`` (each cut to ``MAX_TEXT_CHARS`` characters, then to
        ``max_length`` tokens, padded to the longest); ``TokenizerError`` if the tokenizer fails."""
        try:
            return self._tokenizer.encode_batch([str(text)[:MAX_TEXT_CHARS] for text in texts])
        except BaseException as exc:
            if not tokenizer_failed(exc):
                raise
            raise TokenizerError(f"its tokenizer fails on this text: {first_line(exc)}") from None

    def __call__(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and attention masks, int64 [n, L] (L: the longest text's tokens, at most ``max_length``)."""
        if not texts:
            return np.zeros((0, 2), np.int64), np.zeros((0, 2), np.int64)
        encoded = self.encode(texts)
        ids = np.asarray([e.ids for e in encoded], dtype=np.int64)
        mask = np.asarray([e.attention_mask for e in encoded], dtype=np.int64)
        return ids, mask

    def query_tokens(self, texts: Sequence[str]) -> list[int]:
        """Each query's tokens ([CLS] and [SEP] included, after the cut to ``max_length``): what embedding it costs.
        ``WordlessText`` for a query with no word the tokenizer reads."""
        counts = []
        for position, encoding in enumerate(self.encode(texts)):
            words = [i for i, special in zip(encoding.ids, encoding.special_tokens_mask, strict=True)
                     if not special]
            if not words or all(i == self._unknown for i in words):
                what = ("none of its characters is in the text model's vocabulary (emoji, symbols or a script it "
                        "was not trained on)" if words else
                        "it holds only characters the text model reads as nothing (control characters, zero-width "
                        "or soft-hyphen marks, lone accents, U+FFFD)")
                raise WordlessText(f"text {texts[position][:40]!r} has no word to search by: {what}; describe what "
                                   "you are looking for in words, e.g. \"a red apple\"", position)
            counts.append(int(sum(encoding.attention_mask)))
        return counts


def first_line(exc: BaseException) -> str:
    """An exception's first line, bounded: what a message quotes of a library's error."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


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
