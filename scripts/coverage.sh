#!/usr/bin/env bash
# Line coverage of miles_async/ over the test command, every process included: the tests themselves, the
# train_async.py runs they start, Ray's actor workers and the embedded engine servers (coverage.py starts in
# each through a .pth hook in the environment, for as long as this script runs; the tool sandbox's workers
# get its configuration from rollout/sandbox.py, their environment being allowlisted). SGLang's and vLLM's own
# servers run in their own environments and are not measured. Processes killed with SIGKILL (the fault tests)
# leave no data, so a run counts a little less than what ran.
#   bash scripts/coverage.sh                 the whole suite; prints the total
#   bash scripts/coverage.sh tests/unit -q   any pytest arguments, as for scripts/test.sh
# The combined data and a per-file report stay in $MILES_ASYNC_COVERAGE_DIR (default: a new folder in /tmp).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(bash "$ROOT/scripts/setup_env.sh")"
OUT="${MILES_ASYNC_COVERAGE_DIR:-$(mktemp -d /tmp/miles-async-coverage.XXXXXX)}"
mkdir -p "$OUT"
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# The hook lives in site-packages beside its .pth: a sandboxed tool worker with a private /tmp sees no /tmp folder.
HOOK_NAME="miles_async_coverage_hook_$$"
HOOK="$SITE/$HOOK_NAME.pth"
# patch: os._exit (the engine server's and Ray's workers' fast way out) and exec (the tool sandbox's launcher
# becomes the worker) save first, and a forked child (the sandbox's init, forked test ranks) writes its own file.
cat > "$OUT/coveragerc" <<EOF
[run]
source = $ROOT/miles_async
parallel = true
data_file = $OUT/.coverage
sigterm = true
patch = _exit, execv, fork
EOF
# Only processes that have COVERAGE_PROCESS_START (or, in the tool sandbox, COVERAGE_PROCESS_CONFIG) in their
# environment measure anything.
cat > "$SITE/$HOOK_NAME.py" <<'PY'
import coverage

coverage.process_startup()  # coverage.py's own .pth may have started it already
if getattr(coverage.process_startup, "coverage", None) is not None:
    # Ray ends its actors' workers without any Python exit path: a worker saves what it has every second.
    with open("/proc/self/cmdline", "rb") as fh:
        if b"default_worker.py" in fh.read():
            import threading
            import time

            def _save_every_second():
                while True:
                    time.sleep(1.0)
                    coverage.Coverage.current().save()

            threading.Thread(target=_save_every_second, daemon=True, name="coverage-save").start()
PY
echo "import $HOOK_NAME" > "$HOOK"
trap 'rm -f "$HOOK" "$SITE/$HOOK_NAME.py"' EXIT
rc=0
COVERAGE_PROCESS_START="$OUT/coveragerc" bash "$ROOT/scripts/test.sh" "$@" || rc=$?
rm -f "$HOOK" "$SITE/$HOOK_NAME.py"
"$VENV/bin/python" -m coverage combine -q --rcfile="$OUT/coveragerc"
"$VENV/bin/python" -m coverage report --rcfile="$OUT/coveragerc" > "$OUT/report.txt"
echo "[coverage] tests exited $rc; miles_async/ line coverage: $(tail -n 1 "$OUT/report.txt" | awk '{print $NF}') ($OUT/report.txt)"
exit "$rc"
