"""Multi-turn rollouts with tools: flags, checks and ``ToolsConfig``.

``--tools-path`` switches the default generate function to ``rollout.multi_turn.generate_multi_turn`` (a
``--custom-generate-function-path`` still wins, and receives the same config as ``GenerateContext.tools``).
``--max-turns`` is also accepted as Miles' ``--generate-max-turns``. The ``--tool-sandbox`` flags say what each
tool worker may do (``rollout.sandbox``; docs/tool-sandbox.md).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from miles_async.config.declare import When, at_least, flag, group, positive, when_flag

TITLE = "rewards and plugins"
TOOLS = When("--tools-path", lambda ns: ns.tools_path is not None)
SANDBOX_MODES = ("namespace", "rlimits-only", "none")
LIMITED = When(
    "--tools-path and --tool-sandbox namespace or rlimits-only",
    lambda ns: ns.tools_path is not None and ns.tool_sandbox != "none",
)
NAMESPACE = When(
    "--tools-path and --tool-sandbox namespace", lambda ns: ns.tools_path is not None and ns.tool_sandbox == "namespace"
)


@dataclass(frozen=True)
class SandboxConfig:
    """What a sandboxed worker may do; ``mode`` is one of ``SANDBOX_MODES``."""

    mode: str = "namespace"
    cpu_seconds: float = 60.0  # per worker process and per process it starts (RLIMIT_CPU)
    memory_mb: int = 4096  # address space per process (RLIMIT_AS)
    file_size_mb: int = 256  # largest file a process may write (RLIMIT_FSIZE)
    open_files: int = 256  # per process (RLIMIT_NOFILE)
    max_processes: int = 64  # processes and threads of one worker, itself included (namespace only)
    no_network: bool = False  # namespace only: an empty network namespace
    private_tmp: bool = False  # namespace only: empty /tmp, /var/tmp, /dev/shm


@dataclass(frozen=True)
class ToolsConfig:
    path: str  # module.attribute of the tool registry
    max_turns: int
    timeout: float  # seconds per tool call
    max_output_chars: int
    workers: int  # tool calls running at once
    sandbox: SandboxConfig = SandboxConfig()


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
            help="tool calls running at once (each sample's calls run in that sample's own worker process)",
        ),
        flag(
            "--tool-sandbox",
            default="namespace",
            choices=SANDBOX_MODES,
            effect_needs=TOOLS,
            help="how tool workers are contained. namespace (the default): user, PID, mount and IPC namespaces, "
            "every file read-only but the worker's own folder, a process limit that holds for root, and nothing "
            "a tool starts outlives its worker; the run fails at start where the machine does not allow them. "
            "rlimits-only: resource limits only (no process limit; a tool running as root can lift them). "
            "none: no limits. Every mode gives each sample a fresh worker in its own folder, its own session, an "
            "allowlisted environment and a parent-death signal; see docs/tool-sandbox.md",
        ),
        flag(
            "--tool-cpu-seconds",
            type=float,
            default=SandboxConfig.cpu_seconds,
            check=positive(),
            effect_needs=LIMITED,
            help="CPU seconds a tool worker (one sample's calls) and each process a tool starts may use; then the "
            "kernel kills it and the call's result says so",
        ),
        flag(
            "--tool-memory-mb",
            type=int,
            default=SandboxConfig.memory_mb,
            check=at_least(64),
            effect_needs=LIMITED,
            help="address space (MiB) of each tool process; past it an allocation fails (Python: MemoryError)",
        ),
        flag(
            "--tool-file-size-mb",
            type=int,
            default=SandboxConfig.file_size_mb,
            check=at_least(1),
            effect_needs=LIMITED,
            help="largest file (MiB) a tool process may write; a write past it fails",
        ),
        flag(
            "--tool-open-files",
            type=int,
            default=SandboxConfig.open_files,
            check=at_least(16),
            effect_needs=LIMITED,
            help="open files (descriptors) per tool process",
        ),
        flag(
            "--tool-max-processes",
            type=int,
            default=SandboxConfig.max_processes,
            check=at_least(2),
            effect_needs=NAMESPACE,
            help="processes and threads of one tool worker, the worker included; a fork past it fails",
        ),
        flag(
            "--tool-no-network",
            action="store_true",
            needs=NAMESPACE,
            help="tool workers get an empty network namespace: no network at all, loopback included",
        ),
        flag(
            "--tool-private-tmp",
            action="store_true",
            needs=NAMESPACE,
            help="tool workers see an empty, writable /tmp, /var/tmp and /dev/shm of their own (without it they "
            "see the machine's, read-only)",
        ),
    ),
)


def build(ns: argparse.Namespace) -> ToolsConfig | None:
    # The registry itself is imported by arguments.build_config (the rollout layer sits above the configs), so a
    # bad one fails before any worker starts.
    if ns.tools_path is None:
        return None
    sandbox = SandboxConfig(
        ns.tool_sandbox,
        ns.tool_cpu_seconds,
        ns.tool_memory_mb,
        ns.tool_file_size_mb,
        ns.tool_open_files,
        ns.tool_max_processes,
        ns.tool_no_network,
        ns.tool_private_tmp,
    )
    return ToolsConfig(ns.tools_path, ns.max_turns, ns.tool_timeout, ns.tool_output_max_chars, ns.tool_workers, sandbox)
