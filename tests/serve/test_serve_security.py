"""The served app reads only uploaded files, refuses /dev/zero, prunes its cache, needs credentials off
loopback, and refuses cross-origin browser requests. Real servers over HTTP on a loopback port."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from pathlib import Path

import httpx
import pytest
from availability import HealthProbe
from click.testing import CliRunner
from gradio import processing_utils
from gradio.context import LocalContext
from gradio.exceptions import InvalidPathError
from serve_fixtures import QUERY_PNG, BackgroundServer

from retrieval.cli.serve import serve_command
from retrieval.serve.exposure import ExposureError
from retrieval.serve.routes import leaf_routes
from retrieval.serve.server import ServerConfig, build_app
from retrieval.serve.upload_cache import prune_folder

pytestmark = pytest.mark.timeout(300)

TOKEN = "t0ken-for-the-tests-0123456789"
LOGIN = ("alice", "correct horse battery")
ALLOWED_ORIGIN = "http://app.example"
FOREIGN_ORIGIN = "http://evil.example"


def served(artifacts, **settings) -> tuple[BackgroundServer, object]:
    app, service = build_app(ServerConfig(index_dir=artifacts.index_dir, report=artifacts.report, **settings))
    return BackgroundServer(app), service


@pytest.fixture(scope="module")
def plain(artifacts):
    """The default server: loopback, no credentials."""
    server, service = served(artifacts)
    with server:
        yield server
    service.close()


@pytest.fixture(scope="module")
def secured(artifacts):
    """A bearer token for the API, a login for the Gradio app, one allowed foreign origin."""
    server, service = served(artifacts, api_token=TOKEN, ui_auth=[LOGIN], cors_origins=(ALLOWED_ORIGIN,))
    with server:
        yield server
    service.close()


def upload_folder() -> Path:
    return Path(os.environ.get("GRADIO_TEMP_DIR") or "/tmp/gradio")


def files_named(name: str) -> list[Path]:
    return [Path(root) / name for root, _, names in os.walk(upload_folder()) if name in names]


def gradio_call(url: str, path: str, **kwargs) -> str:
    """The whole answer to a search call that names ``path`` as its image: the POST, then the event's stream."""
    body = {"data": [{"path": path, "meta": {"_type": "gradio.FileData"}}, 5, [], "", "none", ""]}
    started = httpx.post(f"{url}/gradio_api/call/search", json=body, timeout=10, **kwargs)
    answer = f"{started.status_code} {started.text}"
    if started.status_code == 200:
        event = started.json()["event_id"]
        answer += httpx.get(f"{url}/gradio_api/call/search/{event}", timeout=10, **kwargs).text
        answer = answer.replace(event, "EVENT")  # a fresh id per call: not a difference between paths
    return answer


# --- 1. only uploaded files -------------------------------------------------------------------------
def test_a_gradio_call_cannot_read_server_files_or_tell_they_exist(plain):
    answers = {path: gradio_call(plain.url, path) for path in ("/etc/hostname", "/no/such/dir/hostname")}
    assert answers["/etc/hostname"] == answers["/no/such/dir/hostname"]  # no existence oracle
    answer = answers["/etc/hostname"]
    assert "400" in answer and "upload" in answer and "/etc" not in answer and str(upload_folder()) not in answer
    assert files_named("hostname") == []  # nothing was copied into the cache
    secret = Path("/etc/hostname").read_bytes()
    for named in {*re.findall(r"/[\w./-]*hostname", answer), *map(str, files_named("hostname")), "/etc/hostname"}:
        served_file = httpx.get(f"{plain.url}/gradio_api/file={named}", timeout=10)
        assert served_file.status_code != 200 or served_file.content != secret, named


@pytest.mark.parametrize("path", ["http://127.0.0.1:9/x.png", "/proc/self/environ", "../../../../etc/hostname",
                                  "UPLOADS/../../../etc/hostname"])
def test_urls_and_escapes_from_the_upload_folder_get_the_same_refusal(plain, path):
    path = path.replace("UPLOADS", str(upload_folder()))
    reference = gradio_call(plain.url, "/no/such/file")
    assert gradio_call(plain.url, path) == reference


def test_gradio_itself_refuses_files_outside_the_upload_folder(plain):
    """Gradio's own check (has_launched) is on for the mounted app: the depth below the HTTP guard."""
    mounts = leaf_routes(plain.server.config.app.routes)
    blocks = next(route.app.get_blocks() for route in mounts if hasattr(route.app, "get_blocks"))
    image = next(b for b in blocks.blocks.values() if getattr(b, "elem_id", None) == "query-image")
    token = LocalContext.blocks.set(blocks)
    try:
        with pytest.raises(InvalidPathError):
            asyncio.run(processing_utils.async_move_files_to_cache(
                {"path": "/etc/hostname", "meta": {"_type": "gradio.FileData"}}, image, check_in_upload_folder=True))
    finally:
        LocalContext.blocks.reset(token)
    assert files_named("hostname") == []


@pytest.mark.alone
def test_dev_zero_is_refused_while_health_keeps_answering(plain):
    with HealthProbe(plain.url) as probe:
        time.sleep(0.2)
        start = time.monotonic()
        answer = gradio_call(plain.url, "/dev/zero")
        took = time.monotonic() - start
        time.sleep(0.3)
    assert answer == gradio_call(plain.url, "/no/such/file") and took < 2, (answer, took)
    assert probe.failures == [] and len(probe.latencies) >= 3 and probe.worst < 1.0, probe.latencies
    assert files_named("zero") == []


def test_uploads_through_gradio_still_search_and_stay_in_the_private_folder(artifacts, plain):
    from gradio_client import Client, handle_file

    assert upload_folder() != Path("/tmp/gradio") and upload_folder().stat().st_mode & 0o077 == 0
    gallery, timing, _query = Client(plain.url, verbose=False).predict(
        handle_file(str(artifacts.query_paths[3])), 5, [], "", api_name="/search"
    )
    assert len(gallery) == 5 and "results" in timing
    uploaded = httpx.post(f"{plain.url}/gradio_api/upload", files={"files": ("q.png", QUERY_PNG, "image/png")})
    assert uploaded.status_code == 200
    path = uploaded.json()[0]
    assert Path(path).is_relative_to(upload_folder())
    assert "results" in gradio_call(plain.url, path)


# --- 3. cache pruning, analytics ----------------------------------------------------------------------
def test_prune_folder_bounds_age_and_size(tmp_path):
    now = time.time()
    files = {}
    for name, age, size in [("old", 100, 10), ("a", 30, 4096), ("b", 20, 4096), ("c", 10, 4096), ("kept", 200, 10)]:
        path = tmp_path / name / f"{name}.png"
        path.parent.mkdir()
        path.write_bytes(b"x" * size)
        os.utime(path, (now - age, now - age))
        files[name] = path
    removed = prune_folder(tmp_path, max_age_s=50, max_bytes=2 * 4096 + 4096, keep=[str(files["kept"])], now=now)
    # ages are the later of mtime and ctime (just now here): only the size bound can delete these files
    assert files["kept"].exists()
    total = sum(max(p.stat().st_size, p.stat().st_blocks * 512) for p in tmp_path.rglob("*") if p.is_file())
    assert total <= 3 * 4096 and removed and files["c"].exists()
    removed = prune_folder(tmp_path, max_age_s=50, max_bytes=2**30, keep=[str(files["kept"])], now=now + 60)
    assert [p.name for p in tmp_path.iterdir()] == ["kept"]  # everything else aged out; empty folders gone


def test_the_server_prunes_uploads_and_keeps_its_examples(artifacts):
    server, service = served(artifacts, upload_max_age_s=1, upload_prune_interval_s=0.2)
    with server:
        config = httpx.get(f"{server.url}/config", timeout=10).json()
        examples = [Path(sample[0]["path"]) for c in config["components"] if c.get("type") == "dataset"
                    for sample in c["props"]["samples"]]
        uploaded = httpx.post(f"{server.url}/gradio_api/upload", files={"files": ("q.png", QUERY_PNG, "image/png")})
        path = Path(uploaded.json()[0])
        assert path.exists()
        deadline = time.monotonic() + 10
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not path.exists() and examples and all(p.exists() for p in examples)
    service.close()


def test_analytics_are_off(plain):
    assert httpx.get(f"{plain.url}/config", timeout=10).json()["analytics_enabled"] is False


# --- 4. credentials off loopback, the token, the login ------------------------------------------------
def test_a_network_host_without_credentials_is_refused(artifacts, tmp_path):
    with pytest.raises(ExposureError, match="--token-file.*--auth-file.*--insecure"):
        build_app(ServerConfig(index_dir=artifacts.index_dir, host="0.0.0.0"))
    result = CliRunner().invoke(serve_command, ["--index", str(tmp_path), "--host", "0.0.0.0"])
    assert result.exit_code != 0 and "--token-file" in result.output and "--insecure" in result.output
    token_file, auth_file = tmp_path / "token", tmp_path / "logins"
    token_file.write_text(TOKEN + "\n")
    auth_file.write_text("# logins\nalice:secret\n")
    for extra in (["--insecure"], ["--token-file", str(token_file), "--auth-file", str(auth_file)],
                  ["--token-file", str(token_file), "--no-ui"]):
        result = CliRunner().invoke(serve_command, ["--index", str(tmp_path), "--host", "0.0.0.0", *extra])
        assert "no search index" in result.output, (extra, result.output)  # past the check, at the missing index
    token_file.write_text("short\n")
    result = CliRunner().invoke(serve_command, ["--index", str(tmp_path), "--token-file", str(token_file)])
    assert result.exit_code != 0 and "at least 16 characters" in result.output


def test_the_api_needs_the_token_and_health_does_not(secured):
    body = {"embedding": [1.0] + [0.0] * 31}
    for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": TOKEN}):
        refused = httpx.post(f"{secured.url}/search?k=3", json=body, headers=headers, timeout=10)
        assert refused.status_code == 401 and "Authorization: Bearer" in refused.json()["detail"]
        assert httpx.get(f"{secured.url}/stats", headers=headers, timeout=10).status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.post(f"{secured.url}/search?k=3", json=body, headers=auth, timeout=10).status_code == 200
    assert httpx.get(f"{secured.url}/health", timeout=10).status_code == 200


def test_the_gradio_app_needs_a_login(artifacts, secured):
    from gradio_client import Client, handle_file

    assert httpx.get(f"{secured.url}/config", timeout=10).status_code == 401
    upload = httpx.post(f"{secured.url}/gradio_api/upload", files={"files": ("q.png", QUERY_PNG, "image/png")})
    assert upload.status_code == 401 and files_named("q.png") == []
    assert gradio_call(secured.url, str(upload_folder() / "0" / "q.png")).startswith("401")
    with httpx.Client(base_url=secured.url, timeout=10) as browser:
        assert browser.post("/login", data={"username": LOGIN[0], "password": "wrong"}).status_code == 400
        assert browser.post("/login", data={"username": LOGIN[0], "password": LOGIN[1]}).status_code == 200
        assert browser.get("/config").status_code == 200
    gallery, _, _ = Client(secured.url, auth=LOGIN, verbose=False).predict(
        handle_file(str(artifacts.query_paths[1])), 3, [], "", api_name="/search"
    )
    assert len(gallery) == 3


# --- 5. cross-origin requests -------------------------------------------------------------------------
def test_cross_origin_requests_are_refused_and_same_origin_ones_served(plain):
    files = {"image": ("q.png", QUERY_PNG, "image/png")}
    refused = httpx.post(f"{plain.url}/search?k=3", files=files, headers={"Origin": FOREIGN_ORIGIN}, timeout=10)
    assert refused.status_code == 403 and "--cors-origin" in refused.json()["detail"]
    assert "access-control-allow-origin" not in refused.headers
    upload = httpx.post(f"{plain.url}/gradio_api/upload", files={"files": ("q.png", QUERY_PNG, "image/png")},
                        headers={"Origin": "null"}, timeout=10)
    assert upload.status_code == 403  # the Gradio routes too (its login cookie is SameSite=None)
    for headers in ({"Origin": plain.url}, {}):  # the page itself; curl and scripts send no Origin
        assert httpx.post(f"{plain.url}/search?k=3", files=files, headers=headers, timeout=10).status_code == 200


def test_an_allowed_origin_gets_cors_headers(secured):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    preflight = httpx.options(f"{secured.url}/search", headers={
        "Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization"}, timeout=10)
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    answer = httpx.post(f"{secured.url}/search?k=3", json={"embedding": [1.0] + [0.0] * 31},
                        headers={"Origin": ALLOWED_ORIGIN, **auth}, timeout=10)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    foreign = httpx.post(f"{secured.url}/search?k=3", json={"embedding": [1.0] + [0.0] * 31},
                         headers={"Origin": FOREIGN_ORIGIN, **auth}, timeout=10)
    assert foreign.status_code == 403


# --- a hostile client: event references, Host names, the token, k, reports, examples, uploads ---------
def call_event(url: str, api_name: str, data: list, headers: dict | None = None, **kwargs) -> str:
    """The whole answer to a Gradio event called with raw ``data`` (any shape), as a hostile client sends it."""
    started = httpx.post(f"{url}/gradio_api/call/{api_name}", content=json.dumps({"data": data}),
                         headers={"Content-Type": "application/json", **(headers or {})}, timeout=10, **kwargs)
    answer = f"{started.status_code} {started.text}"
    if started.status_code == 200:
        event = started.json()["event_id"]
        answer += httpx.get(f"{url}/gradio_api/call/{api_name}/{event}", timeout=10, **kwargs).text
        answer = answer.replace(event, "EVENT")
    return answer


def queue_join(url: str, api_name: str, data: list) -> str:
    """A call through the browser's own route (``queue/join`` by function index), which also reaches the
    private ``example_search`` event; the answer is the event stream of that session."""
    config = httpx.get(f"{url}/config", timeout=10).json()
    fn_index = next(d["id"] for d in config["dependencies"] if d.get("api_name") == api_name)
    session = f"s{time.monotonic_ns()}"
    joined = httpx.post(f"{url}/gradio_api/queue/join", content=json.dumps({  # as a browser escapes any string
        "data": data, "fn_index": fn_index, "session_hash": session, "event_data": None, "trigger_id": None}),
        headers={"Content-Type": "application/json"}, timeout=10)
    if joined.status_code != 200:
        return f"{joined.status_code} {joined.text}"
    with httpx.stream("GET", f"{url}/gradio_api/queue/data", params={"session_hash": session}, timeout=10) as events:
        return "".join(line for line in events.iter_lines() if "process_completed" in line or "error" in line)


REFERENCES = {  # every shape a file reference can take in a Gradio event's data
    "without meta": lambda path: {"path": path},
    "with meta": lambda path: {"path": path, "meta": {"_type": "gradio.FileData"}},
    "plain string": lambda path: path,
    "with url": lambda path: {"path": path, "url": f"http://127.0.0.1/gradio_api/file={path}"},
}


@pytest.mark.parametrize("shape", list(REFERENCES))
def test_no_reference_shape_opens_a_server_file_or_tells_it_exists(plain, artifacts, shape):
    """Only files Gradio recorded as uploaded are ever read, whatever the reference's shape: a reference without
    ``meta`` opened as it is would be an existence oracle and search any image on the host."""
    reference = REFERENCES[shape]
    answers = {path: call_event(plain.url, "search", [reference(path), 3, [], "", "none", ""])
               for path in ("/etc/hostname", "/no/such/file", "/etc/shadow", str(artifacts.query_paths[0]))}
    assert len(set(answers.values())) == 1, answers  # the same answer, existing file, image or not
    answer = answers["/etc/hostname"]
    assert "results" not in answer and "/etc" not in answer
    if shape != "plain string":  # Gradio itself refuses a string where its Image data belongs, before any check
        assert "upload" in answer


def test_the_private_example_event_opens_no_server_file_either(plain, artifacts):
    answers = {path: queue_join(plain.url, "example_search", [{"path": path}, 3])
               for path in ("/no/such/file", str(artifacts.query_paths[0]), "/dev/zero")}
    assert len(set(answers.values())) == 1 and "results" not in answers["/no/such/file"], answers


def test_a_url_or_a_second_content_type_header_does_not_get_past_the_check(plain):
    reference = call_event(plain.url, "search", [{"path": "/no/such/file"}, 3, [], "", "none", ""])
    assert call_event(plain.url, "search", [{"url": "http://127.0.0.1:9/x.png"}, 3, [], "", "none", ""]) == reference
    doubled = httpx.post(f"{plain.url}/gradio_api/call/search",
                         content=json.dumps({"data": ["/etc/hostname", 3, [], "", "none", ""]}),
                         headers=[("Content-Type", "multipart/form-data; boundary=x"),
                                  ("Content-Type", "application/json")], timeout=10)
    assert doubled.status_code == 400 and "one Content-Type" in doubled.text
    form = httpx.post(f"{plain.url}/gradio_api/call/search", files={"data": ("x", b"/etc/hostname")}, timeout=10)
    assert form.status_code == 400 and "JSON" in form.text


def test_fifo_references_leave_no_thread_stuck(plain, tmp_path):
    """Four calls naming a FIFO used to leave four server threads blocked and the app answering heartbeats only."""
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    started = time.monotonic()
    answers = [call_event(plain.url, "search", [{"path": str(fifo)}, 3, [], "", "none", ""]) for _ in range(4)]
    assert time.monotonic() - started < 10 and all("results" not in a for a in answers)
    uploaded = httpx.post(f"{plain.url}/gradio_api/upload", files={"files": ("q.png", QUERY_PNG, "image/png")})
    assert "results" in call_event(plain.url, "search", [{"path": uploaded.json()[0]}, 3, [], "", "none", ""])


def test_an_uploaded_file_still_searches_in_every_shape(plain):
    for shape, reference in REFERENCES.items():
        if shape == "plain string":
            continue  # not an Image value: Gradio refuses it, uploaded or not
        uploaded = httpx.post(f"{plain.url}/gradio_api/upload", files={"files": ("q.png", QUERY_PNG, "image/png")})
        data = [reference(uploaded.json()[0]), 3, [], "", "none", ""]
        assert "results" in call_event(plain.url, "search", data), shape


def test_a_foreign_host_name_is_refused_dns_rebinding(plain):
    """Only the server's own Host names are answered: else a page whose name resolves to 127.0.0.1 drives it."""
    port = plain.port
    evil = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
    for method, path in (("GET", "/stats"), ("GET", "/health"), ("GET", "/"), ("GET", "/config")):
        refused = httpx.request(method, f"{plain.url}{path}", headers=evil, timeout=10)
        assert refused.status_code == 400 and "--allowed-host" in refused.json()["detail"], path
    assert call_event(plain.url, "search", [{"path": "/x"}, 3, [], "", "none", ""], headers=evil).startswith("400")
    assert httpx.get(f"{plain.url}/stats", headers={"Host": f"evil.example:{port}"}, timeout=10).status_code == 400
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"LOCALHOST:{port}"):
        assert httpx.get(f"{plain.url}/stats", headers={"Host": host}, timeout=10).status_code == 200, host


def test_a_configured_host_name_is_answered(artifacts):
    server, service = served(artifacts, allowed_hosts=("search.example",), ui=False)
    with server:
        ok = httpx.get(f"{server.url}/health", headers={"Host": f"search.example:{server.port}"}, timeout=10)
        other = httpx.get(f"{server.url}/health", headers={"Host": f"other.example:{server.port}"}, timeout=10)
    service.close()
    assert ok.status_code == 200 and other.status_code == 400


def test_which_host_names_a_server_answers_to():
    from retrieval.serve.security import host_allowed, host_name

    assert host_name("Example.COM:8080") == "example.com" and host_name("[::1]:7860") == "::1"
    assert host_name("bad host:x") is None
    for name in ("localhost", "127.0.0.1", "127.0.0.9", "::1"):
        assert host_allowed(name, "127.0.0.1")
    assert not host_allowed("10.0.0.5", "127.0.0.1")  # loopback server: loopback addresses only
    assert host_allowed("10.0.0.5", "0.0.0.0") and host_allowed("search.example", "0.0.0.0", ["search.example"])
    for name in ("evil.example", "localhost.evil.example", "127.0.0.1.nip.io", None, ""):
        assert not host_allowed(name, "0.0.0.0") and not host_allowed(name, "127.0.0.1")


def test_a_cross_site_call_of_an_event_stream_is_refused_without_an_origin(plain):
    started = httpx.post(f"{plain.url}/gradio_api/call/index_stats", json={"data": []}, timeout=10)
    stream = f"{plain.url}/gradio_api/call/index_stats/{started.json()['event_id']}"
    refused = httpx.get(stream, headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors"}, timeout=10)
    assert refused.status_code == 403
    assert httpx.get(stream, headers={"Sec-Fetch-Site": "same-origin"}, timeout=10).status_code == 200


def test_the_token_also_covers_the_api_document_and_its_assets(secured):
    """/openapi.json, the docs pages and /docs-assets/* need the token too."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for path in ("/openapi.json", "/docs", "/redoc", "/docs-assets/swagger-ui.css"):
        assert httpx.get(f"{secured.url}{path}", timeout=10).status_code == 401, path
        assert httpx.get(f"{secured.url}{path}", headers=auth, timeout=10).status_code == 200, path


def test_gradio_cancel_and_reset_need_the_login(secured):
    body = {"session_hash": "x", "fn_index": 0, "event_id": "y"}
    for route in ("cancel", "reset"):
        for kwargs in ({"json": body}, {"files": {"f": ("a", b"b")}}):
            answer = httpx.post(f"{secured.url}/gradio_api/{route}", timeout=10, **kwargs)
            assert answer.status_code == 401, (route, kwargs, answer.status_code)
    with httpx.Client(base_url=secured.url, timeout=10) as browser:
        assert browser.post("/login", data={"username": LOGIN[0], "password": LOGIN[1]}).status_code == 200
        assert browser.post("/gradio_api/reset", json={"event_id": "y"}).status_code == 200


@pytest.mark.parametrize("k", [1000, 101, 0, -1, 2.5, "5", None, [3], True, float("nan")])
def test_the_app_refuses_a_k_beyond_its_slider(plain, k):
    uploaded = httpx.post(f"{plain.url}/gradio_api/upload", files={"files": ("q.png", QUERY_PNG, "image/png")})
    data = [{"path": uploaded.json()[0]}, k, [], "", "none", ""]
    body = json.dumps({"data": data}, allow_nan=True)
    started = httpx.post(f"{plain.url}/gradio_api/call/search", content=body,
                         headers={"Content-Type": "application/json"}, timeout=10)
    answer = httpx.get(f"{plain.url}/gradio_api/call/search/{started.json()['event_id']}", timeout=10).text
    # the page's answer to a refused search: no results, and the reason in its status line
    data = json.loads(next(line for line in answer.splitlines() if line.startswith("data: "))[len("data: "):])
    assert data[0] == [] and "K must be a whole number" in data[1], answer


@pytest.mark.parametrize(("labels", "where"), [([], 'path = "\ud800"'), ([], '"\udcff" = label'),
                                               (["\ud83d"], ""), ([], 'label in ("a\udfff")')])
def test_a_lone_surrogate_in_the_filter_gets_an_answer_on_the_page(plain, labels, where):
    """Half of a UTF-16 pair in the where box or the label picker (a browser's JSON carries it as an escape): the
    page answers with its status line, the filter shown with U+FFFD in its place, as the API answers the same
    filter; never a failed event stream."""
    uploaded = httpx.post(f"{plain.url}/gradio_api/upload", files={"files": ("q.png", QUERY_PNG, "image/png")})
    reference = {"path": uploaded.json()[0], "meta": {"_type": "gradio.FileData"}}
    answer = queue_join(plain.url, "search", [reference, 5, labels, where, "none", ""])
    assert "process_completed" in answer and '"success": true' in answer.replace('"success":true', '"success": true')
    shown = json.loads(answer[answer.index("{"):])["output"]["data"][1]
    assert "\ufffd" in shown or "\\udcff" in shown, shown  # replaced, or quoted by the parser's message


def test_a_report_that_is_not_a_run_report_is_refused_at_start(artifacts, tmp_path):
    """A --report that is not a run report (/etc/shadow) stops the start: else / becomes the folder the page may
    open."""
    from retrieval.serve.exposure import ConfigError

    for report in ("/etc/shadow", "/etc/hostname", str(tmp_path / "missing.json"), "/dev/zero"):
        with pytest.raises(ConfigError, match="--report"):
            build_app(ServerConfig(index_dir=artifacts.index_dir, report=Path(report)))
        result = CliRunner().invoke(serve_command, ["--index", str(artifacts.index_dir), "--report", report])
        assert result.exit_code != 0 and "--report" in result.output, (report, result.output)


def test_the_report_box_opens_nothing_beyond_the_run_folder_and_names_no_server_folder(artifacts, service,
                                                                                      tmp_path, monkeypatch):
    from retrieval.serve.ui.evaluation import REPORT_REFUSED, EvaluationTab

    monkeypatch.chdir("/")  # a server started in / must not open the whole disk
    tab = EvaluationTab(service, artifacts.report)
    assert tab.report_folders() == [artifacts.report.resolve().parent]
    sibling = artifacts.report.resolve().parent.parent / "report.json"  # the old rule reached one folder up
    sibling.write_text(artifacts.report.read_text())
    try:
        refused = tab.open_report(str(sibling))[0]
    finally:
        sibling.unlink()
    assert refused == REPORT_REFUSED
    run = artifacts.report.resolve().parent
    fifo, not_a_report = run / "pipe.json", run / "other.json"
    os.mkfifo(fifo)
    not_a_report.write_text("{}")
    try:
        started = time.monotonic()
        answers = {typed: tab.open_report(typed)[0] for typed in (
            str(fifo), str(not_a_report), str(run / "missing.json"), "~/../proc/self/cwd/x.json", "missing.json")}
        assert time.monotonic() - started < 2
    finally:
        fifo.unlink()
        not_a_report.unlink()
    assert set(answers.values()) == {REPORT_REFUSED}  # no existence oracle, no home folder, no server folder
    assert tab.open_report("report.json")[0] != REPORT_REFUSED  # a bare name is looked up in the run folder


def test_the_page_shows_the_report_without_its_server_folder(artifacts, service, tmp_path, monkeypatch):
    """The --report path (absolute, outside the working folder) was shown whole in the text box and summary."""
    from retrieval.serve.ui.evaluation import EvaluationTab

    monkeypatch.chdir(tmp_path)
    tab = EvaluationTab(service, artifacts.report.resolve())
    assert tab.shown_path() == "report.json"
    summary = tab.open_report(tab.shown_path())[0]
    assert "report.json" in summary and str(artifacts.report.resolve().parent) not in summary


def test_a_network_server_says_it_belongs_behind_nginx(artifacts):
    assert "nginx" in ServerConfig(index_dir=artifacts.index_dir, host="0.0.0.0", insecure=True).access_summary()
    assert "nginx" not in ServerConfig(index_dir=artifacts.index_dir).access_summary()


def test_the_results_tab_names_its_file_not_the_server_folders(tmp_path):
    from retrieval.serve.ui.results import ResultsTab

    missing = ResultsTab(tmp_path / "deep" / "results.json").show(None)[0]
    real = ResultsTab(Path(__file__).resolve().parents[2] / "docs" / "results.json")
    table = real.titles()[0][1]
    shown = [missing, real.show(table)[0], real.show("no-such-table")[0]]
    assert "results.json" in shown[1] and "no-such-table" in shown[2]
    for text in shown:
        assert str(tmp_path) not in text and str(Path(__file__).resolve().parents[2]) not in text, text


def test_gradio_serves_no_examples_cache_of_the_working_folder_and_fetches_no_url(artifacts, tmp_path, monkeypatch):
    """Gradio's file route also served .gradio/cached_examples under the working folder (another app's files),
    and it fetches URLs named after it."""
    secret = tmp_path / ".gradio" / "cached_examples" / "sub" / "notes.txt"
    secret.parent.mkdir(parents=True)
    secret.write_text("from another app")
    monkeypatch.chdir(tmp_path)
    server, service = served(artifacts)
    with server:
        for named in (".gradio/cached_examples/sub/notes.txt", str(secret), "http://127.0.0.1:9/x.png"):
            answer = httpx.get(f"{server.url}/gradio_api/file={named}", timeout=10)
            assert answer.status_code != 200 and "from another app" not in answer.text, named
    service.close()


def test_an_upload_is_one_image_of_the_upload_limit(plain):
    """Gradio takes up to 1000 files a request: one request wrote gigabytes before the next prune."""
    files = [("files", (f"q{i}.png", b"x" * 2**20, "image/png")) for i in range(12)]  # 12 MiB > 10 MiB
    answer = httpx.post(f"{plain.url}/gradio_api/upload", files=files, timeout=30)
    assert answer.status_code == 413 and "--max-upload-mb" in answer.text
    assert httpx.post(f"{plain.url}/gradio_api/upload", files={"files": ("q.png", QUERY_PNG, "image/png")},
                      timeout=10).status_code == 200
