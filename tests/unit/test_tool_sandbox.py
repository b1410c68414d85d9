"""The tool sandbox (--tool-sandbox namespace) against hostile tools, in real worker processes: a fork bomb, a memory
hog, an endless loop, a ``setsid`` child, a tool writing outside its folder, one reaching the network and one
reading /tmp. Each is contained and the runner goes on serving calls.

CI runs these as root, where the kernel ignores RLIMIT_NPROC: the namespace's uid 0 is the unprivileged uid 65534
outside, so the limit holds. Limits are tight (16 processes, 256 MiB, 2 CPU seconds) so nothing here can load the
shared machine, and the fork bomb runs only after a bounded fork loop showed the process limit holds. Every test
needs user, PID and mount namespaces; they skip, as tests/allowed_skips.toml allows for this file, only where the
kernel refuses them to a bare child process (tests/sandbox_helpers.py): a fault in our own set-up fails them.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from miles_async.config import SandboxConfig
from miles_async.rollout.sandbox import needed_paths
from miles_async.rollout.tools import ToolRunner
from tests.sandbox_helpers import TIGHT, require_namespaces

HOSTILE = "tests.hostile_tools.HOSTILE"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def namespaces():
    require_namespaces()


@pytest.fixture
def runner(namespaces):
    made = []

    def make(timeout: float = 1.0, sandbox: SandboxConfig = TIGHT) -> ToolRunner:
        # The output cap is unique to the test: it is on each worker's command line, so the test finds its own.
        made.append(ToolRunner(HOSTILE, timeout, 100_000 + os.getpid() % 1000 + len(made), 2, sandbox))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _processes(marker: str) -> list[int]:
    """Every process on the machine whose command line holds ``marker`` (in any PID namespace)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline and "/proc" not in cmdline:
                found.append(int(entry))
    return found


def _workers(r: ToolRunner) -> list[int]:
    return _processes(f"miles_async.rollout.tool_worker {HOSTILE} {r.max_chars}")


def _run(session, *calls):
    async def go():
        return [await session.call(name, args) for name, args in calls]

    return asyncio.run(go())


def test_a_fork_bomb_is_contained_by_the_process_limit(runner):
    r = runner()
    session = r.session()
    try:
        # First, bounded: the limit refuses a fork before 16 processes (the worker counts).
        (forked,) = _run(session, ("fork_until_refused", {"most": 64}))
        assert 0 < int(forked) < TIGHT.max_processes, forked
        before = len(_workers(r))
        assert before <= TIGHT.max_processes
        bomb, after = _run(session, ("fork_bomb", {}), ("remember", {"value": "x"}))
    finally:
        session.close()
    assert bomb == "error: tool 'fork_bomb' timed out after 1 s (--tool-timeout) and was killed"
    assert after == ""  # a fresh worker served the next call
    assert _workers(r) == []  # every copy of the bomb went with its namespace


def test_a_memory_hog_runs_out_of_memory_and_the_worker_goes_on(runner):
    r = runner(timeout=10.0)
    session = r.session()
    try:
        first, hog, state = _run(
            session, ("remember", {"value": "kept"}), ("memory_hog", {}), ("remember", {"value": "y"})
        )
    finally:
        session.close()
    assert hog == "error: tool 'memory_hog' ran out of memory (its limit is --tool-memory-mb)"
    assert (first, state) == ("", "kept")  # the same worker, unharmed
    assert r.restarts == 0


def test_an_endless_loop_is_killed_at_its_cpu_limit(runner):
    r = runner(timeout=30.0, sandbox=SandboxConfig(**{**TIGHT.__dict__, "cpu_seconds": 1}))
    session = r.session()
    t0 = time.monotonic()
    try:
        looped, after = _run(session, ("endless_loop", {}), ("remember", {"value": "x"}))
    finally:
        session.close()
    assert looped == "error: tool 'endless_loop' used up its CPU time (1 s, --tool-cpu-seconds) and was killed"
    assert time.monotonic() - t0 < 15.0  # not the 30 s wall-clock timeout
    assert after == "" and r.restarts == 1


def test_a_setsid_child_does_not_outlive_its_sample(runner):
    r = runner()
    marker = f"{os.getpid()}.{time.monotonic_ns() % 10**6}"  # `sleep MARKER`: unique to this test
    session = r.session()
    try:
        (started,) = _run(session, ("setsid_child", {"marker": marker}))
        assert started == "started"
        assert len(_processes(f"sleep {marker}")) == 1  # it outlived the call, in its own session
    finally:
        session.close()
    assert _processes(f"sleep {marker}") == []  # not the sample: the namespace took it
    # Killed at the timeout, the same.
    hung = r.session()
    try:
        (result,) = _run(hung, ("setsid_child_and_hang", {"marker": marker + "1"}))
        assert result.endswith("timed out after 1 s (--tool-timeout) and was killed")
        assert _processes(f"sleep {marker}1") == []
    finally:
        hung.close()


def test_a_tool_writes_only_in_its_own_folder(runner, tmp_path):
    r = runner()
    session = r.session()
    try:
        outside, in_tmp, inside, where = _run(
            session,
            ("write_file", {"path": str(tmp_path / "outside.txt")}),
            ("write_file", {"path": "/tmp/miles-async-sandbox-test.txt"}),
            ("write_file", {"path": "inside.txt"}),
            ("where", {}),
        )
        folder = session.folder
        assert Path(folder, "inside.txt").read_text() == "x"
    finally:
        session.close()
    assert (
        outside
        == f"error: tool 'write_file' raised OSError: [Errno 30] Read-only file system: '{tmp_path}/outside.txt'"
    )
    assert in_tmp.startswith("error: tool 'write_file' raised OSError: [Errno 30] Read-only file system")
    assert not (tmp_path / "outside.txt").exists() and not Path("/tmp/miles-async-sandbox-test.txt").exists()
    assert inside == f"{folder}/inside.txt" and json.loads(where)["cwd"] == folder
    assert not Path(folder).exists()  # removed with its worker


def test_no_network_and_a_private_tmp_on_request(runner, tmp_path):
    (tmp_path / "ours.txt").write_text("not for tools")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        open_session = runner().session()
        closed = runner(sandbox=SandboxConfig(**{**TIGHT.__dict__, "no_network": True, "private_tmp": True}))
        closed_session = closed.session()
        try:
            (reached,) = _run(open_session, ("connect", {"port": port}))
            unreached, wrote, where = _run(
                closed_session,
                ("connect", {"port": port}),
                ("write_file", {"path": "/tmp/private.txt"}),
                ("where", {}),
            )
            folder = closed_session.folder
        finally:
            open_session.close()
            closed_session.close()
    assert reached == "connected"  # the network is there without the flag
    assert unreached == "refused: [Errno 101] Network is unreachable"
    assert wrote == "/tmp/private.txt" and not Path("/tmp/private.txt").exists()
    # Its /tmp holds what it wrote, the way to its own folder and to what it needs to start (our interpreter and
    # import path, read-only, when they are under /tmp: a checkout there), nothing else of ours (tmp_path's file).
    needed = {Path(p).parts[2] for p in needed_paths() if p.startswith("/tmp/")}
    assert set(json.loads(where)["tmp"]) <= {"private.txt", Path(folder).relative_to("/").parts[1], *needed}
    if tmp_path.is_relative_to("/tmp"):
        assert tmp_path.relative_to("/tmp").parts[0] not in needed | {Path(folder).relative_to("/").parts[1]}


def test_killing_the_rollout_process_ends_its_workers_and_their_children(namespaces, tmp_path):
    """The parent-death signal: a rollout process killed with SIGKILL (no clean-up runs) leaves no worker and no
    process a tool started."""
    marker = f"{os.getpid()}.{time.monotonic_ns() % 10**6 + 7}"
    code = textwrap.dedent(f"""
        import asyncio, json, sys
        from miles_async.config import SandboxConfig
        from miles_async.rollout.tools import ToolRunner
        r = ToolRunner({HOSTILE!r}, 5.0, 1000, 1, SandboxConfig(max_processes=16))
        s = r.session()
        asyncio.run(s.call("setsid_child", {{"marker": {marker!r}}}))
        print(json.dumps({{"init": s._worker.box.init_pid}}), flush=True)
        sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        init = json.loads(proc.stdout.readline())["init"]
        assert len(_processes(f"sleep {marker}")) == 1
        pidfd = os.pidfd_open(init)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert select.select([pidfd], [], [], 10)[0], "the namespace's init outlived the rollout process"
        os.close(pidfd)
    finally:
        proc.kill()
        proc.wait(10)
    assert _processes(f"sleep {marker}") == []


def test_a_machine_without_user_namespaces_fails_at_start_naming_the_flag(namespaces, tmp_path):
    """In a namespace where creating user namespaces is forbidden (max_user_namespaces 0), the Toolbox refuses to
    start with --tool-sandbox namespace and says what to do; rlimits-only starts."""
    code = textwrap.dedent("""
        import sys
        from miles_async.config import SandboxConfig, ToolsConfig
        from miles_async.rollout.multi_turn import Toolbox
        Toolbox(ToolsConfig("tests.hostile_tools.HOSTILE", 2, 5.0, 100, 1, SandboxConfig(mode=sys.argv[1]))).close()
        print("started")
    """)
    forbid = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"'
    results = {}
    for mode in ("namespace", "rlimits-only"):
        results[mode] = subprocess.run(
            ["unshare", "--user", "--map-root-user", "sh", "-c", forbid, "sh", sys.executable, "-c", code, mode],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    refused, limited = results["namespace"], results["rlimits-only"]
    assert refused.returncode != 0
    assert (
        "SandboxError: --tool-sandbox namespace: this machine does not allow it: unshare(user, mount, pid, IPC) "
        in (refused.stderr)
    )
    assert "(give --tool-sandbox rlimits-only or none to run tools without it)" in refused.stderr
    assert limited.returncode == 0 and limited.stdout.strip() == "started", limited.stderr
