# shellcheck shell=bash
# torch_install VENV WHO: install the pinned torch into VENV before anything else can pull one in, then say on
# stderr which build it is (CPU or CUDA) and how much it installed. Sourced by setup_env.sh and the engines'
# and TRL's set-up scripts; WHO names the caller in the report.
#   MILES_ASYNC_TORCH_SPEC       the requirement (default torch==2.13.0)
#   MILES_ASYNC_TORCH_INDEX_URL  the index torch is taken from, e.g. PyTorch's CPU wheel index
#                                https://download.pytorch.org/whl/cpu. Unset, pip's own configuration decides,
#                                and PyPI's torch for x86-64 Linux is the CUDA build: several GB with its
#                                NVIDIA wheels, of no use on a CPU.
TORCH_SPEC="${MILES_ASYNC_TORCH_SPEC:-torch==2.13.0}"
TORCH_INDEX_URL="${MILES_ASYNC_TORCH_INDEX_URL:-}"
# What a change of either must rebuild: part of the stamp of each environment that sources this file.
# shellcheck disable=SC2034
TORCH_STAMP="${TORCH_SPEC}${TORCH_INDEX_URL:+@$TORCH_INDEX_URL}"

torch_install() {
  local venv="$1" who="$2"
  if [ -n "$TORCH_INDEX_URL" ]; then
    "$venv/bin/pip" install -q --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC" >&2 || return 1
  else
    "$venv/bin/pip" install -q "$TORCH_SPEC" >&2 || return 1
  fi
  "$venv/bin/python" - "$who" "$TORCH_INDEX_URL" <<'PY' >&2
import importlib.metadata as md
import sys

import torch

who, index = sys.argv[1], sys.argv[2]
# Everything a CUDA build drags in rides on torch's own dependencies: its NVIDIA wheels and triton.
names = {"torch", "triton"}
size = 0
for dist in md.distributions():
    name = (dist.metadata["Name"] or "").lower()
    if name in names or name.startswith("nvidia-"):
        size += sum(f.size or 0 for f in dist.files or ())
cuda = torch.version.cuda
build = f"the CUDA {cuda} build" if cuda else "the CPU build"
amount = f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"
line = f"[{who}] torch {torch.__version__}: {build}, {amount} installed"
line += f" (from {index})" if index else " (from pip's configured index)"
if cuda:
    line += "; on a machine without a GPU set MILES_ASYNC_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"
print(line)
PY
}
