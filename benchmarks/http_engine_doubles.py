"""Stand-in engines for orchestration benchmarks: HTTP servers that answer SGLang's ``/generate`` at once.

Each answers every ``/generate`` with one token (log-prob 0, finish reason "length", weight version 0) without
looking at the body, so a benchmark that drives the router and the rollout executor against them measures only
the orchestration around the engines. ``N`` of them share one process (one event loop, ``N`` listening ports):
on a machine with few cores, ``N`` interpreters would measure the scheduler instead.

They are plain HTTP/1.1 servers on asyncio's protocol layer, not aiohttp's web server, whose own cost per request
(~100 us) would be most of what is measured. Keep-alive connections and pipelined requests are served; a
request is answered once its whole body (``Content-Length``) has arrived. The other endpoints the rollout path
or a prober may call (``/health``, ``/get_model_info``, ``/get_load``, ``/flush_cache``, ``/abort_request``, the
pause pair) answer 200 with a small JSON body; anything else is a 404.

Run as ``python -m benchmarks.http_engine_doubles N URL_FILE``: serves until killed, after writing the ``N``
URLs (one a line) to ``URL_FILE`` once every port listens.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

GENERATE_ANSWER = {
    "text": "x",
    "output_ids": [7],
    "meta_info": {
        "finish_reason": {"type": "length", "length": 1},
        "output_token_logprobs": [[0.0, 7, None]],
        "output_token_weight_versions": [0],
        "weight_version": 0,
        "prompt_tokens": 0,
        "completion_tokens": 1,
    },
}
OTHER_ANSWERS = {
    b"/health": {},
    b"/health_generate": {},
    b"/get_model_info": {"model_path": "stand-in", "weight_version": 0},
    b"/get_load": {"num_running_reqs": 0, "num_waiting_reqs": 0},
    b"/flush_cache": {},
    b"/abort_request": {},
    b"/pause_generation": {},
    b"/continue_generation": {},
}


def _response(status: bytes, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data)
    return head + data


_GENERATE = _response(b"200 OK", GENERATE_ANSWER)
_OTHERS = {path: _response(b"200 OK", body) for path, body in OTHER_ANSWERS.items()}
_NOT_FOUND = _response(b"404 Not Found", {"error": {"message": "not served by the stand-in engine"}})


class StandInProtocol(asyncio.Protocol):
    """One connection: parse request heads, skip their bodies, write the canned answers in order."""

    def __init__(self, counter: list[int]):
        self.buf = b""
        self.counter = counter  # requests answered, over all connections of the process

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            if len(self.buf) < end + 4 + length:
                return  # the body is still arriving
            self.buf = self.buf[end + 4 + length :]
            parts = head.split(b" ", 2)
            path = parts[1].split(b"?", 1)[0] if len(parts) > 1 else b""
            self.transport.write(_GENERATE if path == b"/generate" else _OTHERS.get(path, _NOT_FOUND))
            self.counter[0] += 1


async def serve(n: int, host: str = "127.0.0.1") -> tuple[list[str], list[asyncio.AbstractServer], list[int]]:
    """``n`` stand-in engines on free ports of ``host``: (their URLs, the servers to close, the answer counter)."""
    loop = asyncio.get_running_loop()
    counter = [0]
    servers = [await loop.create_server(lambda: StandInProtocol(counter), host, 0, backlog=4096) for _ in range(n)]
    urls = [f"http://{host}:{s.sockets[0].getsockname()[1]}" for s in servers]
    return urls, servers, counter


async def _main(n: int, url_file: Path) -> None:
    urls, _, _ = await serve(n)
    tmp = url_file.with_suffix(".tmp")
    tmp.write_text("\n".join(urls) + "\n")
    os.replace(tmp, url_file)  # whole or absent: the reader polls for it
    await asyncio.Event().wait()


if __name__ == "__main__":
    if len(sys.argv) != 3 or not sys.argv[1].isdigit() or int(sys.argv[1]) < 1:
        sys.exit("usage: python -m benchmarks.http_engine_doubles N URL_FILE  (N >= 1 stand-in engines)")
    asyncio.run(_main(int(sys.argv[1]), Path(sys.argv[2])))
