"""A tool worker process (started by ``rollout.tools.ToolRunner``): runs one tool call at a time.

``python -m miles_async.rollout.tool_worker TOOLS_PATH MAX_CHARS PARENT_PID``. It imports the registry, says
``{"ready": true}`` (or ``{"ready": false, "error": ...}``), then for each request line ``{"name", "arguments"}``
on stdin answers one line ``{"output": ...}``: the tool's result, or the exception it raised, capped at MAX_CHARS.
What a tool prints goes to stderr, so it cannot garble the replies. The worker exits when its parent is gone,
so a killed rollout process leaves no worker behind.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(0)


def main(argv: list[str]) -> None:
    tools_path, max_chars, parent_pid = argv[0], int(argv[1]), int(argv[2])
    # Replies go to the original stdout; fd 1 (print, C code) goes to stderr from here on.
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()

    from miles_async.rollout.tools import cap_output, load_tools, result_text

    try:
        tools = load_tools(tools_path)
    except Exception as e:  # the parent reports it, naming the flag
        replies.write(json.dumps({"ready": False, "error": str(e)}) + "\n")
        return
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        name = request["name"]
        try:
            output = result_text(tools[name](**request["arguments"]))
        except Exception as e:  # the tool's failure is the model's feedback, not the worker's end
            output = f"error: tool '{name}' raised {type(e).__name__}: {e}"
        replies.write(json.dumps({"output": cap_output(output, max_chars)}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
