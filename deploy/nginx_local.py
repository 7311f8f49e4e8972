"""nginx in front of ``retrieval serve`` without root: deploy/nginx.conf with your ports, and the pid file, logs
and temporary files in a folder of yours.

    python -m deploy.nginx_local --listen 127.0.0.1:8080 --upstream 127.0.0.1:7860 --prefix ~/nginx-retrieval

writes PREFIX/nginx.conf and prints the commands that start, reload and stop nginx with it (``--run`` starts it
in the foreground instead). deploy/nginx.conf itself stays a plain file for /etc/nginx/conf.d/.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
from pathlib import Path

import click

SITE_CONF = Path(__file__).with_name("nginx.conf")
SYSTEM_DIRS = ("/usr/sbin", "/sbin", "/usr/local/sbin")  # where Debian puts nginx (not on a user's PATH)
TEMP_KINDS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
INSTALL_HINT = "nginx is not installed: `make install` (as root) installs Debian's nginx, or `apt-get install nginx`"


def find_nginx() -> str | None:
    """The nginx binary on PATH or in the sbin folders, or None."""
    return shutil.which("nginx", path=os.pathsep.join([os.environ.get("PATH", ""), *SYSTEM_DIRS]))


def _replace_once(text: str, pattern: str, replacement: str, what: str) -> str:
    new, count = re.subn(pattern, replacement, text, flags=re.MULTILINE)
    if count != 1:
        raise ValueError(f"{SITE_CONF} should have exactly one {what} line, found {count}; restore it from git")
    return new


def _address(value: str, name: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not re.fullmatch(r"[\w.\-\[\]:]+", host):
        raise click.BadParameter(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:8080)", param_hint=name)
    return value


def render_site(listen: str, upstream: str, site: str | None = None) -> str:
    """deploy/nginx.conf with ``listen`` (HOST:PORT) and the upstream ``retrieval serve`` address replaced."""
    site = SITE_CONF.read_text() if site is None else site
    site = _replace_once(site, r"^(\s*listen\s+)80;", rf"\g<1>{listen};", "`listen 80;`")
    return _replace_once(site, r"^(\s*server\s+)127\.0\.0\.1:7860;", rf"\g<1>{upstream};", "upstream `server`")


def open_files_limit(wanted: int = 8192) -> int:
    """Files a worker may open: ``wanted``, or the hard limit a non-root process cannot raise past."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)


def render(prefix: Path, listen: str, upstream: str) -> str:
    """A whole nginx.conf for a non-root nginx: the site of deploy/nginx.conf with every path under ``prefix``."""
    prefix = prefix.resolve()
    files = open_files_limit()
    temp = "\n".join(f"    {kind}_temp_path {prefix / 'tmp' / kind};" for kind in TEMP_KINDS)
    # Root running this launcher (a container, CI): workers keep root's rights, since the default worker
    # user (nobody) cannot reach a private PREFIX. Production as root: the system nginx and /etc/nginx.
    user = "user root;\n" if os.geteuid() == 0 else ""
    site = "\n".join(f"    {line}" if line else "" for line in render_site(listen, upstream).splitlines())
    return (
        f"# Rendered by `python -m deploy.nginx_local` from {SITE_CONF}; edit that file and render again.\n"
        f"{user}worker_processes 1;\n"
        f"worker_rlimit_nofile {files};\n"
        f"pid {prefix / 'nginx.pid'};\n"
        f"error_log {prefix / 'logs' / 'error.log'} warn;\n\n"
        # a proxied request holds two connections (client, uvicorn), a slow client one: thousands of slow
        # clients cost nginx only memory, and never reach uvicorn
        f"events {{\n    worker_connections {files};\n}}\n\n"
        f"http {{\n    access_log {prefix / 'logs' / 'access.log'};\n{temp}\n\n{site}\n}}\n"
    )


def write_config(prefix: Path, listen: str, upstream: str) -> Path:
    """Render into PREFIX/nginx.conf and create PREFIX/logs and PREFIX/tmp; returns the config's path."""
    for folder in ("logs", "tmp"):
        (prefix / folder).mkdir(parents=True, exist_ok=True)
    conf = prefix / "nginx.conf"
    conf.write_text(render(prefix, listen, upstream))
    return conf


def nginx_command(nginx: str, prefix: Path, conf: Path) -> list[str]:
    """nginx with its prefix, config and startup error log in ``prefix`` (add ``-s reload|quit`` or ``-t``)."""
    return [nginx, "-p", str(prefix.resolve()), "-e", str((prefix / "logs" / "error.log").resolve()), "-c",
            str(conf.resolve())]


@click.command()
@click.option("--listen", default="127.0.0.1:8080", show_default=True,
              help="HOST:PORT nginx listens on (ports below 1024 need root).")
@click.option("--upstream", default="127.0.0.1:7860", show_default=True,
              help="HOST:PORT of `retrieval serve`.")
@click.option("--prefix", type=click.Path(file_okay=False, path_type=Path),
              default=Path("~/.local/state/retrieval-nginx").expanduser(), show_default=True,
              help="folder for nginx.conf, the pid file, logs/ and tmp/.")
@click.option("--run", is_flag=True, help="check the config, then run nginx in the foreground (Ctrl-C stops it).")
def main(listen: str, upstream: str, prefix: Path, run: bool) -> None:
    """Render deploy/nginx.conf for a non-root nginx."""
    listen, upstream = _address(listen, "--listen"), _address(upstream, "--upstream")
    nginx = find_nginx()
    if nginx is None:
        raise click.ClickException(INSTALL_HINT)
    conf = write_config(prefix.expanduser(), listen, upstream)
    command = nginx_command(nginx, prefix.expanduser(), conf)
    if run:
        import subprocess

        subprocess.run([*command, "-t", "-q"], check=True)
        os.execv(nginx, [*command, "-g", "daemon off;"])
    shown = " ".join(command)
    click.echo(f"wrote {conf}\nstart:  {shown}\nreload: {shown} -s reload\nstop:   {shown} -s quit\n"
               f"then open http://{listen}/ (`retrieval serve` must listen on {upstream})")


if __name__ == "__main__":
    main()
