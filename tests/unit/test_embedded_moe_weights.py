"""The embedded engine takes an MoE model's weights as checkpoints name them (each expert's projections), the names
the trainers stream, though transformers 5 keeps the routed experts as fused parameters: each name lands in its
slice of the fused parameter, so the engine's model ends up as transformers' own load of the same checkpoint."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from miles_async.assets.tiny_model import make_tiny_model
from miles_async.inference.embedded.records import UnknownParameterError
from miles_async.inference.embedded.weights import copy_into_model, param_table, read_checkpoint


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_checkpoint_named_expert_weights_land_in_the_fused_parameters(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    make_tiny_model(tmp_path / "a", seed=0, arch=arch)
    make_tiny_model(tmp_path / "b", seed=1, arch=arch)
    on_disk = load_file(tmp_path / "b" / "model.safetensors")
    expert = "block_sparse_moe.experts.3.w3" if arch == "mixtral" else "mlp.experts.3.up_proj"
    assert f"model.layers.1.{expert}.weight" in on_disk  # the checkpoint's own names
    live = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float32).state_dict()
    assert not all(torch.equal(live.state_dict()[k], v) for k, v in reference.items())
    names = sorted(on_disk)
    for half in (names[: len(names) // 2], names[len(names) // 2 :]):  # in two buckets, as a stream sends them
        copy_into_model(live, {n: on_disk[n] for n in half})
    state = live.state_dict()
    assert state.keys() == reference.keys()
    for k, v in reference.items():
        assert torch.equal(state[k], v), k
    # Reading the folder takes the same names, without a from_pretrained of its own.
    assert read_checkpoint(live, str(tmp_path / "b"), torch.float32, "eager").keys() == on_disk.keys()
    with pytest.raises(UnknownParameterError):
        copy_into_model(live, {"model.layers.0.mlp.experts.4.gate_proj.weight": torch.zeros(32, 64)})
    assert "model.layers.0.mlp.experts.gate_up_proj" in param_table(live)
