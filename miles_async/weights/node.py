"""Whether an engine runs on this process's node, read from its URL: engines placed on another node (Ray
placement groups) are reached at that node's IP, engines on this node at loopback or this node's IP."""

from __future__ import annotations

from urllib.parse import urlparse

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def node_address() -> str:
    """This node's IP, as Ray names it (the address engines on other nodes reach it at)."""
    import ray

    return ray.util.get_node_ip_address()


def on_this_node(url: str) -> bool:
    host = urlparse(url).hostname
    return host in LOOPBACK or host == node_address()
