"""What the benchmark doubles read from their environment (they run in processes a run starts)."""

from __future__ import annotations

import os


def seconds_from_env(name: str, owner: str, what: str) -> float:
    """``$name`` as seconds; a missing or unreadable value fails naming the variable and ``what`` it sets."""
    try:
        return float(os.environ[name])
    except (KeyError, ValueError) as e:
        raise ValueError(f"{owner} needs ${name}, the seconds {what} (got {os.environ.get(name)!r})") from e
