"""FSDP2 on the torch backend, over gloo between real worker processes: each of 2 workers holds half of the
policy, its reference model, the critic and their optimizer state; a checkpoint saved by 2 workers resumes at 1
and at 2 with the same weights and optimizer state, and the next step agrees.

(One step at 2 workers against 1: tests/integration/test_data_parallel.py; engines receiving the gathered weights,
checked bit for bit, across a restart from a 2-worker checkpoint: tests/e2e/test_trainer_fault_tolerance.py.)
"""

from __future__ import annotations

import math

import torch

from miles_async.arguments import parse_args
from miles_async.backends.fsdp.actor import FSDPTrainActor
from miles_async.backends.fsdp.critic import FSDPCritic
from miles_async.backends.fsdp.sharding import full_parameters, full_tensor, local_tensor
from tests.flag_helpers import tiny_train_flags
from tests.integration.test_data_parallel import _batch, record_torch_step
from tests.ports import spawn_ranks
from tests.tolerance import StepBounds, assert_rejected, assert_same_first_step, assert_within


def _spawn(target, world: int, *args) -> None:
    assert spawn_ranks(target, world, *args, timeout=300) == [0] * world


def _argv(model, task, out, *extra: str) -> list[str]:
    return tiny_train_flags(model, task, out, "--lr", "1e-2", "--global-batch-size", "8", *extra)


def _sizes(module: torch.nn.Module) -> tuple[int, int, int]:
    """(elements this rank holds, rank 0's share of a dim-0 split in two, elements of the whole model)."""
    local = sum(local_tensor(p).numel() for p in module.parameters())
    half = sum(-(-p.shape[0] // 2) * math.prod(p.shape[1:]) for p in module.parameters())
    return local, half, sum(p.numel() for p in module.parameters())


def _full_optimizer_state(actor) -> dict[str, torch.Tensor]:
    """Adam's moments of every parameter, gathered (every rank takes part)."""
    names = {id(p): n for n, p in actor.module.named_parameters()}
    out = {}
    for p, state in actor.optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{names[id(p)]}.{key}"] = full_tensor(state[key]).clone()
    return out


def _shard_and_save(rank, world, port, argv, ckpt, out):
    torch.manual_seed(0)
    cfg = parse_args(argv)
    actor = FSDPTrainActor(cfg.train, rank, world, total_optimizer_steps=10)
    actor.init_process_group("127.0.0.1", port)
    critic_cfg = parse_args(argv + ["--advantage-estimator", "ppo"]).critic
    critic = FSDPCritic(critic_cfg, rank, world, total_optimizer_steps=10)
    critic.init_process_group("127.0.0.1", port)  # the same process group (one process runs both here)
    batch = _batch()
    values = critic.compute_values(0, batch)
    critic_metrics = critic.train(0, batch, values, [[1.0] * len(v) for v in values])
    metrics = actor.train(0, batch)
    report = {
        "policy": _sizes(actor.module),
        "ref": _sizes(actor.ref_model),
        "critic": _sizes(critic.module),
        "adam_local": sum(local_tensor(s["exp_avg"]).numel() for s in actor.optimizer.state.values()),
        "critic_adam_local": sum(local_tensor(s["exp_avg"]).numel() for s in critic.optimizer.state.values()),
        "kl": metrics["train/kl_loss"],
        "ref_weights": {k: v.clone() for k, v in full_parameters(actor.ref_model)},
        "critic_loss": critic_metrics["critic/loss"],
    }
    actor.save(ckpt, 0)
    report["weights"] = {k: v.clone() for k, v in full_parameters(actor.module)}
    report["adam"] = _full_optimizer_state(actor)
    if rank == 0:
        torch.save(report, out)


def _resume_and_step(rank, world, port, argv, ckpt, out):
    cfg = parse_args(argv)
    actor = FSDPTrainActor(cfg.train, rank, world, 10, ckpt, 0)
    actor.init_process_group("127.0.0.1", port)
    loaded = {k: v.clone() for k, v in full_parameters(actor.module)}
    adam = _full_optimizer_state(actor)
    steps = actor.optimizer_steps
    first = record_torch_step(actor)
    actor.train(1, _batch(1))
    if rank == 0:
        torch.save({"loaded": loaded, "adam": adam, "steps": steps, "first": first}, out)


def test_two_workers_each_hold_half_and_a_checkpoint_resumes_at_one_and_at_two(tiny_model, tiny_task, tmp_path):
    train, _ = tiny_task
    extra = ["--ref-load", str(tiny_model), "--use-kl-loss", "--kl-loss-coef", "0.1"]
    two = _argv(tiny_model, train, tmp_path / "out", *extra, "--actor-num-gpus-per-node", "2")
    one = _argv(tiny_model, train, tmp_path / "out", *extra)
    ckpt = str(tmp_path / "ckpt")
    _spawn(_shard_and_save, 2, two, ckpt, tmp_path / "saved.pt")
    saved = torch.load(tmp_path / "saved.pt")

    # Every model is split in two: rank 0 holds the dim-0 half of each parameter (the larger one when odd),
    # measured after the step, so no pass left a model gathered.
    for name in ("policy", "ref", "critic"):
        local, half, total = saved[name]
        assert local == half and local < 0.55 * total, (name, local, half, total)
    assert saved["adam_local"] == saved["policy"][0]  # the optimizer state lives on the shards only
    assert saved["critic_adam_local"] == saved["critic"][0]
    # The sharded reference model is --ref-load's, whole after a gather, untouched by the training it served.
    from transformers import AutoModelForCausalLM

    ref = dict(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).named_parameters())
    assert saved["ref_weights"].keys() == ref.keys()
    assert all(torch.equal(saved["ref_weights"][k], ref[k].detach()) for k in ref)
    assert saved["kl"] > 1e-6  # the second optimizer step of the rollout moved the policy away from it
    assert saved["critic_loss"] > 0

    _resume_and_step(0, 1, None, one, ckpt, tmp_path / "resumed1.pt")  # one worker: no process group, in this process
    _spawn(_resume_and_step, 2, two, ckpt, tmp_path / "resumed2.pt")
    at1, at2 = torch.load(tmp_path / "resumed1.pt"), torch.load(tmp_path / "resumed2.pt")
    for resumed in (at1, at2):
        assert resumed["steps"] == 2  # --global-batch-size 8 of 16 samples: two optimizer steps per rollout
        assert resumed["loaded"].keys() == saved["weights"].keys()
        assert all(torch.equal(resumed["loaded"][k], saved["weights"][k]) for k in saved["weights"])
        assert resumed["adam"].keys() == saved["adam"].keys()
        assert all(torch.equal(resumed["adam"][k], saved["adam"][k]) for k in saved["adam"])
    # The first step after the resume, at 2 workers and at 1, from the same weights and Adam moments: within
    # tests/tolerance.py's float32 bounds (a shard left unstepped, or two swapped, fails them).
    moments = {k: (saved["adam"][f"{k}.exp_avg"], saved["adam"][f"{k}.exp_avg_sq"]) for k in saved["weights"]}
    bounds = StepBounds.of(tiny_model, _batch(1).tokens, group_size=4)
    margins = assert_same_first_step(at1["first"], at2["first"], bounds, step=at1["steps"] + 1, state=moments)
    print(f"resumed at 2 workers vs at 1, largest |diff| / tolerance: {margins}")


def _keep_old(rank, world, port, argv, out):
    """--keep-old-actor: rank 0's samples were generated by weight version 0, rank 1's by version 1, so the two
    ranks score different kept versions: each must still run the other's passes (they are collectives)."""
    from tests.integration.test_algorithms_in_trainer import _batch as versioned_batch
    from tests.integration.test_algorithms_in_trainer import _no_engines

    torch.manual_seed(0)
    actor = FSDPTrainActor(parse_args(argv).train, rank, world, total_optimizer_steps=10)
    actor.init_process_group("127.0.0.1", port)
    actor.push_weights(_no_engines(0))
    actor.train(0, versioned_batch(0))
    actor.push_weights(_no_engines(1))
    actor.train(1, versioned_batch(1, version=1))
    stale = versioned_batch(2)
    for i in range(1, len(stale), 2):  # the samples of data-parallel rank 1 (every other one)
        stale.weight_versions[i] = [1] * len(stale.weight_versions[i])
    actor.prepare(2, stale, 1.0)
    if rank == 0:
        torch.save(actor._prepared.old, out)


def test_keep_old_actor_with_two_workers_scoring_different_versions(tiny_model, tiny_task, tmp_path):
    from tests.integration.test_algorithms_in_trainer import _batch as versioned_batch

    train, _ = tiny_task
    argv = _argv(tiny_model, train, tmp_path / "out", "--keep-old-actor")
    _keep_old(0, 1, None, argv, tmp_path / "one.pt")
    _spawn(_keep_old, 2, argv + ["--actor-num-gpus-per-node", "2"], tmp_path / "two.pt")
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert sorted(two) == list(range(0, 16, 2))  # rank 0's samples, all of version 0
    # Version 0 is the initial weights in both runs: their log-probs differ by float32 rounding only
    # (tests/tolerance.py); each sample's log-probs shifted by one token (a misaligned target) do not pass.
    tol = StepBounds.of(tiny_model, versioned_batch(2).tokens).logprob
    assert_within(two, {i: one[i] for i in two}, tol, "old log-probs at 2 workers vs 1")
    assert_rejected({i: lp[1:] + lp[:1] for i, lp in two.items()}, {i: one[i] for i in two}, tol, "shifted by one")
