"""Who may reach the server, decided at start-up: loopback-only unless authenticated, and the credentials read from
their files. Free of the web stack, so that the command line checks a configuration without loading it; the
request-time middleware is in ``security``."""

from __future__ import annotations

import ipaddress
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from retrieval.serve.defaults import API_TOKEN_ENV, MIN_TOKEN_CHARS


class ConfigError(ValueError):
    """A server setting that cannot be served safely (the message names the fix)."""


class ExposureError(ConfigError):
    """The server would be reachable from the network without authentication."""


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine (``localhost`` or a loopback address)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost, or "" (all interfaces)
        return False


def check_exposure(host: str, api_token: str | None, ui_auth: Sequence[tuple[str, str]] | None, ui: bool,
                   insecure: bool) -> None:
    """Refuse (ExposureError) to bind a non-loopback host unless every part served needs credentials, or --insecure."""
    if insecure or is_loopback(host):
        return
    missing = []
    if not api_token:
        missing.append(f"a bearer token for the API (--token-file FILE, or the {API_TOKEN_ENV} environment variable)")
    if ui and not ui_auth:
        missing.append("user:password logins for the Gradio app (--auth-file FILE), or --no-ui")
    if missing:
        raise ExposureError(f"--host {host} is reachable from the network, so the server needs "
                            f"{' and '.join(missing)}; or pass --insecure to serve it without authentication anyway")


def read_api_token(token_file: str | Path | None, environ: dict[str, str] | None = None) -> str | None:
    """The API token from ``token_file`` (first line) or the environment; None when neither is given."""
    env_token = (os.environ if environ is None else environ).get(API_TOKEN_ENV, "").strip()
    if token_file is not None and env_token:
        raise ConfigError(f"the API token is given twice (--token-file and {API_TOKEN_ENV}): keep one")
    if token_file is not None:
        lines = Path(token_file).read_text().splitlines()
        token, source = (lines[0].strip() if lines else ""), f"--token-file {token_file}"
    elif env_token:
        token, source = env_token, API_TOKEN_ENV
    else:
        return None
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ConfigError(f"the API token from {source} must be at least {MIN_TOKEN_CHARS} characters without "
                         "spaces; make one with `python -c \"import secrets; print(secrets.token_urlsafe(32))\"`")
    return token


def read_auth_file(path: str | Path) -> list[tuple[str, str]]:
    """``user:password`` per line (blank lines and ``#`` comments skipped) for the Gradio app's login."""
    pairs = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, password = line.partition(":")
        if not sep or not user.strip() or not password:
            raise ConfigError(f"--auth-file {path} line {number}: expected user:password")
        pairs.append((user.strip(), password))
    if not pairs:
        raise ConfigError(f"--auth-file {path} holds no user:password line")
    return pairs


def readable_by_others(path: str | Path) -> bool:
    """Whether a secrets file can be read by other users (then the start-up message warns)."""
    return bool(Path(path).stat().st_mode & (stat.S_IRGRP | stat.S_IROTH))
