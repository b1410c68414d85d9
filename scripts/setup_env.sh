#!/usr/bin/env bash
# Create (once) or reuse the project's virtual environment and print its path.
# The environment lives in the user's cache, keyed by a hash of the requirement files,
# so a fresh clone reuses it and a change of pins rebuilds it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${MILES_ASYNC_CACHE:-$HOME/.cache/miles-async}"
VENV="${MILES_ASYNC_VENV:-$CACHE/venv}"
PYTHON="${PYTHON:-python3}"

# shellcheck source=scripts/lib/engine_env.sh
source "$ROOT/scripts/lib/engine_env.sh"
# shellcheck source=scripts/lib/torch_install.sh
source "$ROOT/scripts/lib/torch_install.sh"
stamp="$(cat "$ROOT/requirements.txt" "$ROOT/requirements-test.txt" "$ROOT/requirements-megatron.txt" | sha256sum | cut -c1-16)-${TORCH_STAMP}"
if venv_current "$VENV" "$stamp"; then
  echo "$VENV"
  exit 0
fi
mkdir -p "$(dirname "$VENV")"
venv_lock "$VENV" setup_env
if venv_current "$VENV" "$stamp"; then
  echo "$VENV"  # built by whoever held the lock
  exit 0
fi
echo "[setup_env] building the virtual environment in $VENV (once; a few minutes)" >&2
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip >&2
# torch first and pinned, so nothing below can pull another build; the report says which one this is.
torch_install "$VENV" setup_env
"$VENV/bin/pip" install -q -r "$ROOT/requirements.txt" -r "$ROOT/requirements-test.txt" >&2
# megatron-core's only runtime dependencies (torch, numpy, packaging) are pinned above, so torch stays put.
"$VENV/bin/pip" install -q -r "$ROOT/requirements-megatron.txt" >&2
echo "$stamp" > "$VENV/.miles-async-stamp"
echo "$VENV"
