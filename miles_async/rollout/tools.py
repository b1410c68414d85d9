"""Tools for multi-turn rollouts: the registry (``--tools-path``), parsing the model's tool calls, and running
each call in a worker subprocess with a timeout and an output cap.

The registry is a module attribute given by dotted path: a dict ``name -> callable`` or a list of callables
(named by ``__name__``). A tool is called with the call's JSON arguments as keywords; what it returns becomes the
tool message (a string as is, anything else as JSON). Its JSON schema (shown to the chat template through
``tools=``) is the callable's ``tool_schema`` attribute if it has one (OpenAI's ``{"type": "function",
"function": {...}}``), else one derived from its signature and docstring.

Calls run in worker processes (``python -m miles_async.rollout.tool_worker``), never in the rollout process: each
sample gets a worker of its own, started at its first call and killed when the sample ends, so no tool state
crosses samples. Workers run in the sandbox ``--tool-sandbox`` chooses (``rollout.sandbox``). A tool that hangs
past ``--tool-timeout``, uses up its CPU time or crashes its worker (a segfault, ``os._exit``) is killed with
everything it started and the call's result is an error message; the sample's next call gets a fresh worker. So a
broken tool costs one turn of one sample, not the run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import os
import re
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_async.rollout.sandbox import Sandboxed, SandboxError, exit_signal
from miles_async.utils.plugins import PluginError, load_object

if TYPE_CHECKING:  # the configs import much; a tool worker imports this module, and starts once per sample
    from miles_async.config.tools import SandboxConfig

FLAG = "--tools-path"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
# Seconds a fresh worker may take to start Python and import the registry.
WORKER_START_TIMEOUT = 120.0

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.DOTALL)
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


# -- parsing ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    """One ``<tool_call>`` block: a name and keyword arguments, or ``error`` saying why the block is unusable
    (the error then goes back to the model as the tool's response)."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block of an assistant turn (the
    Qwen / Hermes format), in order. An empty list means the model called no tool. A block that is not
    closed (the turn ended inside it), is not JSON or lacks a name is kept as a call with ``error`` set."""
    calls = []
    for match in _BLOCK.finditer(text):
        body = match.group(1).strip()
        if not match.group(0).endswith(TOOL_CALL_CLOSE):
            calls.append(ToolCall("", {}, f"unterminated {TOOL_CALL_OPEN} (no {TOOL_CALL_CLOSE})"))
            continue
        try:
            obj = json.loads(body)
        except ValueError as e:
            calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({e})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            calls.append(ToolCall("", {}, 'the tool call names no tool (expected {"name": ..., "arguments": {...}})'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # OpenAI's spelling: the arguments as a JSON string
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                calls.append(ToolCall(obj["name"], {}, f"the arguments are not valid JSON ({e})"))
                continue
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], {}, "the arguments must be a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


def cap_output(text: str, max_chars: int) -> str:
    """At most ``max_chars`` characters, saying how much was cut."""
    if len(text) <= max_chars:
        return text
    note = f"\n[output truncated: {len(text) - max_chars} more characters]"
    return text[:max_chars] + note


def result_text(value: Any) -> str:
    """A tool's return value as the tool message's content."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


# -- the registry -----------------------------------------------------------------------------------
def load_tools(path: str, flag: str = FLAG) -> dict[str, Callable[..., Any]]:
    """The tools at ``module:attr`` or ``module.attr``: a dict name -> callable, or a list of callables."""
    registry = load_object(path, flag)
    if isinstance(registry, dict):
        tools = dict(registry)
    elif isinstance(registry, (list, tuple)):
        tools = {}
        for fn in registry:
            name = getattr(fn, "__name__", None)
            if not name or name == "<lambda>":
                raise PluginError(f"{flag}: '{path}' lists {fn!r}, which has no name; use a dict name -> callable")
            if name in tools:
                raise PluginError(f"{flag}: '{path}' lists two tools named '{name}'")
            tools[name] = fn
    else:
        raise PluginError(
            f"{flag}: '{path}' is a {type(registry).__name__}; expected a dict name -> callable or a list of callables"
        )
    if not tools:
        raise PluginError(f"{flag}: '{path}' holds no tools")
    for name, fn in tools.items():
        if not isinstance(name, str) or not name:
            raise PluginError(f"{flag}: '{path}' has a tool name {name!r}; names are non-empty strings")
        if not callable(fn):
            raise PluginError(f"{flag}: tool '{name}' of '{path}' is not callable")
    return tools


def tool_schema(name: str, fn: Callable[..., Any]) -> dict[str, Any]:
    """The tool's OpenAI-style JSON schema: its ``tool_schema`` attribute, else derived from its signature
    (annotations int/float/str/bool/list/dict become JSON types; parameters without a default are required)."""
    declared = getattr(fn, "tool_schema", None)
    if declared is not None:
        return declared
    properties: dict[str, Any] = {}
    required = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        annotation = param.annotation
        # Under `from __future__ import annotations` the annotation is the type's name.
        kind = next((v for t, v in _JSON_TYPES.items() if annotation in (t, t.__name__)), None)
        properties[param.name] = {"type": kind} if kind else {}
        if param.default is param.empty:
            required.append(param.name)
    doc = inspect.getdoc(fn) or ""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": doc.split("\n\n")[0].strip(),
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


# -- running calls in worker processes ---------------------------------------------------------------
class _Worker:
    """One sample's worker process, sandboxed: a request line on its stdin, one reply line on its stdout."""

    def __init__(self, tools_path: str, max_chars: int, sandbox: SandboxConfig):
        argv = [sys.executable, "-m", "miles_async.rollout.tool_worker", tools_path, str(max_chars)]
        try:
            self.box = Sandboxed(argv, sandbox)
        except SandboxError as e:
            raise RuntimeError(f"{FLAG}: a tool worker failed to start: {e}") from e
        self.proc = self.box.proc
        self._buffer = b""
        self.exited = False  # its stdout closed: the process ended (or is ending)
        reply = self._read_line(time.monotonic() + WORKER_START_TIMEOUT)
        if reply is None or json.loads(reply).get("ready") is not True:
            code = self.kill()
            detail = json.loads(reply).get("error") if reply else f"exit code {code}"
            raise RuntimeError(f"{FLAG}: a tool worker failed to start: {detail}")

    def call(self, name: str, arguments: dict[str, Any], timeout: float) -> str | None:
        """The tool's output (or its error message), or None when the worker hung past ``timeout`` or died."""
        try:
            self.proc.stdin.write((json.dumps({"name": name, "arguments": arguments}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            self.exited = True
            return None
        reply = self._read_line(time.monotonic() + timeout)
        return None if reply is None else json.loads(reply)["output"]

    def _read_line(self, deadline: float) -> bytes | None:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.exited = True
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def kill(self) -> int | None:
        """Kill the worker and everything it started, remove its folder; its exit code (None if it would not die)."""
        return self.box.kill()


def _failure(name: str, hung: bool, code: int | None, cfg: SandboxConfig, timeout: float) -> str:
    """What the model reads when a call did not answer."""
    if hung:
        return f"error: tool '{name}' timed out after {timeout:g} s (--tool-timeout) and was killed"
    if exit_signal(code) == signal.SIGXCPU:
        return f"error: tool '{name}' used up its CPU time ({cfg.cpu_seconds:g} s, --tool-cpu-seconds) and was killed"
    return f"error: tool '{name}' crashed (its worker process exited with code {code})"


class ToolRunner:
    """Runs tool calls: each sample gets a ``ToolSession`` with a worker process of its own, started at its first
    call and killed when the sample ends, so no state crosses samples. At most ``workers`` calls run at once, each
    bounded by ``timeout`` seconds and its output by ``max_chars`` characters. Workers run in ``sandbox``.

    Usable from any event loop (the waits run on the runner's own threads), and from several at once."""

    def __init__(
        self,
        tools_path: str,
        timeout: float,
        max_chars: int,
        workers: int = 4,
        sandbox: SandboxConfig | None = None,
    ):
        from miles_async.config.tools import SandboxConfig

        self.tools_path, self.timeout, self.max_chars = tools_path, timeout, max_chars
        self.sandbox = sandbox or SandboxConfig()
        self._live: set[_Worker] = set()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(workers)
        # Its threads start the workers and live as long as the runner: a worker's parent-death signal fires
        # when the thread that started it ends.
        self._threads = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tool-call")
        self.restarts = 0  # workers replaced after a timeout or crash
        self.started = 0  # workers started
        self._closed = False

    def session(self) -> ToolSession:
        """The tool calls of one sample; ``close`` it when the sample ends."""
        return ToolSession(self)

    def worker_pids(self) -> list[int]:
        with self._lock:
            return sorted(w.proc.pid for w in self._live)

    def _start(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("the tool runner is closed")
        worker = _Worker(self.tools_path, self.max_chars, self.sandbox)
        with self._lock:
            self._live.add(worker)
            self.started += 1
            closed = self._closed
        if closed:
            self._end(worker)
            raise RuntimeError("the tool runner is closed")
        return worker

    def _end(self, worker: _Worker) -> int | None:
        code = worker.kill()
        with self._lock:
            self._live.discard(worker)
        return code

    def close(self) -> None:
        """Kill every worker (calls in flight end as crashed)."""
        with self._lock:
            self._closed = True
            workers = list(self._live)
            self._live.clear()
        for worker in workers:
            worker.kill()
        self._threads.shutdown(wait=False)


class ToolSession:
    """One sample's tool calls, in one worker process of its own. Calls run one at a time, in order; a call that
    times out or crashes costs the worker, and the next call gets a fresh one (without the old one's state)."""

    def __init__(self, runner: ToolRunner):
        self.runner = runner
        self._worker: _Worker | None = None
        self._lock = threading.Lock()  # one call at a time on the worker
        self._closed = False

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """The tool's output, or an error message saying what went wrong; never raises for the tool's fault."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.runner._threads, self._call_blocking, name, arguments)

    def _call_blocking(self, name: str, arguments: dict[str, Any]) -> str:
        runner = self.runner
        with self._lock, runner._slots:
            if self._closed:
                raise RuntimeError("the sample's tool session is closed")
            if self._worker is None:
                self._worker = runner._start()
            worker = self._worker
            output = worker.call(name, arguments, runner.timeout)
            if output is not None:
                return output
            self._worker = None
            hung = not worker.exited
            code = runner._end(worker)
            with runner._lock:
                runner.restarts += 1
            return _failure(name, hung, code, runner.sandbox, runner.timeout)

    @property
    def pid(self) -> int | None:
        """The worker's pid (None before the first call and after a failed one)."""
        return None if self._worker is None else self._worker.proc.pid

    @property
    def folder(self) -> str | None:
        return None if self._worker is None else self._worker.box.folder

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self) -> None:
        """Kill the sample's worker and everything it started; remove its folder."""
        with self._lock:
            self._closed = True
            worker, self._worker = self._worker, None
        if worker is not None:
            self.runner._end(worker)
