"""Who may reach the server, request by request: a bearer token for the API, same-origin only, and only under a
host name it answers to (DNS rebinding); the checks made once at start-up are in ``exposure``.

Pure ASGI middleware on the parent app, so that they also stand in front of the mounted Gradio app.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.requests import cookie_parser
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from retrieval.serve.defaults import API_TOKEN_ENV
from retrieval.serve.exposure import is_loopback

DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
CROSS_SITE = ("cross-site", "same-site")  # Sec-Fetch-Site values of a request another site's page made


def _reply(status: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


class BearerToken:
    """ASGI middleware: requests to the paths ``protected`` says need ``Authorization: Bearer <token>`` (else 401)."""

    def __init__(self, app: ASGIApp, token: str, protected: Callable[[str], bool]) -> None:
        self.app, self.token, self.protected = app, token.encode(), protected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.protected(scope["path"]):
            scheme, _, given = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.token):
                detail = ("missing or wrong API token: send the header `Authorization: Bearer <token>` with the "
                          f"token the server was started with (--token-file or {API_TOKEN_ENV})")
                await _reply(401, detail, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _origin_parts(scheme: str, netloc: str) -> tuple[str, int | None] | None:
    try:
        parts = urlsplit(f"{scheme}://{netloc}")
        return (parts.hostname or "").lower(), parts.port or DEFAULT_PORTS.get(scheme)
    except ValueError:
        return None


def same_origin(origin: str, host: str | None) -> bool:
    """Whether the ``Origin`` header names the host (and port) the request was sent to (its ``Host`` header)."""
    if not host:
        return False
    parts = urlsplit(origin) if "://" in origin else None
    if parts is None or not parts.netloc:
        return False
    mine = _origin_parts(parts.scheme, parts.netloc)
    return mine is not None and mine == _origin_parts(parts.scheme, host)


class SameOriginOnly:
    """ASGI middleware: a request whose ``Origin`` is neither this server nor an allowed origin gets 403.

    CORS headers only stop a browser from reading a cross-origin answer; a form POST (multipart, a "simple"
    request) still runs without a preflight. Requests without an Origin (curl, scripts) pass. Behind a proxy,
    the proxy must pass the browser's Host header on (nginx: ``proxy_set_header Host $http_host``).
    """

    def __init__(self, app: ASGIApp, allowed: Sequence[str] = (), events_prefix: str | None = None) -> None:
        self.app, self.allowed = app, {origin.rstrip("/").lower() for origin in allowed}
        self.events_prefix = events_prefix

    def cross_site_event(self, scope: Scope, headers: Headers) -> bool:
        """A call of the app's events (``events_prefix``) made by another site's page, seen by the browser's
        ``Sec-Fetch-Site`` although it sent no Origin (a GET of an event's stream, say)."""
        return (self.events_prefix is not None and scope["path"].startswith(self.events_prefix)
                and headers.get("sec-fetch-site", "").lower() in CROSS_SITE)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            headers = Headers(scope=scope)
            origin = headers.get("origin")
            foreign = origin is not None and origin.lower().rstrip("/") not in self.allowed
            if (foreign and not same_origin(origin, headers.get("host"))) or (
                origin is None and self.cross_site_event(scope, headers)
            ):
                origin = origin or f"a page of another site (Sec-Fetch-Site: {headers.get('sec-fetch-site')})"
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                detail = (f"cross-origin request from {origin!r} refused: this server only answers pages of its own "
                          "origin; start it with --cors-origin ORIGIN to allow another site")
                await _reply(403, detail)(scope, receive, send)
                return
        await self.app(scope, receive, send)


HOST_HEADER = re.compile(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?")  # name or [IPv6], then a port


def host_name(host_header: str) -> str | None:
    """The host name of a ``Host`` header (``name:port``, ``[::1]:port``), lower case; None when malformed."""
    match = HOST_HEADER.fullmatch(host_header)
    if match is None:
        return None
    return match[1].strip("[]").lower().rstrip(".") or None


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def host_allowed(name: str | None, bind_host: str, allowed_names: Sequence[str] = ()) -> bool:
    """Whether a request's ``Host`` names this server: a configured name, ``localhost``, or an IP address
    (a loopback one when bound to loopback). A web page can only make a browser send a name its own DNS
    answers for (DNS rebinding), never an IP literal or ``localhost``, so every other name is refused."""
    if not name:
        return False
    if name == "localhost" or name in {n.lower().rstrip(".") for n in allowed_names}:
        return True
    address = _ip(name)
    return address is not None and (address.is_loopback or not is_loopback(bind_host))


class AllowedHosts:
    """ASGI middleware: a request whose ``Host`` header is not one ``host_allowed`` accepts gets 400.

    Without it, a page on any site whose name the attacker points at 127.0.0.1 would be same-origin with this
    server in the visitor's browser (DNS rebinding) and could drive the unauthenticated loopback server.
    """

    def __init__(self, app: ASGIApp, bind_host: str, allowed_names: Sequence[str] = ()) -> None:
        self.app, self.bind_host, self.allowed_names = app, bind_host, tuple(allowed_names)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            values = [value for name, value in scope["headers"] if name.lower() == b"host"]
            name = host_name(values[0].decode("latin-1")) if len(values) == 1 else None
            if not host_allowed(name, self.bind_host, self.allowed_names):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                shown = values[0].decode("latin-1")[:80] if len(values) == 1 else f"{len(values)} Host headers"
                detail = (f"this server does not answer to the host {shown!r}: it answers to localhost, IP "
                          "addresses and the names given with --allowed-host NAME (add the name the clients use)")
                await _reply(400, detail)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class LoginRequired:
    """ASGI middleware: requests ``protected(method, path)`` selects need ``logged_in(scope)``, else 401.

    For the Gradio app's own routes that its login does not cover (``cancel`` and ``reset`` take no login).
    """

    def __init__(self, app: ASGIApp, logged_in: Callable[[Scope], bool], protected: Callable[[str, str], bool]) -> None:
        self.app, self.logged_in, self.protected = app, logged_in, protected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.protected(scope["method"], scope["path"]) and not self.logged_in(scope):
            await _reply(401, "log in to the app first (its login page is at /)")(scope, receive, send)
            return
        await self.app(scope, receive, send)


def request_cookies(scope: Scope) -> dict[str, str]:
    """The request's cookies (Starlette's parser)."""
    return cookie_parser(Headers(scope=scope).get("cookie", ""))


SAFE_PAGE_HEADERS = (
    # an image or link on the page that points at another site is fetched without telling it our page's address
    (b"referrer-policy", b"same-origin"),
    # a response is only ever read as the type it declares (an uploaded "image" is never run as a script or page)
    (b"x-content-type-options", b"nosniff"),
)


class SafePageHeaders:
    """ASGI middleware: every HTTP response carries ``Referrer-Policy: same-origin`` and
    ``X-Content-Type-Options: nosniff`` (a value the app set itself is replaced, never sent twice)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name for name, _ in SAFE_PAGE_HEADERS}
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                message = {**message, "headers": [*headers, *SAFE_PAGE_HEADERS]}
            await send(message)

        await self.app(scope, receive, send_with_headers)
