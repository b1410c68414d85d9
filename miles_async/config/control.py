"""The control API and Prometheus metrics of a running train_async.py: flags, checks and ``ControlConfig``.

The flag names are Miles' (``--api-server-host``, ``--api-server-port``). The bearer token comes from the
environment (``MILES_ASYNC_API_TOKEN``) or ``--api-server-token-file``; it is never a flag value, so it does not
show in ``ps``, in --check-config's report or in a logged command line.
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
    token: Secret | None

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
            help="address the control API listens on; anything but a loopback address needs a token "
            f"({TOKEN_ENV} or --api-server-token-file)",
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
            help=f"file holding the bearer token every request must carry (else ${TOKEN_ENV}; neither: no token)",
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


def _token(ns: argparse.Namespace) -> Secret | None:
    if ns.api_server_token_file is not None:
        path = Path(ns.api_server_token_file)
        require(path.is_file(), f"--api-server-token-file: file not found: {path}")
        value = path.read_text().strip()
        require(bool(value), f"--api-server-token-file: {path} is empty")
        return Secret(value)
    value = os.environ.get(TOKEN_ENV, "").strip()
    return Secret(value) if value else None


def build(ns: argparse.Namespace) -> ControlConfig:
    token = _token(ns) if ns.api_server_port is not None else None
    require(
        ns.api_server_port is None or token is not None or is_loopback(ns.api_server_host),
        f"--api-server-host {ns.api_server_host} is not a loopback address: anyone who reaches it could stop or "
        f"pause the run; set a token ({TOKEN_ENV} or --api-server-token-file) or listen on 127.0.0.1",
    )
    return ControlConfig(ns.api_server_host, ns.api_server_port, token)
