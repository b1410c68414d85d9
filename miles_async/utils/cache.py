"""Where miles-async keeps what it builds once per machine: engine environments, converted models, lookups."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$MILES_ASYNC_CACHE`` if set, else ``~/.cache/miles-async``."""
    env = os.environ.get("MILES_ASYNC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "miles-async"
