"""Megatron-LM's training flags take effect in the real trainers, on a tiny random model.

The optimizer flags are checked against the update formulas (SGD; AdamW over two steps, so the betas count), the
recompute flags by the activations a training forward keeps for backward (Megatron's own recompute; HF gradient
checkpointing on the torch backend), the dropouts by two training forwards of the same input, --attention-backend
by the Transformer Engine switches Megatron's model sets. The Megatron cases run in spawned processes (Megatron
keeps global parallel state; its CPU shim patches torch.cuda in-process), as in test_megatron_backend.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.flag_helpers import tiny_train_flags
from tests.integration.test_megatron_backend import _batch, _spawn


def _argv(model: Path, task: Path, out: Path, *extra: str) -> list[str]:
    """One optimizer step per rollout (the global batch is the whole rollout of 16 samples), no clipping."""
    return tiny_train_flags(model, task, out, "--clip-grad", "0", *extra)


def saved_activation_bytes(forward) -> int:
    """Bytes of the tensors autograd keeps for backward while ``forward()`` runs (recomputed layers keep only
    their inputs). Only the forward: backward's recompute keeps its own, briefly, layer by layer."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return total


# -- torch backend ------------------------------------------------------------------------------------------
def _fsdp_actor(argv: list[str]):
    from miles_async.arguments import parse_args
    from miles_async.backends.fsdp.actor import FSDPTrainActor

    return FSDPTrainActor(parse_args(argv).train, 0, 1, total_optimizer_steps=10)


def _step(actor, rollout_id: int) -> tuple[dict, dict]:
    """(weights before, gradients of) one optimizer step; the gradients stay on the parameters after it."""
    before = {k: p.detach().clone() for k, p in actor.module.named_parameters()}
    actor.train(rollout_id, _batch(rollout_id))
    return before, {k: p.grad.detach().clone() for k, p in actor.module.named_parameters()}


def test_optimizer_sgd_takes_an_sgd_step(tiny_model, tiny_task, tmp_path):
    lr, wd = 0.05, 0.1
    actor = _fsdp_actor(
        _argv(
            tiny_model,
            tiny_task[0],
            tmp_path,
            "--optimizer",
            "sgd",
            "--lr",
            str(lr),
            "--weight-decay",
            str(wd),
            "--sgd-momentum",
            "0.5",
        )
    )
    before, grads = _step(actor, 0)
    assert any(g.abs().sum() > 0 for g in grads.values())
    for k, p in actor.module.named_parameters():
        # First step: the momentum buffer is the gradient itself; weight decay is added to the gradient (L2).
        torch.testing.assert_close(
            p.detach(), before[k] - lr * (grads[k] + wd * before[k]), rtol=1e-5, atol=1e-7, msg=k
        )


def test_adam_betas_eps_and_weight_decay_take_effect(tiny_model, tiny_task, tmp_path):
    """Two AdamW steps with non-default betas, eps and weight decay give exactly the AdamW formula."""
    lr, wd, b1, b2, eps = 0.01, 0.2, 0.5, 0.7, 1e-3
    actor = _fsdp_actor(
        _argv(
            tiny_model,
            tiny_task[0],
            tmp_path,
            "--optimizer",
            "adam",
            "--lr",
            str(lr),
            "--weight-decay",
            str(wd),
            "--adam-beta1",
            str(b1),
            "--adam-beta2",
            str(b2),
            "--adam-eps",
            str(eps),
        )
    )
    _, g1 = _step(actor, 0)
    p1, g2 = _step(actor, 1)
    for k, p in actor.module.named_parameters():
        m = b1 * (1 - b1) * g1[k] + (1 - b1) * g2[k]
        v = b2 * (1 - b2) * g1[k] ** 2 + (1 - b2) * g2[k] ** 2
        update = (m / (1 - b1**2)) / ((v / (1 - b2**2)).sqrt() + eps)
        torch.testing.assert_close(p.detach(), p1[k] * (1 - lr * wd) - lr * update, rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("flags", [["--recompute-granularity", "full"], ["--gradient-checkpointing"]])
def test_recompute_checkpoints_the_torch_models_layers(tiny_model, tiny_task, tmp_path, flags):
    from miles_async.backends.packing import collate

    plain = _fsdp_actor(_argv(tiny_model, tiny_task[0], tmp_path))
    recomputed = _fsdp_actor(_argv(tiny_model, tiny_task[0], tmp_path, *flags))
    assert recomputed.module.is_activation_checkpointing and not plain.module.is_activation_checkpointing
    torch.manual_seed(0)
    mb = collate([list(range(5, 25))] * 4, [list(range(25, 45))] * 4, [[1] * 20] * 4)
    kept = {}
    for name, actor in (("plain", plain), ("recomputed", recomputed)):
        actor.model.train()
        kept[name] = saved_activation_bytes(lambda a=actor: a._forward(a.model, mb, with_entropy=True))
    assert kept["recomputed"] < 0.6 * kept["plain"], kept


def test_attention_dropout_applies_to_training_passes_only(tiny_model, tiny_task, tmp_path):
    from miles_async.backends.packing import collate

    mb = collate([list(range(5, 15))] * 2, [list(range(15, 25))] * 2, [[1] * 10] * 2)
    for dropout, differs in (("0.0", False), ("0.5", True)):
        actor = _fsdp_actor(_argv(tiny_model, tiny_task[0], tmp_path, "--attention-dropout", dropout))
        actor.model.train()
        with torch.no_grad():
            a, b = (actor._forward(actor.model, mb)[0] for _ in range(2))
        assert (not torch.equal(a, b)) == differs, dropout
        actor.model.eval()
        with torch.no_grad():
            assert torch.equal(actor._forward(actor.model, mb)[0], actor._forward(actor.model, mb)[0])


# -- megatron backend (spawned) -----------------------------------------------------------------------------
def _megatron_worker(rank, world, port, base: list[str], out: str) -> None:
    from miles_async.arguments import parse_args
    from miles_async.backends.megatron.actor import MegatronTrainActor
    from miles_async.backends.megatron.convert import export_hf

    def actor(*extra: str) -> MegatronTrainActor:
        a = MegatronTrainActor(parse_args([*base, *extra]).train, rank, world, total_optimizer_steps=10)
        a.init_process_group("127.0.0.1", port)
        return a

    result: dict = {}
    # Transformer Engine's attention switches, set when the model is built (first: Megatron refuses to change them).
    actor("--attention-backend", "flash")
    result["nvte"] = {k: os.environ.pop(k, None) for k in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")}

    # --optimizer sgd: one step moves each weight by -lr x its gradient (no weight decay, no clipping).
    sgd = actor("--optimizer", "sgd", "--lr", "0.05")
    grads: dict = {}
    step = sgd.optimizer.step

    def capture_then_step():
        grads.update(
            {
                k: v.clone()
                for k, v in export_hf(sgd.module, sgd.arch, sgd.tp, sgd.tp_group, tensor_of=lambda p: p.main_grad)
            }
        )
        return step()

    sgd.optimizer.step = capture_then_step
    before = sgd.hf_state()
    sgd.train(0, _batch(0))
    result["sgd"] = {"before": before, "after": sgd.hf_state(), "grads": grads}

    # Recompute keeps fewer activations for backward and trains to the same step.
    ids, pos = torch.randint(3, 50, (4, 48)), torch.arange(48).expand(4, -1)
    for name, extra in (
        ("plain", ()),
        ("full", ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")),
        ("selective", ("--recompute-granularity", "selective")),
        ("gc", ("--gradient-checkpointing",)),
    ):
        a = actor("--lr", "0.01", *extra)
        a.model.train()
        kept = saved_activation_bytes(lambda a=a: a._logits(a.model, ids, pos))
        result[name] = {
            "kept": kept,
            "metrics": a.train(0, _batch(0)),
            "weights": a.hf_state(),
            "granularity": a.module.config.recompute_granularity,
        }

    # Dropout: two training forwards of one input differ; evaluation forwards do not.
    for name, extra in (
        ("no_dropout", ()),
        ("hidden", ("--hidden-dropout", "0.5")),
        ("attention", ("--attention-dropout", "0.5")),
    ):
        a = actor(*extra)
        with torch.no_grad():
            a.model.train()
            train_pair = [a._logits(a.model, ids, pos) for _ in range(2)]
            a.model.eval()
            eval_pair = [a._logits(a.model, ids, pos) for _ in range(2)]
        result[name] = {"train_differs": not torch.equal(*train_pair), "eval_differs": not torch.equal(*eval_pair)}

    # --bf16 with --accumulate-allreduce-grads-in-fp32 (always on): the gradient buffers Megatron reduces are fp32.
    a = actor("--bf16", "--accumulate-allreduce-grads-in-fp32")
    a.train(0, _batch(0))
    result["bf16_grad_dtypes"] = sorted({str(p.main_grad.dtype) for p in a.module.parameters()})
    result["bf16_param_dtypes"] = sorted({str(p.dtype) for p in a.module.parameters()})
    torch.save(result, out)


@pytest.fixture(scope="module")
def megatron_result(tiny_model, tiny_task, tmp_path_factory):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    tmp = tmp_path_factory.mktemp("megatron_flags")
    _spawn(
        _megatron_worker, 1, _argv(tiny_model, tiny_task[0], tmp, "--train-backend", "megatron"), str(tmp / "out.pt")
    )
    return torch.load(tmp / "out.pt", weights_only=False)


def test_megatron_optimizer_sgd_takes_an_sgd_step(megatron_result):
    r = megatron_result["sgd"]
    assert r["grads"] and any(g.abs().sum() > 0 for g in r["grads"].values())
    for k, g in r["grads"].items():
        torch.testing.assert_close(r["after"][k], r["before"][k] - 0.05 * g, rtol=1e-5, atol=1e-7, msg=k)


@pytest.mark.parametrize("name", ["full", "selective", "gc"])
def test_megatron_recompute_keeps_fewer_activations_and_trains_the_same_step(megatron_result, name):
    plain, r = megatron_result["plain"], megatron_result[name]
    assert plain["granularity"] is None and r["granularity"] == ("selective" if name == "selective" else "full")
    assert r["kept"] < (0.9 if name == "selective" else 0.3) * plain["kept"], (r["kept"], plain["kept"])
    for key in ("train/loss", "train/grad_norm", "train/entropy"):
        assert r["metrics"][key] == pytest.approx(plain["metrics"][key], rel=1e-5), key
    for k, w in r["weights"].items():
        torch.testing.assert_close(w, plain["weights"][k], rtol=1e-5, atol=1e-7, msg=k)


def test_megatron_dropouts_apply_to_training_passes_only(megatron_result):
    assert megatron_result["no_dropout"] == {"train_differs": False, "eval_differs": False}
    assert megatron_result["hidden"] == {"train_differs": True, "eval_differs": False}
    assert megatron_result["attention"] == {"train_differs": True, "eval_differs": False}


def test_megatron_attention_backend_sets_transformer_engines_switches(megatron_result):
    assert megatron_result["nvte"] == {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"}


def test_megatron_reduces_fp32_gradients_under_bf16(megatron_result):
    assert megatron_result["bf16_param_dtypes"] == ["torch.bfloat16"]
    assert megatron_result["bf16_grad_dtypes"] == ["torch.float32"]
