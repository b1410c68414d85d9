"""Engine API keys: every engine answers only callers that hold the run's key, on loopback too.

An engine that answers anyone lets any local process (another user's job on a shared node, a web page in the
user's browser) push weights into it, abort its requests or read its weights; placed engines
(``ray/engine_host.py``) listen on their node's address, where the whole network reaches them. So every engine is
started with a key and answers 401 to a request without ``Authorization: Bearer <key>``. The key is the run's own,
random (``new_api_key``), unless the user gives one in ``$MILES_ASYNC_ENGINE_API_KEY`` (to call the engines
themselves). It travels in ``EngineConfig.api_key`` to the launchers and to every client, as an ``ApiKey``, which
shows a mask wherever it is printed or dumped: the configuration is printed by --check-config and sent whole to
wandb. The key as a value lives in ``utils/api_key.py``, which the configuration imports; this module is the
engines' side of it.

A server gets it in a file only its user may read (0600), named by ``$MILES_ASYNC_ENGINE_API_KEY_FILE``
(``read_key_file``): never on its command line, which ``ps`` shows to every user of the node, nor in its
environment, which ``/proc/<pid>/environ`` keeps for the process's whole life.

What the servers leave open, mirrored from SGLang's own middleware (``sglang.srt.utils.auth``): ``OPTIONS`` and
the probes, ``/health*`` (so ``/health_generate`` too), ``/ready*`` and ``/metrics*``. The embedded server checks
``is_exempt``; vLLM's ``--api-key`` guards only its own routes (not the dev-mode ones we use, depending on the
version), so ``vllm/auth.py`` guards everything but its probes in front of it. Imports the standard library and
``utils/api_key.py`` only: the SGLang and vLLM environments import it too.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping

from miles_async.utils.api_key import ApiKey

# The path of the file holding the key a server requires (what its launcher sets; ``read_key_file``).
KEY_FILE_ENV = "MILES_ASYNC_ENGINE_API_KEY_FILE"
# Paths a caller without the key may reach (prefix match, as SGLang's decide_request_auth).
EXEMPT_PREFIXES = ("/health", "/ready", "/metrics")


def read_key_file(environ: Mapping[str, str] = os.environ) -> str:
    """The key a server requires, from the file ``$MILES_ASYNC_ENGINE_API_KEY_FILE`` names; ``SystemExit`` naming
    the variable when it is not set or the file holds no key (a server without a key would answer anyone)."""
    path = environ.get(KEY_FILE_ENV)
    if not path:
        raise SystemExit(
            f"${KEY_FILE_ENV} is not set: an engine server requires an API key, read from the file that variable "
            "names (its launcher writes one per run)"
        )
    try:
        with open(path) as fh:
            key = fh.read().strip()
    except OSError as e:
        raise SystemExit(f"${KEY_FILE_ENV}: cannot read {path}: {e.strerror}") from e
    if not key or any(c.isspace() for c in key):
        raise SystemExit(f"${KEY_FILE_ENV}: {path} holds no API key (a non-empty string without whitespace)")
    return key


def reveal(key: ApiKey | str | None) -> str | None:
    return key.reveal() if isinstance(key, ApiKey) else key


def auth_headers(key: ApiKey | str | None) -> dict[str, str]:
    """The request headers that carry ``key`` (none without one)."""
    value = reveal(key)
    return {"Authorization": f"Bearer {value}"} if value else {}


def is_exempt(method: str, path: str) -> bool:
    """Requests an engine answers without the key: CORS preflights and its health/readiness/metrics probes."""
    return method == "OPTIONS" or path.startswith(EXEMPT_PREFIXES)


def authorized(authorization: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header carries ``key`` as a bearer token (compared in constant time)."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())
