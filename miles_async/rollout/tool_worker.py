"""A tool worker process (started by ``rollout.tools.ToolRunner``, in its sandbox): runs one tool call at a time.

``python -m miles_async.rollout.tool_worker TOOLS_PATH MAX_CHARS``. It imports the registry, says
``{"ready": true}`` (or ``{"ready": false, "error": ...}``), then for each request line ``{"name", "arguments"}``
on stdin answers one line ``{"output": ...}``: the tool's result, or the exception it raised, capped at MAX_CHARS.
What a tool prints goes to stderr, so it cannot garble the replies. The sandbox's parent-death signal ends it
with the rollout process.
"""

from __future__ import annotations

import json
import os
import sys


def _run(tools: dict, name: str, arguments: dict) -> str:
    from miles_async.rollout.tools import result_text

    me = os.getpid()
    try:
        return result_text(tools[name](**arguments))
    except MemoryError:
        return f"error: tool '{name}' ran out of memory (its limit is --tool-memory-mb)"
    except Exception as e:  # the tool's failure is the model's feedback, not the worker's end
        return f"error: tool '{name}' raised {type(e).__name__}: {e}"
    finally:
        if os.getpid() != me:  # a process the tool forked came back here: only the worker itself answers
            os._exit(0)


def main(argv: list[str]) -> None:
    tools_path, max_chars = argv[0], int(argv[1])
    # Replies go to the original stdout; fd 1 (print, C code) goes to stderr from here on.
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from miles_async.rollout.tools import cap_output, load_tools

    try:
        tools = load_tools(tools_path)
    except Exception as e:  # the parent reports it, naming the flag
        replies.write(json.dumps({"ready": False, "error": str(e)}) + "\n")
        return
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        output = _run(tools, request["name"], request["arguments"])
        replies.write(json.dumps({"output": cap_output(output, max_chars)}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
