"""A verifier worker process (started by ``rollout.verifier_pool``): ``python -m miles_async.rollout.verifier_worker
[MODULE ...]``. Its stdin and stdout are one end of a socket pair, read and written as a
``multiprocessing.connection.Connection``: it imports the MODULEs, sends ``"ready"``, then answers each ``(fn,
args)`` with ``(True, fn(*args))`` or ``(False, traceback)`` until the other end closes.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from multiprocessing.connection import Connection


def main(preload: list[str]) -> None:
    conn = Connection(os.dup(0))
    # Prints (math-verify's, sympy's) go to stderr; the socket carries only the protocol.
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    for module in preload:
        importlib.import_module(module)
    conn.send("ready")
    while True:
        try:
            fn, args = conn.recv()
        except EOFError:  # the owner closed its end, or died
            return
        try:
            reply = (True, fn(*args))
        except Exception:  # noqa: BLE001 - the caller's error policy decides, with the traceback
            reply = (False, traceback.format_exc())
        conn.send(reply)


if __name__ == "__main__":
    main(sys.argv[1:])
