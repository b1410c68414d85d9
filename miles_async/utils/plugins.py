"""Resolve plugin points given by dotted path (``pkg.module:function`` or ``pkg.module.function``)."""

from __future__ import annotations

import importlib
from typing import Any


class PluginError(ValueError):
    pass


def load_object(path: str, flag: str = "plugin") -> Any:
    """Import ``module:attr`` or ``module.attr``; errors name the flag and what failed."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise PluginError(f"{flag}: '{path}' is not of the form module:attribute or module.attribute")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import-time failure is the plugin's, report it as such
        raise PluginError(f"{flag}: cannot import module '{module_name}' from '{path}': {e!r}") from e
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise PluginError(f"{flag}: module '{module_name}' has no attribute '{attr}'") from e


def load_function(path: str, flag: str = "plugin") -> Any:
    """``load_object`` for a callable."""
    obj = load_object(path, flag)
    if not callable(obj):
        raise PluginError(f"{flag}: '{path}' is not callable")
    return obj
