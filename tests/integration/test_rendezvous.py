"""The training workers' rendezvous (``BaseWorker.address``, ``join_process_group``): rank 0 serves it on a port
that is already its own when the other ranks are told the number, and they join the group there. (The train
group's real path, over Ray with 2 workers: tests/e2e/test_trainer_fault_tolerance.py.)"""

from __future__ import annotations

import errno
import multiprocessing
import socket

import pytest
import torch
import torch.distributed as dist

from miles_async.arguments import parse_args
from miles_async.backends.worker import BaseWorker, join_process_group
from tests.flag_helpers import minimal_flags


def _all_reduce(rank: int) -> float:
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t.item()


def _rank1(addr: str, port: int, sums: multiprocessing.Queue) -> None:
    join_process_group("gloo", 1, 2, addr, port)
    sums.put(_all_reduce(1))
    dist.destroy_process_group()


def test_rank_0_holds_the_rendezvous_port_from_the_moment_it_names_it(tmp_path):
    assert not dist.is_initialized()
    cfg = parse_args([*minimal_flags(tmp_path), "--num-rollout", "1", "--actor-num-gpus-per-node", "2"]).train
    threads = torch.get_num_threads()
    worker = BaseWorker(cfg, 0, 2)
    torch.set_num_threads(threads)  # the worker's own count is for its process, not this test session's
    addr, port = worker.address()
    # No other process can take the port, not even a server that asks to reuse addresses (TCPStore does).
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError) as taken:
            other.bind(("", port))
        assert taken.value.errno == errno.EADDRINUSE
    # The other rank, told the port now, joins there; rank 0 joins through the store it serves.
    ctx = multiprocessing.get_context("spawn")
    sums = ctx.Queue()
    rank1 = ctx.Process(target=_rank1, args=(addr, port, sums))
    rank1.start()
    try:
        join_process_group("gloo", 0, 2, addr, port, worker.rendezvous)
        assert _all_reduce(0) == sums.get(timeout=60) == 3.0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        rank1.join(60)
        if rank1.is_alive():
            rank1.kill()
    assert rank1.exitcode == 0
