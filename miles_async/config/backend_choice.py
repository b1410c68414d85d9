"""Which backends a command runs on when it names none.

Miles has neither --rollout-backend nor --train-backend: its engine is SGLang and its trainer Megatron-LM. Its
launchers name them only through their flags, the engine's ``--sglang-*`` and Megatron-LM's parallel layout. A
command that passes an engine's flags without --rollout-backend runs on that engine, and one that gives a Megatron
layout flag without --train-backend runs on Megatron; each choice is logged. With neither, the embedded engine and
the torch (fsdp) backend stay the defaults.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from miles_async.config.capabilities import MEGATRON_LAYOUT, Feature
from miles_async.config.declare import Fallback
from miles_async.config.engine import PASSTHROUGH_ENGINES


def _engine_flags(ns: argparse.Namespace, features: Mapping[str, Feature], engine: str) -> list[str]:
    """The names of the ``--<engine>-*`` flags the command gave, declared here or passed through, once each."""
    prefix = f"--{engine}-"
    names = [name for name, f in features.items() if name.startswith(prefix) and "*" not in name and f.is_set(ns)]
    names += [prefix + word[2:] for word in getattr(ns, f"{engine}_args", ()) if word.startswith("--")]
    return list(dict.fromkeys(names))


def choose(ns: argparse.Namespace, features: Mapping[str, Feature]) -> list[str]:
    """Set --rollout-backend and --train-backend on ``ns`` where the command gave none (their defaults are
    ``Fallback`` values); what was chosen from the command's other flags, for the log."""
    notes = []
    if isinstance(ns.rollout_backend, Fallback):
        given = {e: names for e in PASSTHROUGH_ENGINES if (names := _engine_flags(ns, features, e))}
        ns.rollout_backend = next(iter(given)) if len(given) == 1 else str(ns.rollout_backend)
        if len(given) == 1:
            notes.append(
                f"--rollout-backend {ns.rollout_backend}: none was given, and the command passes "
                f"{', '.join(given[ns.rollout_backend])} (Miles' engine is SGLang, chosen by its flags)"
            )
    if isinstance(ns.train_backend, Fallback):
        layout = [features[name].shown(ns) for name in MEGATRON_LAYOUT if features[name].is_set(ns)]
        ns.train_backend = "megatron" if layout else str(ns.train_backend)
        if layout:
            notes.append(
                f"--train-backend megatron: none was given, and the command gives Megatron-LM's parallel layout "
                f"({', '.join(layout)}; Miles' trainer is Megatron)"
            )
    return notes
