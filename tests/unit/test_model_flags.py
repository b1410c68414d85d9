"""Megatron-LM's model flags against config.json (miles_async/config/model.py).

The one mapping, config.json -> Megatron-LM flags, regenerates the MODEL_ARGS that slime, Miles and
scripts/models/*.sh publish for each model from that model's published config.json (dense, and MoE for
Qwen3-30B-A3B); transformers' own defaults for Mixtral and Qwen2-MoE map to their MoE layouts. A flag that
contradicts the checkpoint fails the run before anything starts, naming the flag, its value and the config's.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from miles_async.arguments import ConfigError, build_parser, parse_args
from miles_async.config.hf_to_megatron import megatron_args
from miles_async.config.model import effective_args, load_hf_config, mismatches
from tests.flag_helpers import minimal_flags
from tests.scripts.helpers import ROOT

CONFIGS = ROOT / "tests" / "scripts" / "model_configs"

# slime's scripts/models/*.sh (THUDM/slime): Megatron-LM's older --use-rotary-position-embeddings, no
# --max-position-embeddings (Megatron then uses --seq-length), and for Llama --rotary-scaling-factor, which is
# YaRN's factor and is accepted without effect (Megatron's llama3 factor --rope-scaling-factor defaults to 8).
SLIME_MODEL_ARGS = {
    "Qwen3-4B": "--swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 --num-attention-heads 32 "
    "--group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear "
    "--normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 "
    "--kv-channels 128 --qk-layernorm",
    "Qwen2.5-7B": "--swiglu --num-layers 28 --hidden-size 3584 --ffn-hidden-size 18944 --num-attention-heads 28 "
    "--group-query-attention --num-query-groups 4 --use-rotary-position-embeddings "
    "--disable-bias-linear --add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-06 "
    "--rotary-base 1000000 --vocab-size 152064 --untie-embeddings-and-output-weights",
    "Llama-3.1-8B": "--swiglu --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
    "--group-query-attention --num-query-groups 8 --max-position-embeddings 131072 "
    "--use-rotary-position-embeddings --disable-bias-linear --normalization RMSNorm "
    "--norm-epsilon 1e-5 --rotary-base 500000 --vocab-size 128256 --kv-channels 128 "
    "--use-rope-scaling --rotary-scaling-factor 8.0 --untie-embeddings-and-output-weights",
}
OUR_MODEL_ARGS = {"Qwen3-4B": "qwen3-4B", "Qwen2.5-7B": "qwen2.5-7B", "Llama-3.1-8B": "llama3.1-8B"}

# Qwen/Qwen3-30B-A3B's published config.json (tests/scripts/model_configs/README.md says where from), and the
# MODEL_ARGS slime and Miles publish for it.
QWEN3_30B_A3B = json.loads((CONFIGS / "Qwen3-30B-A3B" / "config.json").read_text())
QWEN3_30B_A3B_MODEL_ARGS = (
    "--disable-bias-linear --qk-layernorm --group-query-attention --num-attention-heads 32 --num-query-groups 4 "
    "--kv-channels 128 --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 --normalization RMSNorm "
    "--position-embedding-type rope --norm-epsilon 1e-6 --rotary-percent 1.0 --swiglu "
    "--untie-embeddings-and-output-weights --vocab-size 151936 --rotary-base 1000000 --moe-ffn-hidden-size 768 "
    "--moe-router-score-function softmax --moe-token-dispatcher-type alltoall --moe-router-topk 8 "
    f"--moe-layer-freq [{','.join(['1'] * 48)}] --num-experts 128 --moe-grouped-gemm --moe-token-drop-policy probs "
    "--moe-router-dtype fp32 --moe-permute-fusion --moe-aux-loss-coeff 0"
)


def test_our_qwen3_30b_a3b_model_args_are_miles_and_describe_the_published_config():
    words = _script_model_args("qwen3-30B-A3B")
    assert words == QWEN3_30B_A3B_MODEL_ARGS.split()
    assert mismatches(_namespace(words), QWEN3_30B_A3B, "config.json") == []


def _published(name: str) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text())


def _namespace(words: list[str]):
    ns, unknown = build_parser().parse_known_args(words)
    assert unknown == []
    return ns


def _script_model_args(name: str) -> list[str]:
    script = ROOT / "scripts" / "models" / f"{name}.sh"
    out = subprocess.run(
        ["bash", "-c", 'source "$1"; printf "%s\\0" "${MODEL_ARGS[@]}"', "_", str(script)],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    return out.split("\0")[:-1]


def _compared(words: list[str], hf: dict) -> dict:
    """The flags a command line gives, with their value and the mapping's, for the flags the mapping covers."""
    eff, wanted = effective_args(_namespace(words)), megatron_args(hf)
    return {k: (e.value, wanted[k]) for k, e in eff.items() if e.given and k in wanted}


@pytest.mark.parametrize("model", sorted(OUR_MODEL_ARGS))
@pytest.mark.parametrize("source", ["slime", "scripts/models"])
def test_the_mapping_regenerates_each_published_model_args(model, source):
    words = SLIME_MODEL_ARGS[model].split() if source == "slime" else _script_model_args(OUR_MODEL_ARGS[model])
    hf = _published(model)
    compared = _compared(words, hf)
    assert len(compared) >= 14, compared  # nearly every flag a launcher gives is one the mapping derives
    assert mismatches(_namespace(words), hf, "config.json") == []


def test_the_mapping_of_qwen3_4b_flag_by_flag():
    assert megatron_args(_published("Qwen3-4B")) == {
        "--num-layers": 36,
        "--hidden-size": 2560,
        "--ffn-hidden-size": 9728,
        "--num-attention-heads": 32,
        "--num-query-groups": 8,
        "--kv-channels": 128,
        "--swiglu": True,
        "--normalization": "RMSNorm",
        "--norm-epsilon": 1e-6,
        "--position-embedding-type": "rope",
        "--rotary-base": 1e6,
        "--rotary-percent": 1.0,
        "--use-rope-scaling": False,
        "--max-position-embeddings": 40960,
        "--vocab-size": 151936,
        "--untie-embeddings-and-output-weights": False,
        "--qk-layernorm": True,
        "--multi-latent-attention": False,
        "--add-qkv-bias": False,
        "--disable-bias-linear": True,
        "--num-experts": None,
    }


@pytest.mark.parametrize("model", sorted(OUR_MODEL_ARGS))
def test_config_json_and_transformers_defaults_map_alike(model):
    """The check reads config.json through transformers (defaults filled, rope_parameters in transformers 5);
    the raw published file maps to the same flags."""
    from miles_async.config.model import load_hf_config

    assert megatron_args(load_hf_config(str(CONFIGS / model))) == megatron_args(_published(model))


def test_llama3_rope_scaling_and_qwen2_biases():
    llama, qwen2 = megatron_args(_published("Llama-3.1-8B")), megatron_args(_published("Qwen2.5-7B"))
    assert llama["--use-rope-scaling"] and llama["--rope-scaling-factor"] == 8.0 and llama["--rotary-base"] == 5e5
    assert not llama["--add-qkv-bias"] and not llama["--qk-layernorm"]
    assert llama["--untie-embeddings-and-output-weights"]
    assert qwen2["--add-qkv-bias"] and qwen2["--disable-bias-linear"] and qwen2["--kv-channels"] == 128


def test_moe_models_map_to_megatron_moe_flags():
    qwen3_moe = megatron_args(QWEN3_30B_A3B)
    assert {
        k: qwen3_moe[k]
        for k in (
            "--num-experts",
            "--moe-router-topk",
            "--moe-ffn-hidden-size",
            "--ffn-hidden-size",
            "--moe-router-score-function",
        )
    } == {
        "--num-experts": 128,
        "--moe-router-topk": 8,
        "--moe-ffn-hidden-size": 768,
        "--ffn-hidden-size": 6144,
        "--moe-router-score-function": "softmax",
    }
    assert qwen3_moe["--moe-layer-freq"] == [1] * 48 and qwen3_moe["--qk-layernorm"]
    assert mismatches(_namespace(QWEN3_30B_A3B_MODEL_ARGS.split()), QWEN3_30B_A3B, "config.json") == []
    # Dense layers listed in mlp_only_layers, and a sparse step of 2, are 0s of --moe-layer-freq.
    assert megatron_args({**QWEN3_30B_A3B, "num_hidden_layers": 4, "mlp_only_layers": [0]})["--moe-layer-freq"] == [
        0,
        1,
        1,
        1,
    ]
    assert megatron_args({**QWEN3_30B_A3B, "num_hidden_layers": 4, "decoder_sparse_step": 2})["--moe-layer-freq"] == [
        0,
        1,
        0,
        1,
    ]
    from transformers import MixtralConfig, Qwen2MoeConfig

    mixtral = megatron_args(MixtralConfig().to_dict())  # transformers' defaults: Mixtral-8x7B's shape
    assert (mixtral["--num-experts"], mixtral["--moe-router-topk"], mixtral["--moe-ffn-hidden-size"]) == (8, 2, 14336)
    assert not mixtral["--qk-layernorm"] and not mixtral["--add-qkv-bias"]
    qwen2_moe = megatron_args(Qwen2MoeConfig().to_dict())
    assert qwen2_moe["--moe-shared-expert-intermediate-size"] == 5632 and qwen2_moe["--add-qkv-bias"]


def test_moe_flags_that_contradict_the_config_are_named():
    words = QWEN3_30B_A3B_MODEL_ARGS.replace("--moe-router-topk 8", "--moe-router-topk 2").split()
    assert mismatches(_namespace(words), QWEN3_30B_A3B, "m/config.json") == [
        "--moe-router-topk 2 does not match m/config.json: num_experts_per_tok 8 (that is --moe-router-topk 8)"
    ]
    dense_flags = SLIME_MODEL_ARGS["Qwen3-4B"].split()  # a dense description of an MoE checkpoint
    assert any(
        p.startswith(
            "--num-experts not given (Megatron-LM then uses None: a dense model) does not match "
            "m/config.json: num_experts 128"
        )
        for p in mismatches(_namespace(dense_flags), QWEN3_30B_A3B, "m/config.json")
    )


def test_a_mismatch_names_the_flag_its_value_and_the_configs():
    words = SLIME_MODEL_ARGS["Qwen3-4B"].replace("--num-layers 36", "--num-layers 28").split()
    assert mismatches(_namespace(words), _published("Qwen3-4B"), "m/config.json") == [
        "--num-layers 28 does not match m/config.json: num_hidden_layers 36 (that is --num-layers 36)"
    ]


@pytest.mark.parametrize(
    "drop, message",
    [
        (
            "--kv-channels 128",
            "--kv-channels not given (Megatron-LM then uses 80: --hidden-size / --num-attention-heads) "
            "does not match m/config.json: head_dim 128 (that is --kv-channels 128)",
        ),
        ("--swiglu", "no --swiglu does not match m/config.json: hidden_act silu (that is --swiglu)"),
        (
            "--group-query-attention",
            "--num-query-groups not given (Megatron-LM then uses 32: no --group-query-attention:"
            " every head its own group) does not match m/config.json: num_key_value_heads 8 "
            "(that is --num-query-groups 8)",
        ),
        (
            "--norm-epsilon 1e-6",
            "--norm-epsilon not given (Megatron-LM then uses 1e-05) does not match m/config.json: "
            "rms_norm_eps 1e-06 (that is --norm-epsilon 1e-06)",
        ),
        (
            "--use-rotary-position-embeddings",
            "--position-embedding-type not given (Megatron-LM then uses "
            "learned_absolute) does not match m/config.json: model_type qwen3 (that is "
            "--position-embedding-type rope)",
        ),
    ],
)
def test_a_flag_left_out_is_compared_in_megatrons_default(drop, message):
    """Without a flag Megatron-LM builds its default, which must be the checkpoint's too."""
    words = SLIME_MODEL_ARGS["Qwen3-4B"].replace(drop, "").split()
    assert mismatches(_namespace(words), _published("Qwen3-4B"), "m/config.json") == [message]


@pytest.mark.parametrize(
    "vocab, divisible_by, ok",
    [
        ("32001", "128", True),  # config.json's vocab_size
        ("32128", "128", True),  # that size after Megatron-LM's padding
        ("32064", "64", True),
        ("32064", "128", False),
        ("32000", "128", False),
    ],
)
def test_vocab_size_may_be_given_before_or_after_megatrons_padding(vocab, divisible_by, ok):
    hf = {**_published("Llama-3.1-8B"), "vocab_size": 32001}
    words = [
        *SLIME_MODEL_ARGS["Llama-3.1-8B"].replace("--vocab-size 128256", "").split(),
        "--vocab-size",
        vocab,
        "--make-vocab-size-divisible-by",
        divisible_by,
    ]
    problems = mismatches(_namespace(words), hf, "m/config.json")
    assert problems == (
        []
        if ok
        else [f"--vocab-size {vocab} does not match m/config.json: vocab_size 32001 (that is --vocab-size 32001)"]
    )


def test_parse_args_refuses_a_model_description_of_another_checkpoint(tmp_path):
    qwen3 = _published("Qwen3-4B")
    flags = minimal_flags(tmp_path, **{k: v for k, v in qwen3.items() if k != "model_type"}, model_type="qwen3")
    parse_args([*flags, "--num-rollout", "1", *SLIME_MODEL_ARGS["Qwen3-4B"].split()])  # its own description passes
    with pytest.raises(ConfigError) as e:
        parse_args([*flags, "--num-rollout", "1", *SLIME_MODEL_ARGS["Qwen2.5-7B"].split()])
    assert str(e.value).startswith(
        "the model flags do not describe --hf-checkpoint's model:\n  --num-layers 28 "
        f"does not match {tmp_path / 'model'}/config.json: num_hidden_layers 36"
    )


def test_without_model_flags_config_json_is_not_compared(tmp_path):
    """A launcher that describes no model (the CPU quickstart) leaves config.json to the backends; one that does
    has it read and compared."""
    flags = [*minimal_flags(tmp_path, model_type="not_a_transformers_model"), "--num-rollout", "1"]
    assert parse_args(flags).train.model_path == str(tmp_path / "model")
    with pytest.raises(ConfigError, match=r"^--hf-checkpoint: transformers cannot read .*/model/config.json"):
        parse_args([*flags, "--num-layers", "2"])


# GLM-4.5-Air's shape (zai-org/GLM-4.5-Air's config.json is not reachable here: these are the values its Megatron
# launchers give), through transformers' Glm4MoeConfig, and the MODEL_ARGS such a launcher passes for it.
GLM45_AIR = dict(
    vocab_size=151552,
    hidden_size=4096,
    intermediate_size=10944,
    num_hidden_layers=46,
    num_attention_heads=96,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    attention_bias=True,
    use_qk_norm=False,
    partial_rotary_factor=0.5,
    rope_theta=1000000.0,
    moe_intermediate_size=1408,
    n_routed_experts=128,
    n_shared_experts=1,
    num_experts_per_tok=8,
    first_k_dense_replace=1,
    routed_scaling_factor=1.0,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    tie_word_embeddings=False,
)
GLM45_AIR_MODEL_ARGS = (
    "--disable-bias-linear --add-qkv-bias --untie-embeddings-and-output-weights --num-layers 46 --hidden-size 4096 "
    "--ffn-hidden-size 10944 --num-attention-heads 96 --kv-channels 128 --group-query-attention --num-query-groups 8 "
    "--normalization RMSNorm --norm-epsilon 1e-5 --position-embedding-type rope --rotary-base 1000000 "
    "--rotary-percent 0.5 --swiglu --vocab-size 151552 --num-experts 128 --moe-router-topk 8 "
    "--moe-ffn-hidden-size 1408 --moe-shared-expert-intermediate-size 1408 --moe-layer-freq [0]*1+[1]*45 "
    "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 0.0 "
    "--moe-router-topk-scaling-factor 1.0 --moe-router-dtype fp32 --moe-router-num-groups 1 --moe-router-group-topk 1"
)


def test_glm45_maps_to_the_sigmoid_router_with_expert_bias_and_partial_rope():
    from transformers import Glm4MoeConfig

    hf = Glm4MoeConfig(**GLM45_AIR).to_dict()
    glm = megatron_args(hf)
    assert {k: glm[k] for k in ("--moe-router-score-function", "--moe-router-enable-expert-bias")} == {
        "--moe-router-score-function": "sigmoid",
        "--moe-router-enable-expert-bias": True,
    }
    assert glm["--moe-layer-freq"] == [0] + [1] * 45  # first_k_dense_replace 1
    assert glm["--moe-shared-expert-intermediate-size"] == 1408  # n_shared_experts x moe_intermediate_size
    assert glm["--rotary-percent"] == 0.5 and glm["--add-qkv-bias"] and glm["--disable-bias-linear"]
    assert not glm["--qk-layernorm"] and glm["--num-experts"] == 128
    assert mismatches(_namespace(GLM45_AIR_MODEL_ARGS.split()), hf, "config.json") == []
    # GLM-4.5 (355B) scales the chosen experts' weights by 2.5: a launcher that leaves it out builds another model.
    scaled = Glm4MoeConfig(**{**GLM45_AIR, "routed_scaling_factor": 2.5}).to_dict()
    assert mismatches(_namespace(GLM45_AIR_MODEL_ARGS.split()), scaled, "m/config.json") == [
        "--moe-router-topk-scaling-factor 1.0 does not match m/config.json: routed_scaling_factor 2.5 (that is "
        "--moe-router-topk-scaling-factor 2.5)"
    ]
    # A Qwen3-MoE description with GLM's router flags is refused: Qwen's router has no expert bias.
    words = (QWEN3_30B_A3B_MODEL_ARGS + " --moe-router-enable-expert-bias").split()
    assert mismatches(_namespace(words), QWEN3_30B_A3B, "m/config.json") == [
        "--moe-router-enable-expert-bias does not match m/config.json: model_type qwen3_moe (that is no "
        "--moe-router-enable-expert-bias)"
    ]


# Miles' scripts/models/deepseek-v3-5layer.sh (radixark/miles) with its 61 layers, as its comment says the full one
# differs; DeepSeek-R1's published config.json has DeepSeek-V3's architecture.
DEEPSEEK_V3_MODEL_ARGS = (
    "--disable-bias-linear --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 "
    "--kv-channels 128 --normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --swiglu "
    "--untie-embeddings-and-output-weights --vocab-size 129280 --multi-latent-attention --q-lora-rank 1536 "
    "--kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm "
    "--rotary-scaling-factor 40 --rotary-base 10000 --mscale 1.0 --mscale-all-dim 1.0 --attention-softmax-in-fp32 "
    f"--no-rope-fusion --num-experts 256 --moe-layer-freq [{','.join(['0'] * 3 + ['1'] * 58)}] "
    "--moe-ffn-hidden-size 2048 --moe-router-topk 8 --moe-shared-expert-intermediate-size 2048 "
    "--moe-router-pre-softmax --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
    "--moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0 "
    "--moe-router-bias-update-rate 0 --moe-router-group-topk 4 --moe-router-num-groups 8 --moe-grouped-gemm "
    "--moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32 --moe-permute-fusion"
)


def test_deepseek_v3_maps_to_multi_latent_attention_and_group_limited_routing():
    hf = _published("DeepSeek-R1")
    wanted = megatron_args(hf)
    mla = ("--q-", "--kv-l", "--qk-", "--v-", "--multi", "--mscale")
    assert {k: wanted[k] for k in wanted if k.startswith(mla)} == {
        "--multi-latent-attention": True, "--q-lora-rank": 1536, "--kv-lora-rank": 512, "--qk-head-dim": 128,
        "--qk-pos-emb-head-dim": 64, "--v-head-dim": 128, "--qk-layernorm": True, "--mscale": 1.0,
        "--mscale-all-dim": 1.0,
    }  # fmt: skip
    assert wanted["--rotary-scaling-factor"] == 40.0 and "--kv-channels" not in wanted
    assert (wanted["--moe-router-num-groups"], wanted["--moe-router-group-topk"]) == (8, 4)
    assert wanted["--moe-router-score-function"] == "sigmoid" and wanted["--moe-router-enable-expert-bias"]
    assert wanted["--moe-shared-expert-intermediate-size"] == 2048
    assert wanted["--moe-layer-freq"] == [0] * 3 + [1] * 58


def test_miles_deepseek_v3_model_args_describe_the_published_config_and_a_wrong_one_is_named():
    words = _script_model_args("deepseek-v3")
    assert words == DEEPSEEK_V3_MODEL_ARGS.split()
    hf = _published("DeepSeek-R1")
    assert len(_compared(words, hf)) >= 30
    assert mismatches(_namespace(words), hf, "config.json") == []
    wrong = [w if w != "1536" else "1024" for w in words]
    assert mismatches(_namespace(wrong), hf, "config.json") == [
        "--q-lora-rank 1024 does not match config.json: q_lora_rank 1536 (that is --q-lora-rank 1536)"
    ]
    ungrouped = words[: words.index("--moe-router-group-topk")] + words[words.index("--moe-grouped-gemm") :]
    assert [m.split(" does not")[0] for m in mismatches(_namespace(ungrouped), hf, "config.json")] == [
        "--moe-router-num-groups not given (Megatron-LM then uses None: no expert groups)",
        "--moe-router-group-topk not given (Megatron-LM then uses None: no expert groups)",
    ]


def test_yarn_flags_on_a_model_without_yarn_are_named_as_ignored(tmp_path):
    """slime's Llama launcher gives --rotary-scaling-factor, which is YaRN's (multi-latent attention models):
    accepted, and named once in a warning."""
    cfg = parse_args(minimal_flags(tmp_path) + ["--num-rollout", "1", "--rotary-scaling-factor", "8.0"])
    assert [w for w in cfg.warnings if w.startswith("--rotary-scaling-factor")] == [
        "--rotary-scaling-factor 8.0 is ignored: it only takes effect with a model with multi-latent attention and "
        "YaRN RoPE (DeepSeek-V3's rope_scaling)"
    ]


# The text model of Qwen3.5-35B-A3B's published config.json (Qwen/Qwen3.5-35B-A3B), nested under text_config as
# in every VLM wrapper (Qwen3-VL, Qwen3.6, Kimi-K2.5): trimmed to the keys the flags below are read from.
QWEN35_MOE_TEXT = dict(
    model_type="qwen3_5_moe_text", num_hidden_layers=40, hidden_size=2048, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    vocab_size=248320,
)  # fmt: skip


def _problems(tmp_path, words: list[str], **hf_config) -> list[str]:
    """The model flags parse_args names as not describing the config.json (none: it parsed)."""
    try:
        parse_args(minimal_flags(tmp_path, **hf_config) + ["--num-rollout", "1", *words])
    except ConfigError as e:
        return [line.strip() for line in str(e).replace(str(tmp_path), "TMP").splitlines()[1:]]
    return []


def _describing(hf: dict) -> list[str]:
    """The Megatron-LM flags that describe ``hf``, as a launcher writes them."""
    words = ["--group-query-attention"]  # without it Megatron-LM gives each head its own group
    for name, value in megatron_args(hf).items():
        if isinstance(value, list):
            words += [name, str(value)]
        elif value is True:
            words.append(name)
        elif value is not None and value is not False:
            words += [name, str(value)]
    return words


def test_a_nested_text_config_is_read_as_the_text_models(tmp_path):
    """--check-config on a VLM wrapper's config.json crashed with KeyError 'num_hidden_layers'; its text model is
    what the Megatron-LM flags describe, exactly as if its config.json were the text model's own."""
    nested = dict(model_type="qwen3_5_moe", text_config=QWEN35_MOE_TEXT, vision_config={"depth": 27})
    for words in (["--num-layers", "48", "--hidden-size", "2048"], ["--num-layers", "40", "--hidden-size", "1024"]):
        flat = _problems(tmp_path, words, **QWEN35_MOE_TEXT)
        assert _problems(tmp_path, words, **nested) == flat
    assert "--num-layers 48 does not match TMP/model/config.json: num_hidden_layers 40 (that is --num-layers 40)" in (
        _problems(tmp_path, ["--num-layers", "48"], **nested)
    )


def test_a_hybrid_models_layers_are_its_pattern_and_a_missing_key_is_named_not_a_traceback(tmp_path):
    """Nemotron-H's config.json counts its layers in hybrid_override_pattern (transformers drops
    num_hidden_layers); DeepSeek-V4's has no intermediate_size, so --ffn-hidden-size cannot be checked: a warning
    names the file and the key."""
    nemotron = dict(model_type="nemotron_h", num_hidden_layers=6, hybrid_override_pattern="M-M*-E", hidden_size=64,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128)  # fmt: skip
    layers = [p for p in _problems(tmp_path, ["--num-layers", "52"], **nemotron) if p.startswith("--num-layers")]
    assert layers == [
        "--num-layers 52 does not match TMP/model/config.json: num_hidden_layers 6 (that is --num-layers 6)"
    ]
    assert not [p for p in _problems(tmp_path, ["--num-layers", "6"], **nemotron) if p.startswith("--num-layers")]
    # Miles' MODEL_ARGS of Nemotron-3-Nano-4B (scripts/models/nemotron-3-nano-4b.py) against a dense hybrid config of
    # those sizes: no SwiGLU (squared ReLU) and no experts, although transformers fills in 8 for every Nemotron-H.
    nano = dict(model_type="nemotron_h", hybrid_override_pattern="M*-" * 14, hidden_size=3136, intermediate_size=12544,
                num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=131072,
                tie_word_embeddings=False, mlp_hidden_act="relu2")  # fmt: skip
    miles_nano = (
        "--disable-bias-linear --group-query-attention --num-attention-heads 40 --num-query-groups 8 --kv-channels 128 "
        "--num-layers 42 --hidden-size 3136 --ffn-hidden-size 12544 --normalization RMSNorm --position-embedding-type "
        "none --vocab-size 131072 --make-vocab-size-divisible-by 128 --untie-embeddings-and-output-weights"
    )
    assert _problems(tmp_path, miles_nano.split(), **nano) == []
    v4 = dict(model_type="deepseek_v4", num_hidden_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128)
    minimal_flags(tmp_path, **v4)
    words = [*_describing(load_hf_config(str(tmp_path / "model"))), "--ffn-hidden-size", "2048"]
    cfg = parse_args(minimal_flags(tmp_path, **v4) + ["--num-rollout", "1", *words])
    assert [w for w in cfg.warnings if w.startswith("--ffn-hidden-size")] == [
        f"--ffn-hidden-size 2048 is not checked: {tmp_path}/model/config.json (model_type deepseek_v4) has no "
        "'intermediate_size', which determines it"
    ]


# Miles' MODEL_ARGS for the attention of GLM-4.7-Flash (scripts/models/glm4.7-flash.sh), GLM-5
# (glm5-744B-A40B.sh) and DeepSeek-V3.2 (deepseek-v32.py), and the keys of each published config.json they
# describe (head_dim is the RoPE part of a query/key head; GLM-4.7-Flash's config gives none).
MLA_LAUNCHERS = {
    "glm4_moe_lite": (
        "--num-attention-heads 20 --kv-channels 192 --q-lora-rank 768 --kv-lora-rank 512 --qk-head-dim 192 "
        "--qk-pos-emb-head-dim 64 --v-head-dim 256",
        dict(hidden_size=2048, num_attention_heads=20, q_lora_rank=768, qk_nope_head_dim=192, v_head_dim=256),
    ),
    "glm_moe_dsa": (
        "--num-attention-heads 64 --kv-channels 192 --q-lora-rank 2048 --kv-lora-rank 512 --qk-head-dim 192 "
        "--qk-pos-emb-head-dim 64 --v-head-dim 256",
        dict(hidden_size=6144, num_attention_heads=64, head_dim=64, q_lora_rank=2048, qk_nope_head_dim=192,
             v_head_dim=256),
    ),
    "deepseek_v32": (
        "--num-attention-heads 128 --kv-channels 128 --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 "
        "--qk-pos-emb-head-dim 64 --v-head-dim 128",
        dict(hidden_size=7168, num_attention_heads=128, head_dim=64, q_lora_rank=1536, qk_nope_head_dim=128,
             v_head_dim=128),
    ),
}  # fmt: skip


@pytest.mark.parametrize("model_type", MLA_LAUNCHERS)
def test_mla_families_compare_their_latent_heads_not_kv_channels(tmp_path, model_type):
    """--kv-channels was compared with head_dim on these MLA families (a false mismatch on every Miles launcher of
    them); their heads are the MLA flags, which are compared, so a wrong --q-lora-rank is still named."""
    words, keys = MLA_LAUNCHERS[model_type]
    hf = dict(model_type=model_type, num_hidden_layers=2, kv_lora_rank=512, qk_rope_head_dim=64, **keys)
    attention = ("--kv-channels", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
                 "--v-head-dim")  # fmt: skip
    assert [p for p in _problems(tmp_path, words.split(), **hf) if p.startswith(attention)] == []
    wrong = words.replace(f"--q-lora-rank {keys['q_lora_rank']}", "--q-lora-rank 1024").split()
    assert [p for p in _problems(tmp_path, wrong, **hf) if p.startswith(attention)] == [
        f"--q-lora-rank 1024 does not match TMP/model/config.json: q_lora_rank {keys['q_lora_rank']} (that is "
        f"--q-lora-rank {keys['q_lora_rank']})"
    ]
