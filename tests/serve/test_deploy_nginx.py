"""deploy/nginx.conf in front of the real search server (build_app + uvicorn with `retrieval serve`'s connection
limit): slow-header and slow-upload clients are held by nginx, not uvicorn; over-size bodies and bursts are refused
by nginx; the app page, the API and a Gradio event work through the proxy. Runs a real nginx on loopback ports."""

from __future__ import annotations

import base64
import importlib.util
import re
import select
import selectors
import socket
import statistics
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from serve_fixtures import QUERY_PNG, BackgroundServer, free_port

from retrieval.serve.bodies import FORM_SLACK
from retrieval.serve.defaults import DEFAULT_MAX_UPLOAD_BYTES
from retrieval.serve.server import ServerConfig, build_app, connection_limit

# deploy/ is not an installed package: load the launcher from the checkout, as `python -m deploy.nginx_local` does
_spec = importlib.util.spec_from_file_location(
    "nginx_local", Path(__file__).resolve().parents[2] / "deploy" / "nginx_local.py"
)
nginx_local = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nginx_local)
INSTALL_HINT, SITE_CONF, nginx_command, write_config = (
    nginx_local.INSTALL_HINT, nginx_local.SITE_CONF, nginx_local.nginx_command, nginx_local.write_config
)

NGINX = nginx_local.find_nginx()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(NGINX is None, reason=f"{INSTALL_HINT}; this test runs a real nginx"),
]

SITE = SITE_CONF.read_text()
HEADER_TIMEOUT_S = int(re.search(r"^\s*client_header_timeout (\d+)s;", SITE, re.MULTILINE)[1])
MAX_BODY = int(re.search(r"^\s*client_max_body_size (\d+)m;", SITE, re.MULTILINE)[1]) * 2**20
ATTACKERS = 200
LINE_EVERY_S = 2.0
# Each party has its own loopback address, so nginx's per-address limits never mix the normal client with
# the attackers (all of 127.0.0.0/8 is loopback on Linux).
ATTACK_IP, CLIENT_IP, BURST_IP = "127.0.0.1", "127.0.0.2", "127.0.0.3"


# --- the servers -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def app_server(artifacts):
    """What `retrieval serve` runs: the API and the Gradio app, uvicorn capped at the same connection count."""
    config = ServerConfig(index_dir=artifacts.index_dir, report=artifacts.report)
    app, service = build_app(config)
    try:
        with BackgroundServer(app, limit_concurrency=connection_limit(config)) as server:
            yield server
    finally:
        service.close()


def wait_for_port(port: int, process: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not start on port {port}: {log.read_text()}") from None
            time.sleep(0.05)


@pytest.fixture(scope="module")
def nginx(app_server, tmp_path_factory):
    """nginx with deploy/nginx.conf rendered by deploy/nginx_local.py (own prefix, loopback port), in front of it."""
    prefix = tmp_path_factory.mktemp("nginx")
    port = free_port()
    conf = write_config(prefix, f"127.0.0.1:{port}", f"{app_server.host}:{app_server.port}")
    command = nginx_command(NGINX, prefix, conf)
    subprocess.run([*command, "-t", "-q"], check=True)
    process = subprocess.Popen([*command, "-g", "daemon off;"])
    try:
        wait_for_port(port, process, prefix / "logs" / "error.log")
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()  # SIGTERM: fast shutdown of the master and its worker
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# --- clients ---------------------------------------------------------------------------------------------
class SlowHeaderClients:
    """``count`` connections from ATTACK_IP that each send one more request-header line every ``every_s``
    seconds and never end the header. A connection the server closes is replaced at once, as an attacker
    would; ``lifetimes`` records how long each closed one lasted."""

    def __init__(self, port: int, count: int = ATTACKERS, every_s: float = LINE_EVERY_S) -> None:
        self.port, self.count, self.every_s = port, count, every_s
        self.lifetimes: list[float] = []
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="slow-headers", daemon=True)
        self.selector = selectors.DefaultSelector()

    def _connect(self, first_line_in: float) -> None:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=5, source_address=(ATTACK_IP, 0))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        sock.setblocking(False)
        now = time.monotonic()
        self.selector.register(sock, selectors.EVENT_READ, [now, now + first_line_in])  # opened, next line

    def _closed(self, key: selectors.SelectorKey) -> None:
        """The server answered or hung up (either way the connection is over): replace it."""
        self.selector.unregister(key.fileobj)
        key.fileobj.close()
        self.lifetimes.append(time.monotonic() - key.data[0])
        if not self.stop.is_set():
            self._connect(self.every_s)

    def _run(self) -> None:
        for i in range(self.count):  # lines spread evenly over the interval
            self._connect(self.every_s * i / self.count)
        self.ready.set()
        line = 0
        try:
            while not self.stop.is_set():
                for key, _ in self.selector.select(timeout=0.05):
                    self._closed(key)
                now = time.monotonic()
                for key in list(self.selector.get_map().values()):
                    if now < key.data[1]:
                        continue
                    try:
                        key.fileobj.send(b"X-Slow-%d: x\r\n" % line)
                    except BlockingIOError:
                        pass
                    except OSError:
                        self._closed(key)
                        continue
                    line += 1
                    key.data[1] = now + self.every_s
        finally:
            for key in list(self.selector.get_map().values()):
                self.selector.unregister(key.fileobj)
                key.fileobj.close()
            self.selector.close()

    def __enter__(self) -> SlowHeaderClients:
        self.thread.start()
        assert self.ready.wait(30), "could not open the slow connections"
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


@dataclass
class Outcome:
    path: str
    status: int | None  # None: no answer within the client's timeout, or the connection failed
    seconds: float


def normal_client(base_url: str, png: bytes, duration_s: float, pause_s: float = 0.25) -> list[Outcome]:
    """GET /health and POST /search (a small PNG), each on a new connection from CLIENT_IP, for ``duration_s``."""
    transport = httpx.HTTPTransport(local_address=CLIENT_IP, limits=httpx.Limits(max_keepalive_connections=0))
    outcomes = []
    with httpx.Client(base_url=base_url, transport=transport, timeout=5.0) as client:
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            for method, path, files in (("GET", "/health", None), ("POST", "/search?k=3", {"image": ("q.png", png)})):
                start = time.perf_counter()
                try:
                    status = client.request(method, path, files=files).status_code
                except httpx.HTTPError:
                    status = None
                outcomes.append(Outcome(path.split("?")[0], status, time.perf_counter() - start))
            time.sleep(pause_s)
    return outcomes


class UvicornLoad:
    """Samples the app server's open connections and running requests (uvicorn's own counters)."""

    def __init__(self, server: BackgroundServer) -> None:
        self.state = server.server.server_state
        self.connections = self.requests = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="uvicorn-load", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            self.connections = max(self.connections, len(self.state.connections))
            self.requests = max(self.requests, len(self.state.tasks))

    def __enter__(self) -> UvicornLoad:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def summary(name: str, outcomes: list[Outcome]) -> str:
    ok = sorted(o.seconds * 1000 for o in outcomes if o.status == 200)
    latency = (
        f"ok latency median {statistics.median(ok):.0f} ms, p95 {ok[int(0.95 * (len(ok) - 1))]:.0f} ms, "
        f"max {ok[-1]:.0f} ms" if ok else "no request succeeded"
    )
    failed = [o.seconds * 1000 for o in outcomes if o.status != 200]
    failures = f"; failed answered in median {statistics.median(failed):.0f} ms" if failed else ""
    statuses = dict(Counter(o.status for o in outcomes))
    return f"{name}: {len(outcomes)} requests, statuses {statuses}, {latency}{failures}"


def raw_exchange(port: int, request: bytes, source: str) -> tuple[bytes, float]:
    """Send ``request`` as is; nginx's error page (up to ``</html>``) and the seconds it took to come."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0)) as sock:
        sock.sendall(request)
        reply = b""
        try:  # not until the close: nginx lingers a few seconds to drain a refused body
            while b"</html>" not in reply and (chunk := sock.recv(65536)):
                reply += chunk
        except ConnectionResetError:  # a reset after the answer ends it too
            pass
    return reply, time.monotonic() - start


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# --- tests -----------------------------------------------------------------------------------------------
def test_plain_config_passes_nginx_t_inside_an_http_block(tmp_path):
    """deploy/nginx.conf as it is copied to /etc/nginx/conf.d/: valid inside a bare http {} block."""
    temp = "".join(f"{kind}_temp_path {tmp_path / kind}; " for kind in ("client_body", "proxy", "fastcgi", "uwsgi",
                                                                           "scgi"))
    main = tmp_path / "nginx.conf"
    main.write_text(
        f"pid {tmp_path / 'nginx.pid'}; error_log {tmp_path / 'error.log'};\nevents {{}}\n"
        f"http {{ access_log off; {temp}\ninclude {SITE_CONF}; }}\n"
    )
    checked = subprocess.run([NGINX, "-t", "-p", str(tmp_path), "-e", str(tmp_path / "error.log"), "-c", str(main)],
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def test_page_api_and_gradio_event_through_nginx(nginx, artifacts):
    from gradio_client import Client, handle_file

    page = httpx.get(nginx + "/", timeout=30)
    assert page.status_code == 200 and "gradio" in page.text.lower()
    info = httpx.get(nginx + "/gradio_api/info", timeout=30)
    assert info.status_code == 200 and "/search" in info.json()["named_endpoints"]
    found = httpx.post(nginx + "/search?k=3", files={"image": ("q.png", artifacts.query_paths[0].read_bytes())},
                       timeout=30)
    assert found.status_code == 200 and found.json()["count"] == 3
    # a Gradio event: upload, queue/join, the server-sent event stream, then the result images fetched by URL
    # (built from X-Forwarded-Host: a lost port would send the client to port 80)
    client = Client(nginx + "/", verbose=False)
    gallery, timing, _query = client.predict(handle_file(str(artifacts.query_paths[2])), 4, [], "",
                                             api_name="/search")
    assert len(gallery) == 4 and all(item["image"] for item in gallery)
    assert f"label **{artifacts.labels[2]}**" in timing


def test_browser_requests_from_the_page_pass_and_other_origins_are_refused_through_nginx(nginx, artifacts):
    """The app compares Origin with Host: nginx must pass the Host the browser wrote, port included."""
    files = {"image": ("q.png", artifacts.query_paths[0].read_bytes())}
    own = httpx.post(nginx + "/search?k=3", files=files, headers={"Origin": nginx}, timeout=60)
    assert own.status_code == 200, own.text
    other = httpx.post(nginx + "/search?k=3", files=files, headers={"Origin": "http://evil.example"}, timeout=60)
    assert other.status_code == 403


def test_nginx_takes_every_body_the_app_takes_and_refuses_larger_ones_itself(nginx):
    # the largest body `retrieval serve` accepts (serve/api.py body_limit) passes nginx and reaches the app
    app_limit = DEFAULT_MAX_UPLOAD_BYTES * 4 // 3 + FORM_SLACK
    assert app_limit <= MAX_BODY < app_limit + 2**20, "client_max_body_size no longer matches the app's limit"
    body = b'{"image": "' + base64.b64encode(bytes(DEFAULT_MAX_UPLOAD_BYTES)) + b'"}'
    body += b" " * (app_limit - len(body))  # JSON allows trailing spaces: exactly the app's limit
    answer = httpx.post(nginx + "/search", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert answer.status_code == 400 and "not" in answer.json()["detail"], answer.text[:300]  # the app: no image
    # one byte over nginx's cap: 413 from nginx as soon as the header is read, without waiting for the body
    reply, seconds = raw_exchange(
        port_of(nginx),
        b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (MAX_BODY + 1),
        CLIENT_IP,
    )
    assert reply.startswith(b"HTTP/1.1 413 ") and b"<center>nginx</center>" in reply, reply[:300]
    assert b'"detail"' not in reply and seconds < 5  # nginx's page, not the app's JSON


BATCH_MAX_BODY = int(re.search(r"location = /search/batch \{[^}]*client_max_body_size (\d+)m;", SITE)[1]) * 2**20


def test_a_batch_has_its_own_body_cap_and_rate_in_nginx(nginx):
    """POST /search/batch: every body the app takes passes (its batch limit), a larger one is nginx's 413; a
    burst of batches from one address reaches the app 1 + 2 times, the rest are nginx's 429."""
    from retrieval.serve.service.checks import batch_upload_bytes

    app_limit = batch_upload_bytes(DEFAULT_MAX_UPLOAD_BYTES) * 4 // 3 + FORM_SLACK
    assert app_limit <= BATCH_MAX_BODY < app_limit + 2**20, "the batch cap no longer matches the app's limit"
    reply, seconds = raw_exchange(
        port_of(nginx),
        b"POST /search/batch HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (BATCH_MAX_BODY + 1),
        CLIENT_IP,
    )
    assert reply.startswith(b"HTTP/1.1 413 ") and b"<center>nginx</center>" in reply and seconds < 5, reply[:200]
    statuses = Counter()
    for _ in range(8):
        answer = httpx.post(nginx + "/search/batch", json={"queries": []}, timeout=30)
        statuses[answer.status_code] += 1
    assert statuses[429] >= 4 and set(statuses) <= {422, 429} and statuses[422] <= 3, statuses  # 422: the app's


def test_a_burst_from_one_address_is_cut_to_429_by_nginx(nginx):
    """100 searches at once from one address: at most 32 in flight (limit_conn) and 1 + 40 in a burst
    (limit_req) reach the app; nginx answers the rest with 429."""
    request = (b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
    statuses = burst(port_of(nginx), request, BURST_IP, 100)  # a 429 is nginx's page: it never reached the app
    # 422: the app's own answer to the request's empty JSON object (it reached the app)
    assert set(statuses) <= {422, 429} and statuses[429] >= 50 and statuses[422] >= 20, statuses


def burst(port: int, request: bytes, source: str, count: int) -> Counter:
    """``count`` copies of ``request`` sent at once from ``source``: how many got each status. A 429 must be nginx's
    page (it never reached the app)."""
    socks = [socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
             for _ in range(count)]
    for sock in socks:
        sock.sendall(request)
    statuses = Counter()
    for sock in socks:
        with sock:
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
            status = int(reply.split(b" ", 2)[1])
            statuses[status] += 1
            if status == 429:
                assert b"<center>nginx</center>" in reply, reply[:300]
    return statuses


RATE_PER_S, BURST = (int(value) for value in re.search(
    r"zone=retrieval_search:\S+ rate=(\d+)r/s;[\s\S]*?location = /search \{\s*limit_req zone=retrieval_search "
    r"burst=(\d+) nodelay;", SITE).groups())
# Gradio's REST routes for the app's events: each call is a search, like POST /search and queue/join. One source
# address per route, so that neither shares nginx's per-address state with another test.
GRADIO_REST_CALLS = [("/gradio_api/call/search", "127.0.0.4"), ("/gradio_api/call/v2/search", "127.0.0.5"),
                     ("/gradio_api/run/search", "127.0.0.6"), ("/gradio_api/api/search/", "127.0.0.7")]


@pytest.mark.parametrize(("path", "source"), GRADIO_REST_CALLS, ids=[path for path, _ in GRADIO_REST_CALLS])
def test_gradio_rest_calls_of_an_event_are_rate_limited_like_searches(nginx, path, source):
    """100 calls of the app's event from one address through Gradio's REST routes, 25 at a time (under the 32 in
    flight of limit_conn, so that only the rate limit can refuse them): 1 + 40 (the searches' burst) and what the
    rate refills meanwhile reach the app, nginx answers the rest with 429. Before, all 100 reached the app."""
    body = b'{"data": []}'  # the app refuses it cheaply (no image): what is measured is what gets through nginx
    request = (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (path.encode(), len(body), body))
    statuses, started = Counter(), time.monotonic()
    for _ in range(4):
        statuses += burst(port_of(nginx), request, source, 25)
    refilled = RATE_PER_S * (time.monotonic() - started) + 1
    print(f"\n{path}: {dict(statuses)}, {refilled - 1:.0f} requests refilled during the calls")
    reached = sum(count for status, count in statuses.items() if status != 429)
    assert 1 <= reached <= 1 + BURST + refilled, (statuses, refilled)  # the route itself still works through nginx
    assert statuses[429] >= 100 - 1 - BURST - refilled, (statuses, refilled)


def test_the_result_stream_of_a_gradio_call_is_not_rate_limited(nginx):
    """GET /gradio_api/call/NAME/EVENT_ID (the results of a call, a server-sent event stream) is not a search:
    a burst of them is never cut by the searches' rate."""
    request = (b"GET /gradio_api/call/search/no-such-event HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Connection: close\r\n\r\n")
    statuses = Counter()
    for _ in range(3):  # 3 x 25: over the searches' burst of 40, under the 32 in flight of limit_conn
        statuses += burst(port_of(nginx), request, "127.0.0.8", 25)
    assert 429 not in statuses, statuses


def test_slow_uploads_wait_in_nginx_not_in_uvicorn(nginx, app_server, artifacts):
    """40 uploads that trickle in: uvicorn runs none of them (nginx reads bodies first); beyond 32 per address
    nginx answers 429; a normal client is served meanwhile."""
    header = (b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100000\r\n\r\n{")
    socks = [socket.create_connection(("127.0.0.1", port_of(nginx)), timeout=10, source_address=(ATTACK_IP, 0))
             for _ in range(40)]
    with UvicornLoad(app_server) as load:
        for sock in socks:
            sock.sendall(header)
        for _ in range(3):  # a few bytes a second, well inside client_body_timeout
            time.sleep(0.7)
            for sock in socks:
                try:
                    sock.sendall(b" " * 10)
                except OSError:  # refused (429) and closed by nginx
                    pass
        outcomes = normal_client(nginx, QUERY_PNG, 1.0)
    answered, _, _ = select.select(socks, [], [], 1.0)  # the uploads still in progress have no answer
    refused = 0
    for sock in answered:
        try:
            refused += sock.recv(64).startswith(b"HTTP/1.1 429 ")
        except OSError:
            pass
    for sock in socks:
        sock.close()
    print(f"\nslow uploads: uvicorn ran at most {load.requests} requests, held {load.connections} connections; "
          f"{refused} of 40 uploads refused with 429")
    assert load.requests <= 3  # only the normal client's; 40 without request buffering
    assert refused >= 40 - 32  # limit_conn: 32 per address (more if another connection of 127.0.0.1 lingers)
    assert all(o.status == 200 for o in outcomes), outcomes


def test_slow_header_clients_starve_uvicorn_but_not_nginx(nginx, app_server, artifacts):
    """200 connections that send one header line every 2 s: through nginx every normal request is served;
    straight at uvicorn (capped like `retrieval serve`) the normal client gets 503s."""
    png = artifacts.query_paths[0].read_bytes()
    baseline = normal_client(nginx, png, 2.0)
    phase_s = HEADER_TIMEOUT_S + 4  # long enough to see nginx time the first wave out
    with UvicornLoad(app_server) as load, SlowHeaderClients(port_of(nginx)) as attack:
        time.sleep(0.5)
        behind_nginx = normal_client(nginx, png, phase_s)
    print(f"\n{summary('no attack, through nginx', baseline)}"
          f"\n{summary('200 slow clients, through nginx', behind_nginx)}"
          f"\n  uvicorn held at most {load.connections} connections; nginx closed {len(attack.lifetimes)} slow "
          f"connections after {min(attack.lifetimes, default=0):.1f}-{max(attack.lifetimes, default=0):.1f} s")

    with UvicornLoad(app_server) as direct_load, SlowHeaderClients(app_server.port) as direct_attack:
        time.sleep(0.5)
        direct = normal_client(app_server.url, png, 4.0)
    print(f"{summary('200 slow clients, straight at uvicorn', direct)}\n  uvicorn held at most "
          f"{direct_load.connections} connections (limit {app_server.server.config.limit_concurrency}); it closed "
          f"{len(direct_attack.lifetimes)} slow connections")

    assert all(o.status == 200 for o in baseline + behind_nginx), summary("through nginx", behind_nginx)
    assert load.connections < 40  # nginx's keep-alive pool and the normal client, never the slow ones
    first_wave = [t for t in attack.lifetimes if t > HEADER_TIMEOUT_S - 1]
    assert len(first_wave) >= 0.9 * ATTACKERS  # client_header_timeout closed them, about on time
    assert max(attack.lifetimes) < HEADER_TIMEOUT_S + 3
    assert direct_load.connections >= ATTACKERS  # the slow clients did reach uvicorn...
    starved = sum(o.status in (503, None) for o in direct)
    assert starved > len(direct) / 2, summary("direct", direct)  # ...and starved it
