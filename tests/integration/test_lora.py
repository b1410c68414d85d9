"""LoRA on the torch backend, in one worker on the tiny model: only the adapters are in the optimizer and move,
what goes to the engines is W + scaling * B @ A under the base model's names, and a checkpoint of the adapters
alone resumes them. (End to end, with the engine, exports and learning: tests/e2e/test_lora.py.)"""

from __future__ import annotations

import pytest
import torch

from miles_async.arguments import ConfigError, parse_args
from miles_async.backends.fsdp.actor import FSDPTrainActor
from tests.flag_helpers import tiny_train_flags
from tests.integration.test_data_parallel import _batch

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules", "q_proj,v_proj,down_proj"]


def _actor(tiny_model, tiny_task, tmp_path, *extra: str, load: str | None = None) -> FSDPTrainActor:
    train, _ = tiny_task
    cfg = parse_args(tiny_train_flags(tiny_model, train, tmp_path / "out", "--lr", "1e-2", *LORA, *extra))
    return FSDPTrainActor(cfg.train, 0, 1, 10, load, 0 if load else None)


def test_only_the_adapters_train_and_the_engines_get_them_merged(tiny_model, tiny_task, tmp_path):
    actor = _actor(tiny_model, tiny_task, tmp_path)
    trained = {n for n, p in actor.module.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert len(trained) == 2 * 3 * 2  # A and B of 3 target modules in each of the 2 layers
    in_optimizer = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for n, p in actor.module.named_parameters() if n in trained}

    before = {n: p.detach().clone() for n, p in actor.module.named_parameters()}
    actor.train(0, _batch())
    after = dict(actor.module.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trained)  # the base is frozen
    assert all(not torch.equal(before[n], after[n]) for n in trained if ".lora_B." in n)

    from transformers import AutoModelForCausalLM

    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).named_parameters())
    sent = dict(actor._weight_source().tensors())
    assert sent.keys() == base.keys()  # the base model's HF names, tied weights once
    layer = "model.layers.1.self_attn.q_proj"
    a, b = after[f"{layer}.lora_A.default.weight"], after[f"{layer}.lora_B.default.weight"]
    torch.testing.assert_close(sent[f"{layer}.weight"], base[f"{layer}.weight"] + 2.0 * (b @ a), rtol=0, atol=1e-6)
    assert not torch.equal(sent[f"{layer}.weight"], base[f"{layer}.weight"])
    assert torch.equal(sent["model.layers.1.self_attn.k_proj.weight"], base["model.layers.1.self_attn.k_proj.weight"])


def test_a_checkpoint_holds_the_adapters_and_resumes_them(tiny_model, tiny_task, tmp_path):
    actor = _actor(tiny_model, tiny_task, tmp_path)
    actor.train(0, _batch())
    actor.save(str(tmp_path / "ckpt"), 0)
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(tmp_path / "ckpt" / "iter_0000000" / "actor" / "dcp")).read_metadata()
    weights = [k for k in keys.state_dict_metadata if k.startswith("model.")]
    assert len(weights) == 12 and all(".lora_" in k for k in weights), [k for k in weights if ".lora_" not in k]

    resumed = _actor(tiny_model, tiny_task, tmp_path, load=str(tmp_path / "ckpt"))
    live = dict(actor.module.named_parameters())
    assert all(torch.equal(p, live[n]) for n, p in resumed.module.named_parameters())
    assert resumed.optimizer_steps == actor.optimizer_steps == 1
    assert actor.train(1, _batch(1))["train/grad_norm"] == pytest.approx(
        resumed.train(1, _batch(1))["train/grad_norm"], rel=1e-6
    )


def test_lora_flags_are_checked(tiny_model, tiny_task, tmp_path):
    train, _ = tiny_task
    base = tiny_train_flags(tiny_model, train, tmp_path / "out")
    with pytest.raises(ConfigError, match="--lora-target-modules names no module"):
        parse_args(base + ["--lora-rank", "4", "--lora-target-modules", ","])
    with pytest.raises(ConfigError, match="--save-lora-adapter"):
        parse_args(base + ["--save-lora-adapter"])  # without --lora-rank
    with pytest.raises(ValueError, match="--lora-target-modules no_such_proj"):
        _actor(tiny_model, tiny_task, tmp_path, "--lora-target-modules", "no_such_proj")
