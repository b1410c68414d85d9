"""The roofline's accounting (benchmarks/roofline_core.py) against hand counts: what a matmul, a linear layer's forward
and backward, the CPU's attention kernel and a whole model's forward cost in FLOPs; the embedded engine's decode
bytes; the trainer's phases; and each phase's fraction taken against the measured bound of its kind and dtype.
Nothing here is timed."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks import roofline
from benchmarks import roofline_core as rc


def _counted(fn) -> int:
    with rc.flop_counter() as counter:
        fn()
    return counter.get_total_flops()


def test_a_matmul_is_two_flops_per_multiply_add_and_a_linear_layers_step_six_per_token_and_weight():
    m, k, n = 7, 11, 13
    assert _counted(lambda: torch.randn(m, k) @ torch.randn(k, n)) == rc.matmul_flops(m, k, n) == 2 * m * k * n
    tokens, layer = 5, torch.nn.Linear(k, n, bias=False)
    x = torch.randn(tokens, k, requires_grad=True)
    # forward, then the gradients of the input and of the weight: three matmuls of the same size
    assert _counted(lambda: layer(x).sum().backward()) == 6 * tokens * k * n


def test_the_cpus_attention_kernel_is_counted_forward_and_backward():
    b, h, s, d = 2, 3, 8, 4
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    forward = _counted(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert forward == 2 * (2 * b * h * s * s * d)  # q @ k^T and scores @ v, every score (masked or not)
    both = _counted(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward())
    assert both - forward == 5 * (2 * b * h * s * s * d)  # scores recomputed, then two matmuls per product


def test_a_models_forward_is_its_hand_count(tiny_model):
    cfg = AutoConfig.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa").eval()
    b, s = 3, 10
    h, i, v, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    head_dim = h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head_dim
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * i  # q, k and v, o, gate, up and down
    attention = layers * 2 * (2 * b * cfg.num_attention_heads * s * s * head_dim)
    expected = 2 * b * s * (layers * per_layer + h * v) + attention
    with torch.no_grad():
        assert _counted(lambda: model(input_ids=torch.randint(0, v, (b, s)))) == expected


def test_the_trainers_phases_count_forward_backward_and_the_optimizers_bytes(tiny_model, tiny_task):
    s = roofline.QUICK
    actor = roofline._actor(tiny_model, tiny_task[0], s, "float32", steps=2)
    from benchmarks.train_step import step_batch

    batch = step_batch(AutoConfig.from_pretrained(tiny_model).vocab_size, 0, s.prompts, s.samples, s.prompt_len, 4)
    old, ref, train, opt = rc.actor_phases(actor, batch, 0, "flops")
    assert old.flops > 0 and ref.flops == old.flops  # the reference model is the same network on the same batch
    # a backward costs two forwards' matmuls (attention's a bit more): training is about three forwards
    assert 3.0 <= train.flops / old.flops < 3.5
    params = sum(p.numel() for p in actor.module.parameters())
    assert opt.bytes == 28 * params and opt.flops == 0  # AdamW in fp32: 4 tensors read, 3 written; no matmul


def test_the_engines_decode_reads_the_weights_and_each_rows_cache_every_step(tiny_model):
    from miles_async.inference.embedded.engine import Engine

    engine = Engine(str(tiny_model), dtype=torch.float32, max_running_requests=8)
    engine.start()
    try:
        prompts, n, new = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16]], 3, 4
        prefill, decode = rc.engine_phases(engine, prompts, n, new, "flops")
    finally:
        engine.shutdown()
    cfg = engine.model.config
    # tied embeddings: the output projection's matrix is read once per step, the input's rows are free
    weights = 4 * sum(p.numel() for p in engine.model.parameters())
    kv_per_token = (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    )
    rows = len(prompts) * n
    # the first token comes from the prefill; decode step j reads contexts of 5 + j tokens in every row
    assert decode.bytes == sum(weights + kv_per_token * rows * (5 + j) for j in range(1, new))
    assert decode.tokens == rows * (new - 1) and prefill.tokens == rows * 5
    assert prefill.flops > 0 and prefill.bytes == 0 and decode.flops > 0


def test_a_phases_bound_is_the_roofline_of_the_measured_peak_of_its_dtype_and_the_bandwidth():
    limits = {"peaks": {"float32": 2e11, "bfloat16": 8e11}, "bandwidth": 3e10}
    phases = [
        rc.Phase("train fwd+bwd", "float32", flops=4e11, seconds=10.0),
        rc.Phase("prefill", "bfloat16", flops=4e11, seconds=10.0),
        # 6e10 B take 2 s at 3e10 B/s, 2e11 FLOP 1 s at 2e11 FLOP/s: the bytes bind
        rc.Phase("decode", "float32", flops=2e11, bytes=6e10, seconds=4.0),
        # 8e11 FLOP take 4 s, the same bytes 2 s: the FLOPs bind
        rc.Phase("decode, many rows", "float32", flops=8e11, bytes=6e10, seconds=5.0),
    ]
    train, prefill, decode, wide = roofline.phase_rows(phases, limits)
    assert (train["binding"], train["bound"], train["fraction"]) == ("compute", 2e11, 4e11 / 2e11 / 10.0)
    assert train["fraction"] == train["achieved"] / train["bound"] and train["goal"] == rc.COMPUTE_GOAL
    assert prefill["fraction"] == 4e11 / 8e11 / 10.0
    assert (decode["binding"], decode["bound"], decode["fraction"]) == ("memory", 3e10, 2.0 / 4.0)
    assert decode["achieved"] == 6e10 / 4.0 and decode["goal"] == rc.BANDWIDTH_GOAL
    assert (wide["binding"], wide["fraction"], wide["goal"]) == ("compute", 4.0 / 5.0, rc.COMPUTE_GOAL)


def test_the_gpu_script_runs_the_same_account_and_reports_mfu_and_tokens_per_second(tiny_model, tmp_path, capsys):
    """scripts/gpu/roofline.py is for a GPU machine; with --allow-cpu the same code runs here, in float32."""
    import json

    from scripts.gpu import roofline as gpu

    if not torch.cuda.is_available():  # it measured nothing: not a success
        assert gpu.main([]) == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    out = tmp_path / "roofline.json"
    assert gpu.main(["--allow-cpu", "--quick", "--model", str(tiny_model), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    phases = {r["phase"]: r for r in result["phases"]}
    train, opt = phases["train fwd+bwd"], phases["optimizer"]
    peak = result["limits"]["peaks"]["float32"]
    assert train["mfu"] == train["flops"] / train["seconds"] / peak
    assert result["peak_flops_per_s"] == peak
    assert result["train_mfu"] == train["flops"] / (train["seconds"] + opt["seconds"]) / peak
    assert result["train_tokens_per_s_per_gpu"] == train["tokens"] / (train["seconds"] + opt["seconds"])
    assert set(phases) == {"old log-probs", "reference forward", "train fwd+bwd", "optimizer"}
