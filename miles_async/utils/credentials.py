"""Credentials kept out of the places other users can read: child processes' environments and world-readable files.

A variable whose name ends like a credential's (``_TOKEN``, ``_KEY``, ...) is one: WANDB_API_KEY, HF_TOKEN,
MILES_ASYNC_API_TOKEN, MILES_ASYNC_ENGINE_API_KEY, RAY_AUTH_TOKEN, and all three of AWS's (AWS_ACCESS_KEY_ID names
the account its secret key signs for). A process the run starts gets none of them unless it needs it, and then as
the path of a ``private_file`` (0600) rather than the value (``/proc/<pid>/environ`` keeps a process's first
environment for its whole life). Ray's own (``RAY_*``) is the exception: a cluster the run starts needs it in every
one of its processes, which is how Ray hands it over (docs/security.md). Pure but for ``private_file`` and
``secrets_withheld``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path

SECRET_SUFFIXES = ("_TOKEN", "_KEY", "_KEY_ID", "_SECRET", "_PASSWORD")


def is_secret_name(name: str) -> bool:
    return name.upper().endswith(SECRET_SUFFIXES)


def without_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without its credentials."""
    return {k: v for k, v in environ.items() if not is_secret_name(k)}


@contextlib.contextmanager
def secrets_withheld(environ: MutableMapping[str, str] = os.environ) -> Iterator[None]:
    """Inside, ``environ`` lacks its credentials but Ray's own: for starting processes that copy this one's
    environment and offer no other (Ray's ``ray.init`` of a cluster of its own)."""
    held = {k: environ.pop(k) for k in list(environ) if is_secret_name(k) and not k.startswith("RAY_")}
    try:
        yield
    finally:
        environ.update(held)


def private_file(text: str, path: str | Path | None = None, prefix: str = "miles-async-") -> Path:
    """``text`` in a file only its owner may read (0600), from its first byte: at ``path`` (replaced whole, never
    widened: a file there before is not reused), or without one a fresh file in the temporary folder."""
    if path is None:
        fd, name = tempfile.mkstemp(prefix=prefix)
        target = Path(name)
    else:
        target = Path(path)
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        if path is not None:
            os.replace(name, target)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return target
