"""The JSON reader of the API and the Gradio guard: a body is measured before it is parsed, and what it parses to
equals json.loads' for every valid UTF-8 text it accepts."""

from __future__ import annotations

import json

import pytest

from retrieval.serve.bodies import parse_json_object
from retrieval.serve.images import QueryError
from retrieval.serve.upload_cache import gradio_body_refusal, upload_parts_refusal

LONG = "z" * 5000  # lifted out of the text before json.loads (over 4 KB, printable ASCII)


@pytest.mark.parametrize("payload", [
    {LONG: 1},  # a long key comes back as itself, not as its placeholder
    {"image": LONG, "where": 'label = "a,[b"'},
    {"a": "x\\" + LONG, "b": 'q"r' + LONG, "c": "é" * 3000, "d": "\n" + LONG},  # escapes, non-ASCII: not lifted
    {"queries": [{"image": LONG}, {"embedding": [1, 2.5, -3e10]}], "k": 5},
])
def test_a_parsed_body_equals_what_json_loads_reads(payload):
    body = json.dumps(payload, ensure_ascii=False).encode()
    assert parse_json_object(body, 1000, 6, "x") == json.loads(body)
    assert parse_json_object(bytearray(body), 1000, 6, "x") == json.loads(body)


def test_spaces_before_deep_brackets_do_not_hide_the_depth():
    body = b'{"data":' + b" " * 40_000 + b"[" * 990 + b"]" * 990 + b"}"
    with pytest.raises(QueryError, match="nested too deeply"):
        parse_json_object(body, 4096, 16, "x")
    assert gradio_body_refusal(body) is not None


def test_a_body_that_is_not_utf8_is_named_not_misread():
    body = json.dumps({"k": "\u2241" * 3000}).encode("utf-16")
    with pytest.raises(QueryError, match="must be UTF-8"):
        parse_json_object(body, 100, 6, "x")


def test_an_upload_boundary_parameter_is_found_in_any_case():
    body = b"--AbC\r\n" + b'Content-Disposition: form-data; name="files"; filename="a.png"\r\n\r\nx\r\n--AbC--\r\n'
    for header in (b"multipart/form-data; boundary=AbC", b"multipart/form-data; Boundary=AbC"):
        assert upload_parts_refusal({"headers": [(b"content-type", header)]}, body) is None
    many = b"".join(b"--AbC\r\n\r\nx\r\n" for _ in range(5)) + b"--AbC--\r\n"
    assert upload_parts_refusal({"headers": [(b"content-type", b"multipart/form-data; BOUNDARY=AbC")]},
                                many).status_code == 400
