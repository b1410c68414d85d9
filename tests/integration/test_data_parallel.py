"""Two training workers over gloo take the same optimizer step as one worker on the whole batch."""

from __future__ import annotations

import math
import random

import torch

from miles_async.arguments import parse_args
from miles_async.backends.data_parallel import DataParallel, all_gather_dict, all_reduce_sum, shard
from miles_async.backends.fsdp.actor import FSDPTrainActor
from miles_async.backends.fsdp.sharding import full_parameters, full_tensor
from miles_async.rollout.batch import RolloutBatch, to_train_batch
from miles_async.rollout.sample import Sample
from tests.flag_helpers import tiny_train_flags
from tests.ports import spawn_ranks
from tests.tolerance import StepBounds, assert_same_first_step, record_first_step, unit_roundoff


def _batch(seed: int = 0) -> RolloutBatch:
    rng = random.Random(seed)
    groups = []
    for g in range(4):
        prompt = [rng.randrange(5, 40) for _ in range(rng.randrange(3, 7))]
        groups.append(
            [
                Sample(
                    uid=str(g),
                    group_index=g,
                    index=i,
                    prompt="",
                    prompt_tokens=prompt,
                    response_tokens=[rng.randrange(5, 40) for _ in range(rng.randrange(1, 6))],
                    reward=float(rng.random() < 0.5),
                )
                for i in range(4)
            ]
        )
    for s in (s for g in groups for s in g):  # an engine's log-probs: --use-tis needs one per trained token
        s.rollout_logprobs = [-3.0] * s.response_length
    return to_train_batch(groups)


def record_torch_step(actor: FSDPTrainActor) -> dict:
    """``record_first_step`` for the torch backend: whole (gathered) weights and clipped gradients."""

    def weights() -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in full_parameters(actor.module)}

    def grads() -> dict[str, torch.Tensor]:
        return {k: full_tensor(p.grad).clone() for k, p in actor.module.named_parameters()}

    return record_first_step(actor, weights, grads)


def _train(cfg, rank: int, world: int, port: int, out) -> None:
    torch.manual_seed(0)
    actor = FSDPTrainActor(cfg.train, rank, world, total_optimizer_steps=10)
    actor.init_process_group("127.0.0.1", port)
    first = record_torch_step(actor)
    actor.train(0, _batch())
    if rank == 0:
        torch.save(first, out)


def _worker(rank, world, port, cfg, out):
    _train(cfg, rank, world, port, out)


def _dp_helpers(rank: int, world: int, port: int, out) -> None:
    """Four ranks as Megatron lays out TP 2 x DP 2: ranks 0 and 2 are one data-parallel group, 1 and 3 the other."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    groups = [torch.distributed.new_group([0, 2]), torch.distributed.new_group([1, 3])]
    dp = DataParallel(rank // 2, 2, groups[rank % 2])
    result = {
        "shard": shard(10, 4, dp),
        "sum": all_reduce_sum(float(rank + 1), dp, torch.device("cpu")),
        "gathered": all_gather_dict({rank: [float(rank)]}, dp),
    }
    torch.save(result, out / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def test_data_parallel_helpers_work_over_the_group_they_are_given(tmp_path):
    """Sums and gathers stay inside the given group (not the world), and its replicas split each step's samples."""
    assert spawn_ranks(_dp_helpers, 4, tmp_path, timeout=120) == [0] * 4
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    assert [g["sum"] for g in got] == [4.0, 6.0, 4.0, 6.0]  # 1 + 3 and 2 + 4
    assert got[0]["gathered"] == got[2]["gathered"] == {0: [0.0], 2: [2.0]}
    assert got[1]["gathered"] == got[3]["gathered"] == {1: [1.0], 3: [3.0]}
    # Steps of 4 samples out of 10, dealt alternately to the group's two replicas; TP peers get the same ones.
    assert got[0]["shard"] == got[1]["shard"] == ([[0, 2], [4, 6], [8]], [0, 2, 4, 6, 8])
    assert got[2]["shard"] == got[3]["shard"] == ([[1, 3], [5, 7], [9]], [1, 3, 5, 7, 9])


def test_two_gloo_workers_match_one(tiny_model, tiny_task, tmp_path):
    """The pair runs FSDP2 with --fsdp-cpu-offload (FSDP2's CPUOffloadPolicy; on this CPU-only machine the shards
    are in host memory either way, so what moves to a GPU and back is not exercised here; the pair without it:
    tests/integration/test_fsdp2.py)."""
    train, _ = tiny_task
    common = tiny_train_flags(tiny_model, train, tmp_path, "--lr", "1e-2", "--global-batch-size", "8")
    one = parse_args(common)
    two = parse_args(common + ["--actor-num-gpus-per-node", "2", "--fsdp-cpu-offload"])
    assert two.train.cpu_offload
    assert two.cluster.num_train_workers == 2
    assert spawn_ranks(_worker, 1, one, tmp_path / "single.pt", timeout=240) == [0]
    assert spawn_ranks(_worker, 2, two, tmp_path / "pair.pt", timeout=240) == [0, 0]
    single, pair = torch.load(tmp_path / "single.pt"), torch.load(tmp_path / "pair.pt")
    # The pair's reduce-scatter sums its workers' gradients in another order than one worker's backward: the
    # first step's gradients and weights agree within tests/tolerance.py's float32 bounds. (Adam's first step
    # is scale-free: a reduction that summed instead of averaging shows in the gradients, not the weights.)
    bounds = StepBounds.of(tiny_model, _batch().tokens, group_size=4)
    margins = assert_same_first_step(single, pair, bounds)
    print(f"2 workers vs 1, largest |diff| / tolerance: {margins}")


def test_kl_loss_to_the_reference_model(tiny_model, tiny_task, tmp_path):
    """With --use-kl-loss the policy is pulled towards --ref-load: KL is 0 at the start, then grows and is logged."""
    train, _ = tiny_task
    cfg = parse_args(
        [
            "--use-tis",
            "--hf-checkpoint",
            str(tiny_model),
            "--ref-load",
            str(tiny_model),
            "--prompt-data",
            str(train),
            "--rollout-batch-size",
            "4",
            "--n-samples-per-prompt",
            "4",
            "--num-rollout",
            "2",
            "--rm-type",
            "integer",
            "--lr",
            "1e-2",
            "--use-kl-loss",
            "--kl-loss-coef",
            "0.5",
            "--kl-loss-type",
            "k3",
            "--entropy-coef",
            "0.01",
            "--output-dir",
            str(tmp_path),
        ]
    )
    actor = FSDPTrainActor(cfg.train, 0, 1, total_optimizer_steps=10)
    first = actor.train(0, _batch())
    second = actor.train(1, _batch())
    # Before the first step policy and reference are the same weights: their log-probs differ by rounding d at
    # most (tests/tolerance.py), and k3 = exp(-d) + d - 1 <= d^2 / 2 * exp(|d|), plus the rounding of exp(-d) - 1
    # near 0 (2 u). One step later the KL is beyond it.
    d = StepBounds.of(tiny_model, _batch().tokens).logprob
    kl_tol = d * d / 2 * math.exp(d) + 2 * unit_roundoff(torch.float32)
    assert first["train/kl_loss"] <= kl_tol
    assert second["train/kl_loss"] > kl_tol
    assert second["train/entropy"] > 0
