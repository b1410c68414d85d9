"""What each backend can do: one table of backend x feature, one check that reads it.

A row says which values of a backend flag (``--rollout-backend``, ``--train-backend``, ``--rollout-router``)
support a feature: a flag being given at all, or one value of a choice flag. A run that asks for a feature
its backend lacks is refused with one message naming the feature's flag and the backend, and what would work;
a row with a ``fallback`` instead lets the run go on without the feature, with a warning naming the flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from miles_async.config.declare import ConfigError, When, when_flag
from miles_async.config.engine_kinds import ENGINE_KINDS

# Which weight route (--weight-update-method) each engine takes, as each engine declares it; "auto" picks the first.
WEIGHT_UPDATE_METHODS = {name: kind.weight_routes for name, kind in ENGINE_KINDS.items()}


@dataclass(frozen=True)
class Axis:
    flag: str  # the flag choosing the backend
    noun: str  # what its values are called in messages

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


ROLLOUT_BACKEND = Axis("--rollout-backend", "backend")
TRAIN_BACKEND = Axis("--train-backend", "backend")
ROUTER = Axis("--rollout-router", "router")


@dataclass(frozen=True)
class Capability:
    feature: str  # the flag asking for the feature
    axis: Axis
    supported_by: tuple[str, ...]  # the values of axis.flag that have it
    value: str | bool | None = None  # a choice of the feature's flag; None: the flag given at all
    why: str = ""
    fallback: str = ""  # a FALLBACKS row: what the run does instead
    only_with: When | None = None  # the row applies only when this holds (the feature has an effect)


class Feature(Protocol):
    """What the check reads of a feature's flag (``declare.Flag``, or an engine's passthrough flags)."""

    dest: str
    choices: tuple

    def is_set(self, ns: argparse.Namespace) -> bool: ...

    def shown(self, ns: argparse.Namespace) -> str: ...


_MEGATRON_ONLY = "a Megatron parallel layout"
# Megatron-LM's parallel layout flags: only the megatron backend takes them, and a command that gives one without
# --train-backend runs on it (``backend_choice``).
MEGATRON_LAYOUT = (
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--context-parallel-size",
    "--sequence-parallel",
    "--use-distributed-optimizer",
    "--expert-model-parallel-size",
)
CAPABILITIES: tuple[Capability, ...] = (
    Capability(
        "--use-fault-tolerance",
        ROLLOUT_BACKEND,
        ("embedded",),
        why="a restarted engine is seeded through the embedded engine's /get_weights",
    ),
    Capability(
        "--use-fault-tolerance", ROUTER, ("builtin",), why="retries and engine set changes are the builtin router's"
    ),
    Capability(
        "--check-weight-update-equal",
        ROLLOUT_BACKEND,
        ("embedded",),
        why="it compares the engines' /weights_checksum, which only the embedded engine serves",
    ),
    Capability(
        "--check-weight-update-equal",
        TRAIN_BACKEND,
        ("fsdp",),
        why="the megatron actor computes no weights_checksum yet",
    ),
    Capability(
        "--rollout-router",
        ROLLOUT_BACKEND,
        ("embedded", "sglang"),
        value="sglang",
        why="SGLang's router speaks SGLang's API",
    ),
    Capability(
        "--use-rollout-routing-replay",
        ROLLOUT_BACKEND,
        ("embedded", "sglang"),
        why="vLLM 0.32 returns routed experts only from its Model Runner V2, which needs Triton (none in its CPU "
        "build); its GPU path is not wired here",
    ),
    Capability("--sglang-*", ROLLOUT_BACKEND, ("sglang",), why="--sglang-<flag> goes to SGLang's server as --<flag>"),
    Capability("--vllm-*", ROLLOUT_BACKEND, ("vllm",), why="--vllm-<flag> goes to vLLM's server as --<flag>"),
    *(
        Capability(
            "--weight-update-method",
            ROLLOUT_BACKEND,
            tuple(b for b, methods in WEIGHT_UPDATE_METHODS.items() if method in methods),
            value=method,
        )
        for method in ("tensor", "disk", "distributed")
    ),
    Capability(
        "--advantage-estimator",
        TRAIN_BACKEND,
        ("fsdp",),
        value="ppo",
        why="it needs a critic, which the megatron backend does not have yet",
    ),
    Capability("--keep-old-actor", TRAIN_BACKEND, ("fsdp",), why="use --use-tis or --use-rollout-logprobs instead"),
    Capability("--lora-rank", TRAIN_BACKEND, ("fsdp",), why="the megatron backend trains no adapters yet"),
    *(
        Capability(name, TRAIN_BACKEND, ("fsdp",), why="the megatron backend trains every weight it builds")
        for name in ("--only-train-params-name-list", "--freeze-params-name-list")
    ),
    *(
        Capability(name, TRAIN_BACKEND, ("fsdp",), why="the megatron backend builds no vision tower (VLMs) yet")
        for name in ("--multimodal-keys", "--freeze-vision-tower")
    ),
    *(Capability(name, TRAIN_BACKEND, ("megatron",), why=_MEGATRON_ONLY) for name in MEGATRON_LAYOUT),
)

# Features a backend lacks that the run can go on without: a warning names the flag and what the run does instead.
FALLBACKS: tuple[Capability, ...] = (
    Capability(
        "--async-save",
        TRAIN_BACKEND,
        ("fsdp",),
        value=True,
        why="its dist_checkpointing save is not run in the background here (megatron-core's async save is not "
        "wired up nor checked over gloo on the CPU)",
        fallback="its --save-interval saves stay synchronous (--no-async-save says so and silences this)",
        only_with=when_flag("--save-interval"),
    ),
    Capability(
        "--shared-prefix",
        TRAIN_BACKEND,
        ("fsdp",),
        value=True,
        why="its packed sequences take no block mask here",
        fallback="each sample's prompt is computed on its own row (--no-shared-prefix says so and silences this)",
        only_with=When("--n-samples-per-prompt", lambda ns: ns.n_samples_per_prompt > 1),
    ),
)


def resolve_weight_update_method(ns: argparse.Namespace) -> str:
    """--weight-update-method for --rollout-backend (auto: the first the engine supports); an unsupported
    choice is the capability check's to refuse."""
    return (
        WEIGHT_UPDATE_METHODS[ns.rollout_backend][0] if ns.weight_update_method == "auto" else ns.weight_update_method
    )


def check_capabilities(
    ns: argparse.Namespace,
    features: Mapping[str, Feature],
    table: tuple[Capability, ...] = CAPABILITIES,
    fallbacks: tuple[Capability, ...] = FALLBACKS,
) -> list[str]:
    """Refuse the first feature asked for whose backend lacks it (``features``: each row's flag by name); return
    a warning for each feature of ``fallbacks`` the run goes on without (the run's warnings: logged, and counted
    by --check-config)."""
    refused = next(_lacking(ns, features, table), None)
    if refused is not None:
        raise ConfigError(_refusal(refused, getattr(ns, refused.axis.dest), features[refused.feature], ns, table))
    return [
        f"{features[row.feature].shown(ns)} is not supported by the {getattr(ns, row.axis.dest)} {row.axis.noun} "
        f"({row.why}): {row.fallback}"
        for row in _lacking(ns, features, fallbacks)
    ]


def supported(
    ns: argparse.Namespace, name: str, feature: Feature, fallbacks: tuple[Capability, ...] = FALLBACKS
) -> bool:
    """Whether the run has the feature of flag ``name`` (a ``fallbacks`` row's): False where it goes on without."""
    return next(_lacking(ns, {name: feature}, tuple(r for r in fallbacks if r.feature == name)), None) is None


def _lacking(
    ns: argparse.Namespace, features: Mapping[str, Feature], table: tuple[Capability, ...]
) -> Iterator[Capability]:
    """The rows of the features this run asks for whose backend lacks them."""
    for row in table:
        if row.only_with is not None and not row.only_with.holds(ns):
            continue
        feature = features[row.feature]
        asked = getattr(ns, feature.dest) == row.value if row.value is not None else feature.is_set(ns)
        if asked and getattr(ns, row.axis.dest) not in row.supported_by:
            yield row


def _refusal(
    row: Capability, current: Any, feature: Feature, ns: argparse.Namespace, table: tuple[Capability, ...]
) -> str:
    axis = row.axis
    why = f" ({row.why})" if row.why else ""
    usable = ""
    if row.value is not None:
        refused = {
            r.value
            for r in table
            if r.feature == row.feature and r.axis == axis and r.value is not None and current not in r.supported_by
        }
        ok = [str(c) for c in feature.choices if c not in refused]
        usable = f", which supports {row.feature} {', '.join(ok)}" if ok else ""
    return (
        f"{feature.shown(ns)} is not supported by the {current} {axis.noun}{why}: runs with it need {axis.flag} "
        f"{' or '.join(row.supported_by)} (this run uses {axis.flag} {current}{usable})"
    )
