"""Two training workers over gloo take the same optimizer step as one worker on the whole batch."""

from __future__ import annotations

import random
import socket

import pytest
import torch
import torch.multiprocessing as mp

from miles_async.arguments import parse_args
from miles_async.backends.fsdp.actor import FSDPTrainActor
from miles_async.rollout.batch import to_train_batch
from miles_async.rollout.sample import Sample
from tests.flag_helpers import tiny_train_flags

pytestmark = pytest.mark.timeout(300)


def _batch(seed: int = 0) -> dict:
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


def _train(cfg, rank: int, world: int, port: int, out) -> None:
    torch.manual_seed(0)
    actor = FSDPTrainActor(cfg.train, rank, world, total_optimizer_steps=10)
    actor.init_process_group("127.0.0.1", port)
    metrics = actor.train(0, _batch())
    if rank == 0:
        torch.save({"state": actor.module.state_dict(), "grad_norm": metrics["train/grad_norm"]}, out)


def _worker(rank, cfg, world, port, out):
    _train(cfg, rank, world, port, out)


def test_two_gloo_workers_match_one(tiny_model, tiny_task, tmp_path):
    train, _ = tiny_task
    common = tiny_train_flags(tiny_model, train, tmp_path, "--lr", "1e-2", "--global-batch-size", "8")
    one = parse_args(common)
    two = parse_args(common + ["--actor-num-gpus-per-node", "2"])
    assert two.cluster.num_train_workers == 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_worker, args=(0, one, 1, port, tmp_path / "single.pt"))
    p.start()
    p.join(240)
    assert p.exitcode == 0
    procs = [ctx.Process(target=_worker, args=(r, two, 2, port, tmp_path / "pair.pt")) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(240)
        assert proc.exitcode == 0
    single, pair = torch.load(tmp_path / "single.pt"), torch.load(tmp_path / "pair.pt")
    # Adam's first step is scale-free, so the gradient itself is compared through its norm.
    assert pair["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)
    single, pair = single["state"], pair["state"]
    initial = FSDPTrainActor(one.train, 0, 1, 10).module.state_dict()
    assert any(not torch.equal(initial[k], single[k]) for k in single)  # the step did change the weights
    for k in single:
        torch.testing.assert_close(pair[k], single[k], rtol=1e-3, atol=1e-5)


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
    assert first["train/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    assert second["train/kl_loss"] > 1e-6
    assert second["train/entropy"] > 0
