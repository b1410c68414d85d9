"""The weight path's pure parts: which route an update takes, what its record refuses, and which ranks read
a backend's tensors (the sender uses them, a gathering rank drains them for its collectives, others skip)."""

from __future__ import annotations

import pytest
import torch

from miles_async.weights.source import WeightSource, iter_buckets
from miles_async.weights.update import WeightUpdate, route_for


@pytest.mark.parametrize(
    ("method", "engine", "route"),
    [
        ("tensor", "embedded", "shared_memory"),
        ("tensor", "sglang", "shared_memory"),
        ("distributed", "sglang", "process_group"),
        ("disk", "sglang", "disk"),
        ("disk", "vllm", "disk"),
    ],
)
def test_each_method_and_engine_take_their_route(method, engine, route):
    assert route_for(method, engine) == route


def test_the_record_refuses_what_no_route_can_do():
    with pytest.raises(ValueError, match="--rollout-dtype 'float16'"):
        WeightUpdate(version=1, route="http", dtype="float16", timeout=1)
    with pytest.raises(ValueError, match="disk weight route needs the folder"):
        WeightUpdate(version=1, route="disk", dtype="float32", timeout=1)
    with pytest.raises(ValueError, match="--weight-update-method 'nccl'"):
        route_for("nccl", "sglang")


def _source(sends: bool, gathers: bool, passes: list[list[str]]) -> WeightSource:
    def tensors():
        seen: list[str] = []
        passes.append(seen)
        for name in ("a", "b", "c"):
            seen.append(name)  # where Megatron gathers the parameter over TP
            yield name, torch.ones(2)

    return WeightSource(tensors, sends=sends, gathers=gathers)


def test_only_the_sender_uses_the_tensors_and_gathering_ranks_drain_them():
    passes: list[list[str]] = []
    assert _source(True, True, passes).read(lambda named: [n for n, _ in named], []) == ["a", "b", "c"]
    assert _source(False, True, passes).read(lambda named: pytest.fail("only the sender consumes"), {}) == {}
    assert passes == [["a", "b", "c"], ["a", "b", "c"]]  # the gathering rank took part in every gather
    assert _source(False, False, passes).read(lambda named: pytest.fail("only the sender consumes"), 0) == 0
    assert len(passes) == 2  # a rank outside the gathers does not read at all


def test_buckets_cast_and_split_at_the_size():
    named = [("a", torch.ones(4)), ("b", torch.ones(4)), ("c", torch.ones(2))]
    buckets = list(iter_buckets(named, torch.bfloat16, bucket_bytes=12))
    assert [[n for n, _ in b] for b in buckets] == [["a"], ["b", "c"]]
    assert all(t.dtype == torch.bfloat16 for b in buckets for _, t in b)


def test_buckets_stay_on_the_tensors_device_and_reuse_a_tensor_already_in_the_dtype():
    """GPU weights must not be copied to the CPU to be bucketed (the meta device stands in for the GPU here:
    a tensor there has no bytes to copy, so moving it to the CPU fails)."""
    on_meta = [("a", torch.ones(4, device="meta")), ("b", torch.ones(2, device="meta", dtype=torch.bfloat16))]
    (bucket,) = iter_buckets(on_meta, torch.bfloat16, bucket_bytes=1 << 20)
    assert [(t.device.type, t.dtype) for _, t in bucket] == [("meta", torch.bfloat16)] * 2
    live = torch.arange(4, dtype=torch.bfloat16)
    (bucket,) = iter_buckets([("c", live)], torch.bfloat16, bucket_bytes=1 << 20)
    assert bucket[0][1].data_ptr() == live.data_ptr()  # no copy of a tensor already in the engine's dtype


def test_this_node_is_loopback_or_its_address_and_any_other_host_is_not():
    from miles_async.weights.node import node_address, on_this_node

    assert on_this_node("http://127.0.0.1:30000") and on_this_node("http://localhost:30000")
    assert on_this_node(f"http://{node_address()}:30000")
    assert not on_this_node("http://192.0.2.1:30000")  # TEST-NET-1: nobody's address


def test_the_same_node_route_refuses_an_engine_on_another_node_naming_the_flag():
    """Handles to this node's memory (CUDA IPC, shared-memory files) cannot be opened on another node: the push
    stops before any bucket is read or any engine is called, naming --weight-update-method."""
    from miles_async.weights.sender import WeightSender

    read: list[str] = []

    def buckets():
        read.append("bucket")
        yield [("a", torch.ones(2))]

    update = WeightUpdate(
        version=1,
        route="shared_memory",
        dtype="float32",
        timeout=2,
        targets=("http://192.0.2.1:30000",),
        engine="sglang",
    )
    with pytest.raises(ValueError, match=r"http://192\.0\.2\.1:30000.*--weight-update-method distributed"):
        WeightSender().push(buckets(), update)
    assert read == []
