"""The engines' API key as a value: a key that never shows itself, the run's own or the user's.

Every engine answers only callers that hold the run's key (``inference/auth.py`` says why and how servers check
it). The key is the run's own, random (``new_api_key``), unless the user gives one in
``$MILES_ASYNC_ENGINE_API_KEY``; it travels in ``EngineConfig.api_key`` to the launchers and to every client. Here,
below both the configuration and the engines, so that the one builds it and the other sends it without either
importing the other. Imports the standard library only: the SGLang and vLLM environments import it too.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

API_KEY_ENV = "MILES_ASYNC_ENGINE_API_KEY"


@dataclass(frozen=True, init=False, repr=False, eq=False)
class ApiKey:
    """A key that never shows itself: ``repr`` and ``str`` are a mask and, a dataclass without fields, it is ``{}``
    in ``dataclasses.asdict`` (the config dumps: --check-config, wandb); ``reveal()`` is the key. Pickles whole
    (Ray carries it to the actors that start or call the engines)."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        if not isinstance(value, str) or not value or any(c.isspace() for c in value):
            raise ValueError(f"${API_KEY_ENV}: an engine API key is a non-empty string without whitespace")
        object.__setattr__(self, "_value", value)

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "ApiKey(***)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ApiKey) and secrets.compare_digest(self._value, other._value)

    def __hash__(self) -> int:
        return hash((ApiKey, self._value))

    def __reduce__(self):
        return ApiKey, (self._value,)


def new_api_key() -> ApiKey:
    """A fresh random key for one run."""
    return ApiKey(secrets.token_urlsafe(32))


def api_key_from_env(environ: Mapping[str, str] = os.environ) -> ApiKey | None:
    """The key the user gave in ``$MILES_ASYNC_ENGINE_API_KEY``, or None."""
    value = environ.get(API_KEY_ENV)
    return ApiKey(value) if value else None
