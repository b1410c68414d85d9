"""MoE models on the torch backend, one worker on tiny random Qwen3-MoE and Mixtral checkpoints.

transformers 5 fuses each MoE layer's routed experts into two parameters and renames Mixtral's ``block_sparse_moe``,
so what the backend exports must be turned back into the checkpoint's names (``utils.hf_names``): SGLang, vLLM and
any HF tool load those. Checked here: the export's names and tensors are the checkpoint's before training, and
after a step the ``--save-hf`` folder, loaded by transformers itself, computes the trained module's logits. With
``--lora-target-modules all-linear`` peft puts adapters on the fused experts and the router as well; the merged
export equals peft's own merge of the saved adapter. (End to end at 2 workers: tests/e2e/test_lora.py.)
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from miles_async.arguments import parse_args
from miles_async.assets.tiny_model import make_tiny_model
from miles_async.backends.fsdp.actor import FSDPTrainActor
from tests.flag_helpers import tiny_train_flags
from tests.integration.test_data_parallel import _batch

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules", "all-linear"]


def _actor(model, tiny_task, tmp_path, *extra: str) -> FSDPTrainActor:
    train, _ = tiny_task
    cfg = parse_args(tiny_train_flags(model, train, tmp_path / "out", "--lr", "1e-2", *extra))
    return FSDPTrainActor(cfg.train, 0, 1, 10)


def _logits(model_or_path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = model_or_path
    if not isinstance(model, torch.nn.Module):
        model = AutoModelForCausalLM.from_pretrained(model_or_path, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_export_has_the_checkpoint_names_and_saves_a_folder_transformers_loads(tiny_task, tmp_path, arch):
    model = make_tiny_model(tmp_path / "model", seed=0, arch=arch)
    on_disk = load_file(model / "model.safetensors")
    actor = _actor(model, tiny_task, tmp_path)
    sent = dict(actor._weight_source().tensors())
    assert sent.keys() == on_disk.keys()  # each expert's projections, as the checkpoint has them
    assert all(torch.equal(sent[k], v) for k, v in on_disk.items())

    actor.train(0, _batch())
    actor.save_hf(str(tmp_path / "hf"))
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    assert saved.keys() == on_disk.keys()
    expert = "block_sparse_moe.experts.1.w1" if arch == "mixtral" else "mlp.experts.1.gate_proj"
    assert not torch.equal(saved[f"model.layers.0.{expert}.weight"], on_disk[f"model.layers.0.{expert}.weight"])
    ids = torch.tensor([[5, 9, 17, 30, 12, 7]])
    torch.testing.assert_close(_logits(tmp_path / "hf", ids), _logits(actor.module, ids), rtol=0, atol=1e-5)


def test_lora_on_an_moe_adapts_the_experts_and_exports_peft_s_merge(tiny_task, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = make_tiny_model(tmp_path / "model", seed=0, arch="qwen3_moe")
    actor = _actor(model, tiny_task, tmp_path, *LORA, "--save-lora-adapter")
    trained = {n for n, p in actor.module.named_parameters() if p.requires_grad}
    assert any(".mlp.experts." in n for n in trained) and any(".self_attn.q_proj." in n for n in trained)
    assert all(".lora_A." in n or ".lora_B." in n for n in trained)
    before = {n: p.detach().clone() for n, p in actor.module.named_parameters()}
    actor.train(0, _batch())
    moved = {n for n, p in actor.module.named_parameters() if not torch.equal(before[n], p)}
    assert moved and moved <= trained
    assert any(".mlp.experts." in n and ".lora_B." in n for n in moved)  # the experts' adapters learned

    actor.save_hf(str(tmp_path / "hf"))
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    base = load_file(model / "model.safetensors")
    assert saved.keys() == base.keys()
    # peft reads the adapter folder and merges it its own way: the reference does not go through our export.
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), str(tmp_path / "hf" / "adapter")
    ).merge_and_unload()
    from miles_async.utils.hf_names import checkpoint_named

    expected = dict(checkpoint_named(reference, reference.named_parameters()))
    assert expected.keys() == saved.keys()
    for k, v in expected.items():
        torch.testing.assert_close(saved[k], v, rtol=0, atol=1e-6, msg=k)
    changed = [k for k in saved if not torch.equal(saved[k], base[k])]
    assert any(".mlp.experts." in k for k in changed) and any(".self_attn." in k for k in changed)
