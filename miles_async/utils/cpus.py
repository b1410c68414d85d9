"""Pinning a process to a set of CPU cores: ``--train-cpu-affinity`` and ``--rollout-cpu-affinity``.

On one machine the trainer and the engines share its cores; pinning them to disjoint sets splits the machine as a
GPU cluster splits its GPUs (each side computes on its own cores, and waits idle when it has nothing to do), which
is what the asynchronous loop overlaps.
"""

from __future__ import annotations

import argparse
import os


def cpu_list(text: str) -> tuple[int, ...]:
    """``"0-3,8"`` -> ``(0, 1, 2, 3, 8)``: Linux's CPU-list syntax (``taskset -c``, ``Cpus_allowed_list``)."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            first, last = int(low), int(high) if high else int(low)
            if first < 0 or last < first:
                raise ValueError(part)
            cores.update(range(first, last + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of CPU cores such as 0 or 0-3,8 (as taskset -c takes)"
        ) from None
    return tuple(sorted(cores))


def check_available(cores: tuple[int, ...], flag: str) -> None:
    """A ``ValueError`` naming ``flag``, the cores this process may not run on here (absent, or outside its own
    affinity) and those it may, unless all of ``cores`` are available."""
    have = os.sched_getaffinity(0)
    missing = sorted(set(cores) - have)
    if missing:
        raise ValueError(f"{flag}: core(s) {missing} are not available on this node (it has {sorted(have)})")


def pin(cores: tuple[int, ...], flag: str) -> None:
    """Pins this process (and the threads and processes it starts from now on) to ``cores``; ``check_available``
    first."""
    check_available(cores, flag)
    os.sched_setaffinity(0, cores)
