"""How a flag is declared: its argparse options, the checks on its own value, the flags it needs and
the flags without which it has no effect, all in one ``flag(...)`` call.

Each component's module lists its flags next to the typed config they fill. The runners below take
those declarations and name the flag in every message themselves, so a declaration never repeats it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_async.utils.megatron_layout import LayoutError, looks_like_megatron, torch_dist_folder


class ConfigError(ValueError):
    """A flag, file or combination of flags is invalid."""


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


# A check on one flag's value: given the flag's name and value, the problem in words, or None.
Check = Callable[[str, Any], "str | None"]


class Fallback(str):
    """A choice flag's default that the command's other flags may override (``backend_choice``): equal to the value
    it stands for, and told apart from that value given on the command line or in --config."""


@dataclass(frozen=True)
class When:
    """A condition on the parsed flags, and the words naming it in messages ("--use-fault-tolerance")."""

    text: str
    holds: Callable[[argparse.Namespace], bool]


def when_flag(name: str, why: str = "") -> When:
    """True when the boolean flag ``name`` is given; ``why`` follows its name in messages."""
    dest = name.lstrip("-").replace("-", "_")
    return When(name + (f" ({why})" if why else ""), lambda ns: bool(getattr(ns, dest)))


def when_value(name: str, *values: Any, why: str = "") -> When:
    """True when flag ``name`` has one of ``values``."""
    dest = name.lstrip("-").replace("-", "_")
    return When(
        f"{name} {' or '.join(map(str, values))}" + (f" ({why})" if why else ""), lambda ns: getattr(ns, dest) in values
    )


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # the first names it in messages; the others are aliases (Miles/slime spellings)
    options: dict[str, Any]  # argparse's add_argument keywords
    checks: tuple[Check, ...] = ()
    needs: When | None = None  # given without it: refused
    effect_needs: When | None = None  # given without it: accepted, and a warning says it is ignored
    ignored: str | None = None  # accepted (a Miles/slime/Megatron-LM spelling) without effect here; this says why
    refused: str | None = None  # an upstream's spelling refused when given: why, and what to use instead

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def dest(self) -> str:
        return self.options.get("dest") or self.name.lstrip("-").replace("-", "_")

    @property
    def default(self) -> Any:
        return self.options.get("default", False if self.options.get("action") == "store_true" else None)

    @property
    def choices(self) -> tuple:
        return tuple(self.options.get("choices") or ())

    def is_set(self, ns: argparse.Namespace) -> bool:
        """Given a value other than its default (on the command line or in --config)."""
        return getattr(ns, self.dest) != self.default

    def shown(self, ns: argparse.Namespace) -> str:
        """The flag as the user gave it: ``--use-tis``, ``--lr 0.1``, ``--eval-prompt-data a b``."""
        value = getattr(ns, self.dest)
        if self.options.get("action") == "store_true":
            return self.name
        if self.options.get("action") is argparse.BooleanOptionalAction:
            return self.name if value else f"--no-{self.name[2:]}"
        if isinstance(value, (list, tuple)):
            return " ".join([self.name, *map(str, value)])
        return f"{self.name} {value}"


def flag(
    *names: str,
    check: Check | Sequence[Check] = (),
    needs: When | None = None,
    effect_needs: When | None = None,
    ignored: str | None = None,
    refused: str | None = None,
    **options: Any,
) -> Flag:
    """One flag: ``names`` and argparse's ``options`` (type, default, help, choices, action, ...), the ``check``s
    its own value must pass, ``needs`` (refused without it), ``effect_needs`` (warned about without it) and
    ``ignored`` (accepted so launchers run as written, never with an effect: a warning says why) or ``refused``
    (an upstream's flag that parses but is refused when given, with why and what to use instead)."""
    checks = (check,) if callable(check) else tuple(check)
    if ignored is not None:
        options.setdefault("help", f"accepted, no effect: {ignored}")
    if refused is not None:
        options.setdefault("help", f"refused: {refused}")
        default = options.get("default", False if options.get("action") == "store_true" else None)
        checks = (*checks, _refusal(refused, default))
    return Flag(tuple(names), options, checks, needs, effect_needs, ignored, refused)


def _refusal(why: str, default: Any) -> Check:
    return lambda name, v: f"{name} is refused: {why}" if v != default else None


@dataclass(frozen=True)
class Group:
    """Flags under one --help heading; several components may add to the same heading."""

    title: str
    flags: tuple[Flag, ...]


def group(title: str, *flags: Flag) -> Group:
    return Group(title, flags)


# -- checks on one value (None means "not given" and passes, except for ``given``) --------------------
def given(note: str = "") -> Check:
    return lambda name, v: f"{name} is required{note}" if v is None else None


def at_least(bound: float, note: str = "") -> Check:
    return lambda name, v: f"{name} must be >= {bound}{note}" if v is not None and v < bound else None


def positive(note: str = "") -> Check:
    return lambda name, v: f"{name} must be positive{note}" if v is not None and v <= 0 else None


def above(bound: float, note: str = "") -> Check:
    return lambda name, v: f"{name} must be > {bound}{note}" if v is not None and v <= bound else None


def within(low: float, high: float, low_open: bool = False) -> Check:
    """In [low, high], or (low, high] with ``low_open``."""

    def check(name: str, v: Any) -> str | None:
        if v is None or (low < v if low_open else low <= v) and v <= high:
            return None
        return f"{name} must lie in {'(' if low_open else '['}{low}, {high}]"

    return check


def each(check: Check) -> Check:
    """``check`` on every value of a list-valued (``nargs``) flag; the first problem is reported."""

    def run(name: str, values: Any) -> str | None:
        return next((p for p in (check(name, v) for v in values or ()) if p is not None), None)

    return run


def regex(name: str, pattern: Any) -> str | None:
    """A valid Python regular expression."""
    import re

    try:
        re.compile(pattern)
    except re.error as e:
        return f"{name}: {pattern!r} is not a valid regular expression ({e})"
    return None


@dataclass(frozen=True)
class OnMachine:
    """A check only the machine that runs the job can answer (an installed package): ``check_values`` hands its
    problem to ``Machine``, which refuses the run, or under --check-config warns."""

    check: Check

    def __call__(self, name: str, v: Any) -> str | None:
        return self.check(name, v)


def importable(module: str, install: str, value: Any = True) -> Check:
    """The flag, when it has ``value``, needs ``module`` installed; ``install`` says how."""

    def check(name: str, v: Any) -> str | None:
        if v != value or module_installed(module):
            return None
        return f"{name if value is True else f'{name} {value}'} needs {install}"

    return OnMachine(check)


def module_installed(module: str) -> bool:
    parts = module.split(".")
    return all(importlib.util.find_spec(".".join(parts[:i])) is not None for i in range(1, len(parts) + 1))


def hf_folder(name: str, path: str | None) -> str | None:
    """An HF model folder, checked before anything starts: without config.json the workers would fail only
    after Ray is up, with a transformers traceback."""
    if path is None:
        return None
    if not Path(path).is_dir():
        return f"{name}: not a folder: {path}"
    config = Path(path) / "config.json"
    if not config.is_file() and looks_like_megatron(Path(path)):
        return (
            f"{name}: {path} is a Megatron (torch_dist) checkpoint, not an HF model folder: {name} is read "
            f"from HF weights here (give the HF folder it was converted from, e.g. --hf-checkpoint's)"
        )
    if not config.is_file():
        return (
            f"{name}: {path} has no config.json (an HF model folder holds config.json, the weights and the tokenizer)"
        )
    try:
        parsed = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        return f"{name}: {config} is not valid JSON: {e}"
    return None if isinstance(parsed, dict) and "model_type" in parsed else f"{name}: {config} names no model_type"


def hf_or_torch_dist(name: str, path: str | None) -> str | None:
    """An HF model folder, or a complete Megatron-LM torch_dist checkpoint (its tracker and the folder it names)."""
    if path is None or not Path(path).is_dir() or not looks_like_megatron(Path(path)):
        return hf_folder(name, path)
    try:
        torch_dist_folder(path)
    except LayoutError as e:
        return f"{name}: {e}"
    return None


# -- the runners ----------------------------------------------------------------------------------
def check_values(ns: argparse.Namespace, flags: Iterable[Flag], machine: Any = None) -> None:
    """Every flag's own checks, in declaration order; the first problem is raised. A check of this machine
    (``OnMachine``) goes to ``machine`` (``config.machine.Machine``), which decides whether it refuses."""
    for f in flags:
        for check in f.checks:
            problem = check(f.name, getattr(ns, f.dest))
            if problem is not None and machine is not None and isinstance(check, OnMachine):
                machine.require(False, problem)
            else:
                require(problem is None, problem or "")


def check_needs(ns: argparse.Namespace, flags: Iterable[Flag]) -> None:
    for f in flags:
        if f.needs is not None and f.is_set(ns):
            require(f.needs.holds(ns), f"{f.name} needs {f.needs.text}")


def without_effect(ns: argparse.Namespace, flags: Iterable[Flag]) -> list[str]:
    """One warning per flag that was given but has no effect in this configuration."""
    warnings = []
    for f in flags:
        if not f.is_set(ns):
            continue
        if f.ignored is not None:
            warnings.append(f"{f.shown(ns)} is ignored: {f.ignored}")
        elif f.effect_needs is not None and not f.effect_needs.holds(ns):
            warnings.append(f"{f.shown(ns)} is ignored: it only takes effect with {f.effect_needs.text}")
    return warnings
