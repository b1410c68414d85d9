"""Hostile tools for the sandbox tests: each does what a model-written call could make a careless tool do. Imported by
real tool workers, so stdlib only. The tests run them only under tight limits (tests/unit/test_tool_sandbox.py),
the fork bomb only once a bounded fork loop showed that the process limit holds."""

from __future__ import annotations

import os
import socket
import subprocess
import time

_memory: list[str] = []


def fork_until_refused(most: int) -> int:
    """Forks children that sleep, at most ``most``; how many forks succeeded before one was refused."""
    forked = 0
    for _ in range(most):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        forked += 1
    return forked


def fork_bomb() -> str:
    """The unbounded kind: every process forks for ever, refusals included."""
    while True:
        try:
            os.fork()
        except OSError:
            pass


def memory_hog() -> str:
    chunks = []
    while True:
        chunks.append(bytearray(8 << 20))


def endless_loop() -> str:
    while True:
        pass


def setsid_child(marker: str) -> str:
    """Starts ``sleep MARKER`` in a new session, with its own parent gone (a double fork), and returns."""
    subprocess.Popen(["setsid", "sh", "-c", f"sleep {marker} &"], start_new_session=True).wait()
    # sh may exit before its background child has exec'd sleep (seen on a loaded machine): wait until it has, so
    # the caller finds it running.
    deadline = time.monotonic() + 10
    while not _running(f"sleep {marker}") and time.monotonic() < deadline:
        time.sleep(0.01)
    return "started"


def _running(command: str) -> bool:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode().strip() == command:
                    return True
            except OSError:
                continue
    return False


def setsid_child_and_hang(marker: str) -> str:
    setsid_child(marker)
    time.sleep(3600)
    return "never"


def environment() -> dict:
    return dict(os.environ)


def descriptors() -> dict[int, str]:
    """Each open descriptor and what it refers to (``pipe:[inode]``, a path)."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the listing's own, closed since
            pass
    return out


def session() -> dict:
    return {"sid": os.getsid(0), "pid": os.getpid()}


def write_file(path: str) -> str:
    with open(path, "w") as fh:
        fh.write("x")
    return os.path.abspath(path)


def where() -> dict:
    # At most 500 names: a shared machine's /tmp (thousands of entries) would otherwise overflow the reply's
    # max_chars and cut the JSON (2026-12-06); a private /tmp holds a handful.
    return {"cwd": os.getcwd(), "home": os.environ.get("HOME"), "tmp": sorted(os.listdir("/tmp"))[:500]}


def remember(value: str) -> str:
    """What the previous call in this worker left, or "" (state a sample's calls share and samples must not)."""
    before = _memory[-1] if _memory else ""
    _memory.append(value)
    return before


def connect(port: int) -> str:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError as e:
        return f"refused: {e}"
    return "connected"


def child_pid() -> int:
    """Starts a child that would outlive its worker, and says its pid (in the worker's PID namespace)."""
    return subprocess.Popen(["sleep", "3600"]).pid


HOSTILE = [
    fork_until_refused,
    fork_bomb,
    memory_hog,
    endless_loop,
    setsid_child,
    setsid_child_and_hang,
    environment,
    descriptors,
    session,
    write_file,
    where,
    remember,
    connect,
    child_pid,
]
# For the multi-turn tests: the scripted model calls "sum".
FORK_BOMB = {"sum": lambda a, b: fork_bomb()}
MEMORY_HOG = {"sum": lambda a, b: memory_hog()}
