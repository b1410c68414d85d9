# shellcheck shell=bash
# Build (once) or reuse a virtual environment of its own (an inference engine's, or the TRL peer
# benchmark's); sourced by setup_sglang_env.sh, setup_vllm_env.sh and setup_trl_env.sh, which define
# `engine_build` (the install steps, run with errexit into $VENV) and call
#   engine_env NAME REQUIREMENTS_FILE STAMP_EXTRA
# It prints the environment's path as the last line of stdout. The environment lives in the user's cache
# (MILES_ASYNC_<NAME>_VENV, default ~/.cache/miles-async/venv-<name>), keyed by a hash of the requirements
# file and STAMP_EXTRA, so a fresh clone reuses it and a change of pins rebuilds it. The build log goes to
# $VENV.log and, on failure, its tail to stderr.

engine_env() {
  local name="$1" req="$2" extra="$3"
  local cache="${MILES_ASYNC_CACHE:-$HOME/.cache/miles-async}"
  local var
  var="MILES_ASYNC_$(echo "$name" | tr '[:lower:]' '[:upper:]')_VENV"
  VENV="${!var:-$cache/venv-$name}"
  PYTHON="${PYTHON:-python3}"
  local stamp
  stamp="$(sha256sum "$req" | cut -c1-16)-$extra"
  if venv_current "$VENV" "$stamp"; then
    echo "$VENV"
    return 0
  fi
  local log="$VENV.log"
  mkdir -p "$(dirname "$VENV")"
  # One build at a time (parallel test workers, two runs on a fresh machine); whoever waited reuses it.
  venv_lock "$VENV" "setup_${name}_env"
  if venv_current "$VENV" "$stamp"; then
    echo "$VENV"
    return 0
  fi
  echo "[setup_${name}_env] building ${name}'s environment in $VENV (once; minutes; log: $log)" >&2
  # Not "if ! (...)": errexit is ignored inside a condition, so a failed step would not stop the build.
  set +e
  (
    set -euo pipefail
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install --upgrade pip
    engine_build
  ) > "$log" 2>&1
  local rc=$?
  set -e
  if [ "$rc" -ne 0 ]; then
    echo "[setup_${name}_env] FAILED; last lines of $log:" >&2
    grep -v "WARNING: Location" "$log" | tail -25 >&2
    return 1
  fi
  echo "$stamp" > "$VENV/.miles-async-stamp"
  # Which torch the build installed (scripts/lib/torch_install.sh's report), out of the log.
  grep -h "^\[setup_${name}_env\] torch " "$log" >&2 || true
  echo "[setup_${name}_env] done: $(du -sh "$VENV" | cut -f1) in $VENV" >&2
  echo "$VENV"
}

# venv_lock VENV WHO: hold $VENV.lock until this shell exits, waiting at most an hour for another build of
# the same environment (and saying so, so a wait is never silent).
venv_lock() {
  local venv="$1" who="$2" fd
  exec {fd}>"$venv.lock"
  if ! flock -n "$fd"; then
    echo "[$who] another process is building $venv; waiting for it (lock: $venv.lock, at most 3600 s)" >&2
    flock -w 3600 "$fd" || { echo "[$who] still locked after 3600 s: $venv.lock" >&2; return 1; }
  fi
}

# venv_current VENV STAMP: whether VENV was built, to the end, from the requirements STAMP names.
venv_current() {
  [ -f "$1/.miles-async-stamp" ] && [ "$(cat "$1/.miles-async-stamp")" = "$2" ]
}
