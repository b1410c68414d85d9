"""Pipeline parallelism in the Megatron-core backend on the CPU (gloo), in spawned processes: a tiny Llama (tied
embeddings, 3 layers) split unevenly into 2 stages, through megatron-core's 1F1B schedule with activations exchanged
between stages over gloo."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.test_megatron_backend import (
    _args,
    _assert_resumed_exactly,
    _batch,
    _record_megatron_step,
    _save_and_resume,
    _spawn,
)
from tests.tolerance import StepBounds, adam_tolerance, assert_rejected, assert_same_first_step, gradient_tolerance

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -r requirements-megatron.txt)")


def _step_worker(rank, world, port, argv: list[str], out: str, ckpt: str | None, reference: str | None) -> None:
    """The first training step, recorded on rank 0 (a first stage: the metrics reach it from the last stage), and
    the export the engines get; with ``ckpt`` the step's checkpoint (no optimizer state), then a checkpoint with
    the optimizer resumed by a fresh actor (``_save_and_resume``). With ``reference`` (one rank), that checkpoint
    loaded into a fresh actor without parallelism and converted to HF names: nothing to gather."""
    from miles_async.arguments import parse_args
    from miles_async.backends.megatron.actor import MegatronTrainActor
    from miles_async.backends.megatron.convert import export_hf

    cfg = parse_args(argv).train
    actor = MegatronTrainActor(cfg, rank, world, total_optimizer_steps=10)
    actor.init_process_group("127.0.0.1", port)
    first = _record_megatron_step(actor)
    actor.train(0, _batch())
    if ckpt is not None:
        actor.save(ckpt, 0, save_optimizer=False)
    result = {
        **first,
        "exported": actor.hf_state(),
        "layout": (actor.tp, actor.stages.size, actor.dp.size, len(actor.module.decoder.layers)),
        "resumed": _save_and_resume(actor, cfg, rank, world, port, ckpt + "/resume") if ckpt else None,
    }
    if reference is not None:
        loaded = MegatronTrainActor(cfg, 0, 1, total_optimizer_steps=10, load_dir=reference, load_rollout_id=0)
        loaded.init_process_group("127.0.0.1", port)
        result["reference"] = {k: v.clone() for k, v in export_hf(loaded.module, loaded.arch)}
    if rank == 0:
        torch.save(result, out)


def _three_layers(tiny_model: Path, out: Path, seed: int) -> Path:
    """The tiny Llama (its tokenizer, tied embeddings) with 3 random layers, so that 2 stages split it unevenly."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model)
    config.num_hidden_layers = 3
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return out


def _swap_layers(named: dict[str, torch.Tensor], a: int, b: int) -> dict[str, torch.Tensor]:
    """``named`` (HF names) with layers ``a`` and ``b`` exchanged: layers numbered wrongly across stages."""
    out = dict(named)
    for k in named:
        if k.startswith(f"model.layers.{a}."):
            other = k.replace(f"model.layers.{a}.", f"model.layers.{b}.")
            out[k], out[other] = named[other], named[k]
    return out


def test_pipeline_parallel_steps_match_the_unparallel_step_and_export_as_their_checkpoint(
    tiny_model, tiny_task, tmp_path
):
    """PP 2 over gloo, uneven (--decoder-first-pipeline-num-layers 2: layers 0-1 on the first stage, layer 2 on
    the last; the tied embedding on the first stage and the LM head's copy of it on the last, their gradients
    summed between them; activations and their gradients exchanged by megatron-core's 1F1B schedule): the first
    step's loss, KL loss to a reference model, entropy, gradients, gradient norm and weights are the unparallel
    step's within tests/tolerance.py's float32 bounds. The reference model's log-probs, and the old log-probs (the
    rollout takes two optimizer steps), run through the schedule forward-only, stage by stage. Negative controls:
    the PP run's layers 1 and 2 exchanged (the stages' layers misnumbered) fail the weight comparison, and its
    last stage's gradients dropped fail the gradient comparison. PP 2's checkpoint (optimizer included) resumes to
    the same next step, to the bit.

    Then the weights the engines get: PP 2's export (the last stage's tensors sent to the first) equals, bit for
    bit and in the same order, the step's checkpoint loaded into one rank without parallelism and converted to HF
    names (which gathers nothing)."""
    train, _ = tiny_task
    model = _three_layers(tiny_model, tmp_path / "policy", seed=0)
    # A reference model other than the policy, so that the KL loss of the first step is not zero.
    ref = _three_layers(tiny_model, tmp_path / "ref", seed=1)
    extra = ["--use-kl-loss", "--kl-loss-coef", "0.5", "--ref-load", str(ref), "--entropy-coef", "0.01"]
    base = _args(model, train, tmp_path, *extra)
    pp2 = base + ["--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2",
                  "--decoder-first-pipeline-num-layers", "2"]  # fmt: skip
    _spawn(_step_worker, 2, pp2, str(tmp_path / "pp2.pt"), str(tmp_path / "pp2"), None)
    _spawn(_step_worker, 1, base, str(tmp_path / "one.pt"), None, str(tmp_path / "pp2"))
    out = {name: torch.load(tmp_path / f"{name}.pt", weights_only=False) for name in ("one", "pp2")}
    # (TP, PP, DP, layers built on rank 0)
    assert [out[n]["layout"] for n in ("one", "pp2")] == [(1, 1, 1, 3), (1, 2, 1, 2)]
    one, pp2 = out["one"], out["pp2"]
    assert one["metrics"]["kl_loss"][0] > 0
    bounds = StepBounds.of(model, _batch(0).tokens, group_size=4)
    metrics = ("loss", "pg_loss", "entropy", "kl_loss", "approx_kl", "ratio_mean")
    margins = assert_same_first_step(one, pp2, bounds, metrics)
    print(f"pp2 vs one rank, largest |diff| / tolerance: {margins}")
    grad_tol, _ = gradient_tolerance(one["grads"], bounds.gradient, clipped=one["metrics"]["grad_norm"][0] > 1.0)
    weight_tol = adam_tolerance(one["grads"], grad_tol, one["after"], one["hyper"], 1)
    assert_rejected(_swap_layers(pp2["after"], 1, 2), one["after"], weight_tol, "weights with layers misnumbered")
    last_stage = {k: torch.zeros_like(g) if k.startswith("model.layers.2.") else g for k, g in pp2["grads"].items()}
    assert_rejected(last_stage, one["grads"], grad_tol, "gradients without the last stage's")
    _assert_resumed_exactly(pp2["resumed"])
    # The engines' stream: the first stage's own tensors, then the last stage's sent to it.
    reference, exported = one["reference"], pp2["exported"]
    assert list(exported) == list(reference)
    for k, v in reference.items():
        assert torch.equal(exported[k], v), k
    down = "model.layers.2.mlp.down_proj.weight"
    assert not torch.equal(reference[down], one["before"][down])  # the step's weights, not the initial ones


def test_tensor_and_pipeline_parallel_together_match_the_unparallel_step(tiny_model, tiny_task, tmp_path):
    """TP 2 x PP 2 over gloo (4 ranks: each stage's layers split over a TP pair, the uneven stages of the test
    above): the first step's loss, entropy, gradients, gradient norm and weights are the unparallel step's within
    tests/tolerance.py's float32 bounds, and the engines' stream, gathered over TP and sent from the last stage,
    holds the same tensors as the unparallel step's."""
    train, _ = tiny_task
    model = _three_layers(tiny_model, tmp_path / "policy", seed=0)
    base = _args(model, train, tmp_path)
    tp2_pp2 = base + ["--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "2",
                      "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2"]  # fmt: skip
    _spawn(_step_worker, 4, tp2_pp2, str(tmp_path / "tp2_pp2.pt"), None, None)
    _spawn(_step_worker, 1, base, str(tmp_path / "one.pt"), None, None)
    one, both = (torch.load(tmp_path / f"{n}.pt", weights_only=False) for n in ("one", "tp2_pp2"))
    # (TP, PP, DP, layers built on rank 0)
    assert [one["layout"], both["layout"]] == [(1, 1, 1, 3), (2, 2, 1, 2)]
    bounds = StepBounds.of(model, _batch(0).tokens, group_size=4)
    margins = assert_same_first_step(one, both, bounds, ("loss", "pg_loss", "entropy", "ratio_mean"))
    print(f"tp2_pp2 vs one rank, largest |diff| / tolerance: {margins}")
    grad_tol, _ = gradient_tolerance(one["grads"], bounds.gradient, clipped=one["metrics"]["grad_norm"][0] > 1.0)
    weight_tol = adam_tolerance(one["grads"], grad_tol, one["after"], one["hyper"], 1)
    assert_rejected(_swap_layers(both["after"], 1, 2), one["after"], weight_tol, "weights with layers misnumbered")
    assert list(both["exported"]) == list(one["exported"])
