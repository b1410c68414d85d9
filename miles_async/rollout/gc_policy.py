"""The garbage-collector settings of the rollout executor's process: full collections off the per-sample path.

A rollout step keeps every sample in flight alive until it finishes: its task, its request and response
objects, its tokens. With CPython's default thresholds (700, 10, 10) those objects survive the young
collections, reach the oldest generation, and trigger full collections, each of which walks the whole heap
(including the ~400k objects the tokenizer, torch and Ray left there at start-up). The more samples in flight,
the more of them are promoted per step and the more full collections run: measured against stand-in engines
(``benchmarks/scale.py``), collection grew from ~120 to ~600 us per sample between 64 and 8,192 requests in
flight, more than the rest of the orchestration.

``tune_gc_for_rollouts`` (called once the executor has loaded what it keeps for the whole run) moves what
exists then out of the collector's reach (``gc.freeze``: it lives as long as the process) and raises the
thresholds so young collections are rarer and a full one needs ~10M net allocations: memory held by cyclic
garbage stays bounded (a young collection still runs every 50k allocations) while the collector no longer
rescans in-flight samples over and over.
"""

from __future__ import annotations

import gc

# (generation 0 allocations, generation 0 collections per generation 1, generation 1 per full collection)
ROLLOUT_GC_THRESHOLDS = (50_000, 20, 10)


def tune_gc_for_rollouts(thresholds: tuple[int, int, int] = ROLLOUT_GC_THRESHOLDS) -> None:
    """Collect once, freeze what survives, and set ``thresholds``: for a process that holds many samples in
    flight (process-wide: call it only in a process the rollout executor owns)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)
