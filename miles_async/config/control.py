"""The control API and Prometheus metrics of a running train_async.py: flags, checks and ``ControlConfig``.

The flag names are Miles' (``--api-server-host``, ``--api-server-port``); Miles has no host allowlist or TLS flags,
so those are ours (``--api-server-allowed-hosts``, ``--api-server-ssl-certfile``/``--api-server-ssl-keyfile``, as
uvicorn's ``--ssl-*``). The API always requires a bearer token: the user's, from the environment
(``MILES_ASYNC_API_TOKEN``) or ``--api-server-token-file``, or else one the run makes when the server starts
(``control/server.py``, in a 0600 file of the output folder). It is never a flag value, so it does not show in
``ps``, in --check-config's report or in a logged command line. docs/security.md has the threat model.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from miles_async.config.declare import When, flag, group, require, within

TOKEN_ENV = "MILES_ASYNC_API_TOKEN"
TITLE = "control API and metrics"


class Secret:
    """A token that prints as hidden (--check-config's report, logs, reprs of the config)."""

    def __init__(self, value: str):
        self.value = value

    def __repr__(self) -> str:
        return "<hidden>"

    __str__ = __repr__


@dataclass(frozen=True)
class ControlConfig:
    host: str
    port: int | None  # None: no server; 0: any free port (the one taken is written to <output-dir>/api.json)
    token: Secret | None  # None: the server makes one when it starts (in <output-dir>/api_token)
    allowed_hosts: tuple[str, ...] = ()  # Host headers answered besides the bound address and loopback's
    ssl_certfile: str | None = None  # both or neither: HTTPS
    ssl_keyfile: str | None = None

    @property
    def enabled(self) -> bool:
        return self.port is not None


SERVER = When("--api-server-port", lambda ns: ns.api_server_port is not None)

GROUPS = (
    group(
        TITLE,
        flag(
            "--api-server-host",
            default="127.0.0.1",
            effect_needs=SERVER,
            help="address the control API listens on; anything but loopback should serve HTTPS "
            "(--api-server-ssl-certfile): the token travels in every request",
        ),
        flag(
            "--api-server-port",
            type=int,
            default=None,
            check=within(0, 65535),
            help="serve the control API (/status, /save, /pause, /resume, /stop) and Prometheus /metrics on "
            "this port (0: any free port); its address is written to <output-dir>/api.json",
        ),
        flag(
            "--api-server-token-file",
            default=None,
            effect_needs=SERVER,
            help=f"file holding the bearer token every request must carry (else ${TOKEN_ENV}; neither: the run "
            "makes one and writes it to <output-dir>/api_token, readable by this user only)",
        ),
        flag(
            "--api-server-allowed-hosts",
            nargs="+",
            default=None,
            metavar="HOST",
            effect_needs=SERVER,
            help="Host header values the API answers besides its bound address and loopback's (a DNS name or "
            "address it is reached by, e.g. when listening on 0.0.0.0); any other Host is refused (DNS rebinding)",
        ),
        flag(
            "--api-server-ssl-certfile",
            default=None,
            effect_needs=SERVER,
            help="PEM certificate (chain): the API serves HTTPS (with --api-server-ssl-keyfile)",
        ),
        flag(
            "--api-server-ssl-keyfile",
            default=None,
            effect_needs=SERVER,
            help="PEM private key of --api-server-ssl-certfile",
        ),
    ),
)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve to anything
        return False


def secret_from(flag: str, path: str | None, env: str) -> Secret | None:
    """A credential: the content of the file ``flag`` names, else ``$env``, else None."""
    if path is not None:
        file = Path(path)
        require(file.is_file(), f"{flag}: file not found: {file}")
        value = file.read_text().strip()
        require(bool(value), f"{flag}: {file} is empty")
        return Secret(value)
    value = os.environ.get(env, "").strip()
    return Secret(value) if value else None


def _token(ns: argparse.Namespace) -> Secret | None:
    return secret_from("--api-server-token-file", ns.api_server_token_file, TOKEN_ENV)


def _ssl_files(ns: argparse.Namespace) -> tuple[str | None, str | None]:
    cert, key = ns.api_server_ssl_certfile, ns.api_server_ssl_keyfile
    require(
        (cert is None) == (key is None),
        "--api-server-ssl-certfile and --api-server-ssl-keyfile go together (HTTPS needs both)",
    )
    for name, path in (("--api-server-ssl-certfile", cert), ("--api-server-ssl-keyfile", key)):
        require(path is None or Path(path).is_file(), f"{name}: file not found: {path}")
    return cert, key


def build(ns: argparse.Namespace) -> ControlConfig:
    if ns.api_server_port is None:
        return ControlConfig(ns.api_server_host, None, None)
    cert, key = _ssl_files(ns)
    hosts = tuple(ns.api_server_allowed_hosts or ())
    for host in hosts:
        require(
            bool(host) and not any(c in host for c in "/ @"),
            f"--api-server-allowed-hosts: {host!r} is not a host name or address (no scheme, port or path)",
        )
    return ControlConfig(ns.api_server_host, ns.api_server_port, _token(ns), hosts, cert, key)
