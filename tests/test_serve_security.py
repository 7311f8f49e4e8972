"""Issue 12: the served app reads only uploaded files, refuses /dev/zero, prunes its cache, needs credentials off
loopback, and refuses cross-origin browser requests. Real servers over HTTP on a loopback port."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from gradio import processing_utils
from gradio.context import LocalContext
from gradio.exceptions import InvalidPathError
from serve_fixtures import png_bytes, shared_artifacts

from cli.serve import serve_command
from serve.security import ExposureError
from serve.server import BackgroundServer, ServerConfig, build_app
from serve.upload_cache import prune_folder

pytestmark = pytest.mark.timeout(300)

TOKEN = "t0ken-for-the-tests-0123456789"
LOGIN = ("alice", "correct horse battery")
ALLOWED_ORIGIN = "http://app.example"
FOREIGN_ORIGIN = "http://evil.example"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return shared_artifacts(tmp_path_factory)


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
    body = {"data": [{"path": path, "meta": {"_type": "gradio.FileData"}}, 5]}
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
    mounts = plain.server.config.app.routes
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


def test_dev_zero_is_refused_while_health_keeps_answering(plain):
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            start = time.monotonic()
            assert httpx.get(f"{plain.url}/health", timeout=5).status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    time.sleep(0.2)
    start = time.monotonic()
    answer = gradio_call(plain.url, "/dev/zero")
    took = time.monotonic() - start
    time.sleep(0.3)
    stop.set()
    prober.join(timeout=10)
    assert answer == gradio_call(plain.url, "/no/such/file") and took < 2, (answer, took)
    assert len(latencies) >= 3 and max(latencies) < 1.0, latencies
    assert files_named("zero") == []


def test_uploads_through_gradio_still_search_and_stay_in_the_private_folder(artifacts, plain):
    from gradio_client import Client, handle_file

    assert upload_folder() != Path("/tmp/gradio") and upload_folder().stat().st_mode & 0o077 == 0
    gallery, timing = Client(plain.url, verbose=False).predict(
        handle_file(str(artifacts.query_paths[3])), 5, api_name="/search"
    )
    assert len(gallery) == 5 and "results" in timing
    uploaded = httpx.post(f"{plain.url}/gradio_api/upload", files={"files": ("q.png", png_bytes(), "image/png")})
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
        uploaded = httpx.post(f"{server.url}/gradio_api/upload", files={"files": ("q.png", png_bytes(), "image/png")})
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
    upload = httpx.post(f"{secured.url}/gradio_api/upload", files={"files": ("q.png", png_bytes(), "image/png")})
    assert upload.status_code == 401 and files_named("q.png") == []
    assert gradio_call(secured.url, str(upload_folder() / "0" / "q.png")).startswith("401")
    with httpx.Client(base_url=secured.url, timeout=10) as browser:
        assert browser.post("/login", data={"username": LOGIN[0], "password": "wrong"}).status_code == 400
        assert browser.post("/login", data={"username": LOGIN[0], "password": LOGIN[1]}).status_code == 200
        assert browser.get("/config").status_code == 200
    gallery, _ = Client(secured.url, auth=LOGIN, verbose=False).predict(
        handle_file(str(artifacts.query_paths[1])), 3, api_name="/search"
    )
    assert len(gallery) == 3


# --- 5. cross-origin requests -------------------------------------------------------------------------
def test_cross_origin_requests_are_refused_and_same_origin_ones_served(plain):
    files = {"image": ("q.png", png_bytes(), "image/png")}
    refused = httpx.post(f"{plain.url}/search?k=3", files=files, headers={"Origin": FOREIGN_ORIGIN}, timeout=10)
    assert refused.status_code == 403 and "--cors-origin" in refused.json()["detail"]
    assert "access-control-allow-origin" not in refused.headers
    upload = httpx.post(f"{plain.url}/gradio_api/upload", files={"files": ("q.png", png_bytes(), "image/png")},
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
