"""Runs in SGLang's environment: ``sglang.launch_server`` with the API key read from a file, not the command line.

``python -m miles_async.inference.sglang.serve <launch_server's flags>``: SGLang reads its key from ``--api-key``
only, and a process's command line (``/proc/<pid>/cmdline``, ``ps``) is readable by every user of the node. This
reads the key from the 0600 file ``$MILES_ASYNC_ENGINE_API_KEY_FILE`` names, appends it to ``sys.argv`` (which is
this interpreter's copy, not the command line the kernel shows) and runs ``sglang.launch_server`` as ``__main__``,
as ``python -m sglang.launch_server`` would. SGLang's own processes start by spawn, which hands them ``sys.argv``
through a pipe. Imports nothing but the standard library and ``inference/auth.py``.
"""

from __future__ import annotations

import runpy
import sys

from miles_async.inference.auth import read_key_file


def main() -> None:
    # One token: a key may start with "-" (a random one does one time in 64), which argparse would take for a flag.
    sys.argv = ["sglang.launch_server", *sys.argv[1:], f"--api-key={read_key_file()}"]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
