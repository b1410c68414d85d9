"""Multi-turn rollouts with tools: flags, checks and ``ToolsConfig``.

``--tools-path`` switches the default generate function to ``rollout.multi_turn.generate_multi_turn`` (a
``--custom-generate-function-path`` still wins, and receives the same config as ``GenerateContext.tools``).
``--max-turns`` is also accepted as Miles' ``--generate-max-turns``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from miles_async.config.declare import When, at_least, flag, group, positive, when_flag

TITLE = "rewards and plugins"
TOOLS = When("--tools-path", lambda ns: ns.tools_path is not None)


@dataclass(frozen=True)
class ToolsConfig:
    path: str  # module.attribute of the tool registry
    max_turns: int
    timeout: float  # seconds per tool call
    max_output_chars: int
    workers: int  # tool calls running at once (one worker process each)


GROUPS = (
    group(
        TITLE,
        flag(
            "--tools-path",
            default=None,
            needs=when_flag("--apply-chat-template", why="the conversation and its tool messages use the template"),
            help="module.attribute (or module:attribute) of a tool registry: a dict name -> callable or a list of "
            'functions. Turns on multi-turn generation: the model calls tools as <tool_call>{"name": ..., '
            '"arguments": {...}}</tool_call>; each call runs in a worker process and its result comes back as '
            "the chat template's tool message (loss mask 0)",
        ),
        flag(
            "--max-turns",
            "--generate-max-turns",
            type=int,
            default=8,
            check=at_least(1),
            effect_needs=TOOLS,
            help="assistant turns per sample; a sample whose last allowed turn still calls a tool ends TRUNCATED. "
            "All turns share one token budget: the response (model and tool tokens) is at most "
            "--rollout-max-response-len tokens",
        ),
        flag(
            "--tool-timeout",
            type=float,
            default=30.0,
            check=positive(),
            effect_needs=TOOLS,
            help="seconds one tool call may run; then its worker process is killed and the call's result is an "
            "error message (the sample goes on)",
        ),
        flag(
            "--tool-output-max-chars",
            type=int,
            default=4096,
            check=at_least(1),
            effect_needs=TOOLS,
            help="characters of a tool's output kept in the conversation (the rest is cut, with a note)",
        ),
        flag(
            "--tool-workers",
            type=int,
            default=4,
            check=at_least(1),
            effect_needs=TOOLS,
            help="tool calls running at once, each in its own worker process",
        ),
    ),
)


def build(ns: argparse.Namespace) -> ToolsConfig | None:
    # The registry itself is imported by arguments.build_config (the rollout layer sits above the configs), so a
    # bad one fails before any worker starts.
    if ns.tools_path is None:
        return None
    return ToolsConfig(ns.tools_path, ns.max_turns, ns.tool_timeout, ns.tool_output_max_chars, ns.tool_workers)
