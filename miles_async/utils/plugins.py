"""Resolve plugin points given by dotted path (``pkg.module:function`` or ``pkg.module.function``)."""

from __future__ import annotations

import importlib
import logging
from typing import Any

logger = logging.getLogger(__name__)

# Miles' own plugins that have the same function here, by the dotted path a Miles launcher gives: the path loads
# ours, and the alias is logged. check_reward_nonzero_std keeps a group whose rewards are not all equal, as
# zero_variance does (a group of one is kept here: Miles' std of one reward is NaN, which drops every group when
# --n-samples-per-prompt is 1).
MILES_EQUIVALENTS = {
    "miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std": (
        "miles_async.rollout.filters:zero_variance"
    ),
    "miles.rollout.filter_hub.dynamic_sampling_filters.check_no_aborted": "miles_async.rollout.filters:no_aborted",
}


class PluginError(ValueError):
    pass


def load_object(path: str, flag: str = "plugin") -> Any:
    """Import ``module:attr`` or ``module.attr``; errors name the flag and what failed. A path into Miles' own tree
    with an equivalent here (``MILES_EQUIVALENTS``) loads that equivalent."""
    ours = MILES_EQUIVALENTS.get(path.replace(":", "."))
    if ours is not None:
        logger.info("%s %s: Miles' own function, loaded as its equivalent here, %s", flag, path, ours)
        path = ours
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
