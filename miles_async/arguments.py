"""The command line (and --config YAML) -> validated, typed ``Config``.

The flags are declared by the component modules of ``miles_async.config``; here they become one argparse
parser, and a parsed namespace is checked in a fixed order: each flag's own value, the backend x feature
table, the flags each flag needs, then each component's cross-flag checks. ``build_config`` then only
assembles. Every error happens before any Ray worker or engine starts and names the flag, file or line at
fault; a flag given where it has no effect is named in a warning.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from miles_async.config import (
    Config,
    algorithm,
    backend_choice,
    checkpoint,
    cluster,
    compat,
    control,
    engine,
    evaluation,
    loop,
    megatron,
    model,
    moe,
    precision,
    report,
    rollout,
    tools,
    tracking,
    train,
)
from miles_async.config.capabilities import check_capabilities
from miles_async.config.declare import ConfigError, Flag, check_needs, check_values, require, without_effect
from miles_async.config.machine import Machine

__all__ = ["ConfigError", "build_config", "build_parser", "parse_args"]

logger = logging.getLogger(__name__)

# --help's headings, in order; each component adds its flags under its headings.
SECTIONS = (
    "cluster",
    "model and checkpoints",
    model.GROUPS[0].title,
    "rollout data",
    "fully async",
    "rewards and plugins",
    "inference engines",
    "eval",
    "training",
    "LoRA (torch backend)",
    "megatron (--train-backend megatron)",
    "critic (--advantage-estimator ppo)",
    "optimizer",
    "algorithm",
    "logging and debugging",
    control.TITLE,
    compat.GROUPS[-1].title,
)
COMPONENTS = (
    tracking,
    cluster,
    train,
    checkpoint,
    model,
    rollout,
    loop,
    engine,
    evaluation,
    megatron,
    moe,
    algorithm,
    compat,
    report,
    control,
    precision,
    tools,
)
GROUPS = tuple(g for component in COMPONENTS for g in component.GROUPS)
FLAGS: tuple[Flag, ...] = tuple(f for title in SECTIONS for g in GROUPS if g.title == title for f in g.flags)
assert len(FLAGS) == sum(len(g.flags) for g in GROUPS), "a flag group's title is missing from SECTIONS"
# What the capability table's rows name: every declared flag, and the engines' passthrough flags.
FEATURES = {**{f.name: f for f in FLAGS}, **engine.PASSTHROUGH}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train_async.py",
        description="Asynchronous RL post-training: rollout N+1 is generated while step N trains.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--config", default=None, help="YAML file of flag values (keys use - or _); command-line flags win")
    for title in SECTIONS:
        section = p.add_argument_group(title)
        for g in GROUPS:
            if g.title == title:
                for f in g.flags:
                    section.add_argument(*f.names, **f.options)
    return p


def parse_args(argv: Sequence[str] | None = None) -> Config:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    _apply_yaml_config(parser, argv)
    ns, unknown = parser.parse_known_args(argv)
    split_engine_flags(parser, ns, unknown)
    return build_config(ns)


def _apply_yaml_config(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config is None:
        return
    path = Path(known.config)
    if not path.is_file():
        raise ConfigError(f"--config: file not found: {path}")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config: {path} is not valid YAML: {e}") from e
    if not isinstance(values, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of flag names to values")
    dests = {a.dest for a in parser._actions}
    defaults = {}
    for key, value in values.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in dests:
            raise ConfigError(f"--config: {path}: unknown flag '{key}'")
        defaults[dest] = value
    # YAML values become defaults, so anything given on the command line still wins.
    parser.set_defaults(**defaults)


def split_engine_flags(parser: argparse.ArgumentParser, ns: argparse.Namespace, unknown: list[str]) -> None:
    """``ns.sglang_args`` / ``ns.vllm_args``: what goes to each engine's server, from the words the parser did not
    know and the list-valued engine flags it did."""
    undeclared = _engine_passthrough(parser, unknown)
    for name in engine.PASSTHROUGH_ENGINES:
        setattr(ns, f"{name}_args", engine.passthrough_args(ns, name, undeclared[name]))


def _engine_passthrough(parser: argparse.ArgumentParser, unknown: list[str]) -> dict[str, tuple[str, ...]]:
    """``--sglang-<flag> [value]`` / ``--vllm-<flag> [value]`` not declared here becomes that engine server's
    ``--<flag> [value]``; anything else unknown is an error, as with ``parse_args``."""
    out: dict[str, list[str]] = {e: [] for e in engine.PASSTHROUGH_ENGINES}
    i = 0
    while i < len(unknown):
        arg = unknown[i]
        name = next((e for e in engine.PASSTHROUGH_ENGINES if arg.startswith(f"--{e}-")), None)
        if name is None:
            parser.error(f"unrecognized arguments: {' '.join(unknown[i:])}")
        flag, eq, value = arg.partition("=")
        out[name].append("--" + flag[len(f"--{name}-") :])
        if eq:
            out[name].append(value)
        elif i + 1 < len(unknown) and not unknown[i + 1].startswith("--"):
            out[name].append(unknown[i + 1])
            i += 1
        i += 1
    return {e: tuple(args) for e, args in out.items()}


def validate(ns: argparse.Namespace, machine: Machine | None = None) -> list[str]:
    """Every check, cheapest first; the warnings for flags given without effect."""
    for note in backend_choice.choose(ns, FEATURES):
        logger.info(note)
    adjusted = [*megatron.sequence_parallel_without_tp(ns), *loop.default_off_policy_correction(ns)]
    check_values(ns, FLAGS, machine)
    fallbacks = check_capabilities(ns, FEATURES)
    check_needs(ns, FLAGS)
    for component in (engine, rollout, loop, algorithm, megatron):
        component.validate(ns)
    unchecked = model.validate(ns)
    checkpoint.validate(ns)
    return [*adjusted, *fallbacks, *unchecked, *without_effect(ns, FLAGS)]


def _count_prompts(ns: argparse.Namespace) -> int:
    """Reads --prompt-data (each line checked, naming file and line); at least one rollout's worth. The files,
    the reward plugins and the tool registry are read here, at the top, because the rollout code that knows their
    format sits above the typed configs."""
    from miles_async.rollout.data_source import count_and_validate_prompts
    from miles_async.rollout.rewards import validate_reward_flags

    validate_reward_flags(ns.custom_rm_path)
    if ns.tools_path is not None:
        from miles_async.rollout.tools import load_tools

        try:
            load_tools(ns.tools_path)
        except ValueError as e:
            raise ConfigError(str(e)) from e
    num_prompts = count_and_validate_prompts(
        ns.prompt_data, ns.input_key, ns.label_key, "--prompt-data", ns.metadata_key, _image_key(ns)
    )
    require(
        num_prompts >= ns.rollout_batch_size,
        f"--prompt-data has {num_prompts} prompts, fewer than --rollout-batch-size {ns.rollout_batch_size}",
    )
    return num_prompts


def _eval_datasets(ns: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """--eval-prompt-data as (name, path) pairs, each file read and checked (naming file and line)."""
    from miles_async.rollout.data_source import count_and_validate_prompts

    values = ns.eval_prompt_data or []
    pairs = (("eval", values[0]),) if len(values) == 1 else tuple(zip(values[::2], values[1::2], strict=True))
    for name, path in pairs:
        count_and_validate_prompts(
            path, ns.input_key, ns.label_key, f"--eval-prompt-data ({name})", ns.metadata_key, _image_key(ns)
        )
    return pairs


def _image_key(ns: argparse.Namespace) -> str | None:
    """--multimodal-keys' image column (the flag's own check has refused a malformed value already)."""
    from miles_async.config.multimodal import parse_multimodal_keys

    return parse_multimodal_keys(ns.multimodal_keys).get("image")


def build_config(ns: argparse.Namespace) -> Config:
    """Validate the namespace, then assemble the per-component configs. What only the machine that runs the job
    can tell goes through one ``Machine``: an error, or under --check-config a warning."""
    machine = Machine(check_config=ns.check_config)
    warnings = validate(ns, machine)
    num_prompts = _count_prompts(ns)
    eval_datasets = _eval_datasets(ns)
    global_batch, num_steps = train.batch_split(ns)
    num_rollout, per_epoch = loop.num_rollout(ns, num_prompts)
    load = checkpoint.load_state_of(ns)
    start_rollout_id = checkpoint.start_rollout_id(load, num_rollout)
    num_workers = cluster.num_train_workers(ns)
    megatron_cfg = megatron.build(ns, num_workers, machine)
    engine.check_machine(ns, machine)
    train.check_data_parallel(
        global_batch, num_workers // megatron_cfg.model_parallel_size, cluster.num_critic_workers(ns)
    )
    use_gpu, threads = machine.cuda_devices() > 0, loop.cpu_threads(ns, os.cpu_count() or 2)
    ns, slow_bf16 = precision.fall_back(ns, use_gpu, precision.cpu_has_bf16())
    warnings += machine.warnings + slow_bf16
    for message in warnings:
        logger.warning(message)
    init_weights = checkpoint.start_from(ns, load)
    actor = train.build(ns, algorithm.build(ns), megatron_cfg, global_batch, num_steps, threads, init_weights)
    return Config(
        cluster=cluster.build(ns),
        engine=engine.build(ns, threads, use_gpu),
        rollout=rollout.build(ns, loop.fully_async_config(ns)),
        eval=evaluation.build(ns, eval_datasets),
        train=actor,
        checkpoint=checkpoint.build(ns, load),
        control=control.build(ns),
        tools=tools.build(ns),
        tracking=tracking.build(ns),
        loop=loop.build(ns, num_rollout, per_epoch, start_rollout_id),
        critic=train.build_critic(ns, actor),
        check_config=ns.check_config,
        warnings=tuple(warnings),
    )
