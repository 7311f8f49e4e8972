"""schemathesis runs of the API (the contract test and the text queries' one): the hook that makes a positive case
valid data, and the run whose failures a test asserts are none."""

from __future__ import annotations

import base64
from typing import Any


def valid_case(case: Any, image: bytes) -> Any:
    """What a schema cannot say of valid data, made so in a positive ``case``: an ``image`` is an image file (a real
    PNG, as schemathesis itself does for typed file uploads; each of POST /search/batch's files and JSON queries
    too), a ``where`` an expression of the filter language (a grammar, not a pattern), a ``text`` holds a word the
    text model reads (random characters may be only ones its tokenizer drops), and ``k``, ``exclude_self`` and
    ``rerank`` in the query and in the JSON body agree."""
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return case
    if "where" in (case.query or {}):
        case.query["where"] = "id >= 0"
    if not isinstance(case.body, dict):
        return case
    if "where" in case.body:
        case.body["where"] = "id >= 0"
    encoded = base64.b64encode(image).decode()
    if "image" in case.body:
        one = image if case.media_type.startswith("multipart/") else encoded
        given = case.body["image"]  # POST /search/batch's multipart field is a list of files
        case.body["image"] = [one] * len(given) if isinstance(given, list) else one
    for query in [case.body, *(case.body.get("queries", []) if isinstance(case.body.get("queries"), list) else [])]:
        if isinstance(query, dict) and isinstance(query.get("text"), str):
            query["text"] = f"apple {query['text']}"[:1000]
    for query in case.body.get("queries", []) if isinstance(case.body.get("queries"), list) else []:
        if isinstance(query, dict) and "image" in query:  # POST /search/batch's JSON queries
            query["image"] = encoded
    for name in ("k", "exclude_self"):  # given in the JSON body and the query: they must agree
        if case.media_type == "application/json" and name in case.body and name in (case.query or {}):
            case.query[name] = case.body[name]
    if case.media_type == "application/json" and "rerank" in case.body and "rerank" in (case.query or {}):
        del case.query["rerank"]  # the body's (a name or an object of parameters) then counts alone
    return case


def run_checks(schema: Any) -> tuple[list[str], int, Any]:
    """Run every phase of ``schema``; (each failed check or engine error, as text; the cases run; the engine's
    finished event, None when it never finished)."""
    from schemathesis.engine import events, from_schema

    failures, cases, finished = [], 0, None
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            cases += len(event.recorder.cases)
            for case_id, checks in event.recorder.checks.items():
                for check in checks:
                    if check.failure_info is not None:
                        response = event.recorder.find_response(case_id=case_id)
                        failures.append(
                            f"{event.recorder.label}: {check.name} ({check.failure_info.failure.title}) -> "
                            f"{response.status_code if response else '?'} "
                            f"{(response.content or b'')[:200] if response else ''}\n"
                            f"{check.failure_info.code_sample[:500]}"
                        )
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            failures.append(f"engine error: {event!r}"[:800])
        elif isinstance(event, events.EngineFinished):
            finished = event
    return failures, cases, finished
