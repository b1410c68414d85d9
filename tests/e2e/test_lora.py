"""LoRA end to end: a real run (embedded engine, Ray, the torch backend) trains only the adapters, learns the tiny
task, sends merged weights that the engine holds bit for bit, checkpoints only the adapters, and exports the merged
model and the adapter alone (loaded back by transformers and by peft)."""

from __future__ import annotations

import re

import torch

from tests.e2e.runner import run_train, tiny_args, without_rm_type

LEARN = ["--custom-rm-path", "tests.e2e.rewards:starts_with_digit", "--rollout-max-response-len", "2"]
# lr 5e-3: at 1e-2 every run's reward dipped at step 5 (each step overshot), and 1 run in about 40 learned to 0.66
# by step 6 and then collapsed to 0.23.
LORA = ["--lora-rank", "8", "--lora-alpha", "32", "--lr", "5e-3"]


def _sharper(tiny_model, out):
    """The tiny model with its (tied) embeddings x3. The random tiny model's logits stay within about +-1.3 of
    each other, so only training the head itself moves its samples; with frozen weights and adapters on the
    blocks, as LoRA trains, a model needs logits of a pretrained model's range to learn from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return out


def test_lora_learns_sends_merged_weights_and_exports_the_merged_model_and_the_adapter(tiny_model, tiny_task, tmp_path):
    hf, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    tiny_model = _sharper(tiny_model, tmp_path / "model")
    args = without_rm_type(
        tiny_args(
            tiny_model, tiny_task, tmp_path, *LEARN, *LORA, "--num-rollout", "12", "--check-weight-update-equal",
            "--save", str(ckpt), "--save-interval", "6", "--save-hf", str(hf), "--save-lora-adapter",
        )
    )  # fmt: skip
    run = run_train(args, tmp_path)
    assert run.returncode == 0, run.output[-3000:]
    rewards = [m["rollout/reward_mean"] for m in run.metrics]
    # Steps 7-12 against steps 1-2: over 10 runs the gain was 0.37-0.50 (a step's mean over 32 samples moves by
    # about 0.07 by chance, so 0.2 is about 3 of its standard deviations for a run that does not learn).
    assert len(rewards) == 12 and sum(rewards[6:]) / 6 > sum(rewards[:2]) / 2 + 0.2, rewards
    # Every update the engine loaded equals the trainer's merged tensors (the initial push and one per step).
    checked = [int(v) for v in re.findall(r"--check-weight-update-equal: version (\d+) identical", run.output)]
    assert checked == list(range(13)), checked

    # The checkpoint holds the adapters (and their optimizer state) only.
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(ckpt / "iter_0000011" / "actor" / "dcp")).read_metadata()
    weights = [k for k in metadata.state_dict_metadata if k.startswith("model.")]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights), weights[:5]

    # --save-hf: the merged model under the base model's names; with the adapter applied by peft to the base
    # model, the same logits.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert merged.state_dict().keys() == base.state_dict().keys()
    moved = [k for k, v in merged.state_dict().items() if not torch.equal(v, base.state_dict()[k])]
    assert moved and all(k.endswith("proj.weight") for k in moved), moved  # only adapted linear layers changed
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        trained_by = (base(ids).logits - merged(ids).logits).abs().max().item()
        adapted = PeftModel.from_pretrained(base, hf / "adapter")
        # float32 rounds x@(W + s*B@A) and x@W + s*(x@A)@B differently: up to 1.3e-5 on logits of about +-4 (seen
        # on CI's CPU). Training moved the logits by far more than the tolerance, so a wrong or missing adapter fails.
        assert trained_by > 1e-2, trained_by
        torch.testing.assert_close(adapted(ids).logits, merged(ids).logits, rtol=1e-4, atol=1e-4)


def test_lora_on_an_moe_at_two_workers_adapts_the_experts_and_sends_the_merge_under_checkpoint_names(
    tiny_task, tmp_path
):
    """The torch backend with FSDP2 over 2 workers on a tiny Qwen3-MoE, adapters on every projection peft's
    all-linear finds (attention, the fused experts, the router): the engine's weights equal the trainer's merged
    export after every update, and the --save-hf folder, under the checkpoint's per-expert names, is what peft's
    own merge of the saved adapter gives. With --use-rollout-routing-replay: the engine's routing of every sample
    reaches both workers, whose routers replay it (its agreement with their own choice is reported each step)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from miles_async.assets.tiny_model import make_tiny_model
    from miles_async.utils.hf_names import checkpoint_named

    model, hf = make_tiny_model(tmp_path / "model", seed=0, arch="qwen3_moe"), tmp_path / "hf"
    lora = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules", "all-linear", "--lr", "1e-2"]
    exports = ["--check-weight-update-equal", "--save-hf", str(hf), "--save-lora-adapter"]
    # starts_with_digit: with --rm-type first_integer a random tiny MoE scored every sample of both steps alike once
    # (2026-12-07): no advantage, no update, nothing to export
    reward = ["--custom-rm-path", "tests.e2e.rewards:starts_with_digit"]
    args = without_rm_type(tiny_args(model, tiny_task, tmp_path / "run", *lora, *reward, "--actor-num-gpus-per-node",
                                     "2", "--num-rollout", "2", "--use-rollout-routing-replay", *exports))  # fmt: skip
    run = run_train(args, tmp_path / "run")
    assert run.returncode == 0, run.output[-3000:]
    # Step 0 trains on a rollout of its own weights (float32 on both sides): they route alike but for rounding near
    # a tie. Step 1's rollout is a step older than the trainer (one-step-off), whose router has moved since.
    agreement = [m["train/routing_agreement"] for m in run.metrics]
    assert len(agreement) == 2 and agreement[0] > 0.99 and 0.5 < agreement[1] <= 1.0, agreement
    checked = [int(v) for v in re.findall(r"--check-weight-update-equal: version (\d+) identical", run.output)]
    assert checked == [0, 1, 2], checked

    saved, base = load_file(hf / "model.safetensors"), load_file(model / "model.safetensors")
    assert saved.keys() == base.keys()  # mlp.experts.<e>.gate_proj/up_proj/down_proj, as the checkpoint
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), str(hf / "adapter")
    ).merge_and_unload()
    for k, v in checkpoint_named(reference, reference.named_parameters()):
        torch.testing.assert_close(saved[k], v, rtol=0, atol=1e-6, msg=k)
    changed = [k for k in saved if not torch.equal(saved[k], base[k])]
    assert any(".mlp.experts." in k for k in changed), changed
