"""The port policy (miles_async/utils/ports.py): which failures are port clashes, how many starts, and a bound
socket that holds its port."""

from __future__ import annotations

import errno
import socket

import pytest

from miles_async.utils.ports import PORT_ATTEMPTS, bound_socket, port_clash, start_again

# What servers printed when their port was taken (trimmed from real runs).
CLASHES = {
    "python": "OSError: [Errno 98] Address already in use",
    "asyncio (vLLM, uvicorn)": "[Errno 98] error while attempting to bind on address ('127.0.0.1', 8000): address "
    "already in use",
    "ray gcs": "RuntimeError: Failed to start GCS. ... Check failed: server_ Failed to start the grpc server. The "
    "specified port is 52133. ... If the server startup error message is `Address already in use`, it indicates ...",
    "grpc (ray client server)": "Error in bind for address '[::ffff:127.0.0.1]:49733': Address already in use",
    "rust (sglang_router)": "Error: Address already in use (os error 98)",
    "sglang derived port": "ValueError: port_base at 30123 is not available in 30 seconds. The port 30123 is in use",
    "sglang's summary": "Port is already in use. dist_init_port=30100 port_base=30101",
}
OTHER_FAILURES = [
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "FileNotFoundError: [Errno 2] No such file or directory: '/models/qwen/config.json'",
    "requests.exceptions.ConnectionError: [Errno 111] Connection refused",
    "ValueError: --tp-size 2 is more than the 1 GPU visible",
]


@pytest.mark.parametrize("output", CLASHES.values(), ids=CLASHES.keys())
def test_a_taken_port_is_a_clash_however_the_server_says_it(output):
    assert port_clash(f"loading...\n{output}\nbye")


@pytest.mark.parametrize("output", OTHER_FAILURES)
def test_other_failures_are_not(output):
    assert not port_clash(output)


def test_a_clash_starts_again_until_the_attempts_are_used_up():
    clash = CLASHES["python"]
    assert [start_again(n, clash) for n in range(1, PORT_ATTEMPTS + 1)] == [True] * (PORT_ATTEMPTS - 1) + [False]
    assert not start_again(1, OTHER_FAILURES[0])
    assert start_again(4, clash, attempts=5) and not start_again(5, clash, attempts=5)


def test_a_bound_socket_refuses_connections_and_keeps_its_port():
    with bound_socket() as held:
        port = held.getsockname()[1]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)
        # Not even a server that asks to reuse addresses (aiohttp, http.server, TCPStore do) can share it.
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError) as taken:
                other.bind(("127.0.0.1", port))
            assert taken.value.errno == errno.EADDRINUSE
        # The server it is handed to listens on that very port.
        held.listen()
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
