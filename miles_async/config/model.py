"""The model's architecture in Megatron-LM's flags (a launcher's ``MODEL_ARGS``), checked against the HF
``config.json`` of --hf-checkpoint.

Both backends build the policy from config.json, so these flags never choose the architecture: they are accepted
so that Miles and slime launchers run as written, and when a launcher describes the model (gives any of the
value flags below), the description must be the checkpoint's. Each flag is compared in the value Megatron-LM would
use: the one given, or Megatron-LM's default when it is not (e.g. no --swiglu means a GELU MLP, no --kv-channels
means hidden-size / heads). A mismatch fails before anything starts, naming the flag, its value and the config's.

``hf_to_megatron.megatron_args(hf)`` is the one mapping, config.json -> the value of each flag.

--vocab-size is the vocabulary before Megatron-LM pads it to a multiple of --make-vocab-size-divisible-by (x TP).
A launcher may give config.json's vocab_size, or that size already padded to a multiple of
--make-vocab-size-divisible-by: both describe the same checkpoint. Anything else is a mismatch. (The backends pad
config.json's vocab_size to a multiple of TP themselves and cut the logits back to it, so the padding is never
trained or sampled.)
"""

from __future__ import annotations

import argparse
import ast
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_async.config.declare import ConfigError, When, at_least, flag, group
from miles_async.config.hf_to_megatron import ROWS, config_source, megatron_args, read_rows, text_model, uses_yarn


# -- the flags, and the value Megatron-LM uses for each (given, or its default) ----------------------
@dataclass(frozen=True)
class Effective:
    """A flag's value as Megatron-LM would use it, and how to say so when it was not given."""

    value: Any
    given: bool
    default_note: str = ""


def _moe_freq(text: str | None, num_layers: int | None) -> list[int] | None:
    """--moe-layer-freq as a list of 0 (dense) / 1 (MoE) per layer: an int N (every N-th layer, from the first)
    or a Python list expression of 0s and 1s such as "[0]*3+[1]*45"."""
    if text is None:
        return None
    if text.strip().isdigit():
        n = int(text)
        return None if num_layers is None else [1 if i % n == 0 else 0 for i in range(num_layers)]
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ConfigError(f"--moe-layer-freq {text}: not an integer or a list expression such as [0]*3+[1]*45") from e
    allowed = (ast.Expression, ast.BinOp, ast.Add, ast.Mult, ast.List, ast.Tuple, ast.Constant, ast.Load)
    if not all(isinstance(node, allowed) for node in ast.walk(tree)):
        raise ConfigError(f"--moe-layer-freq {text}: not an integer or a list expression such as [0]*3+[1]*45")
    return [int(x) for x in eval(compile(tree, "--moe-layer-freq", "eval"), {"__builtins__": {}})]


def effective_args(ns: argparse.Namespace) -> dict[str, Effective]:
    """Each architecture flag as Megatron-LM would read this command line."""
    heads, hidden = ns.num_attention_heads, ns.hidden_size

    def value(name: str, default: Any = None, note: str = "") -> Effective:
        v = getattr(ns, _dest(name))
        return Effective(v, True) if v is not None else Effective(default, False, note)

    def switch(name: str) -> Effective:
        return Effective(bool(getattr(ns, _dest(name))), bool(getattr(ns, _dest(name))))

    groups = value("--num-query-groups", heads, "every head its own group")
    if not ns.group_query_attention:
        groups = Effective(heads, False, "no --group-query-attention: every head its own group")
    position = value("--position-embedding-type", "learned_absolute")
    if ns.use_rotary_position_embeddings and not position.given:
        position = Effective("rope", True)
    experts = value("--num-experts", None, "a dense model")
    out = {
        "--num-layers": value("--num-layers"),
        "--hidden-size": value("--hidden-size"),
        "--ffn-hidden-size": value("--ffn-hidden-size", 4 * hidden if hidden else None, "4 x --hidden-size"),
        "--num-attention-heads": value("--num-attention-heads"),
        "--num-query-groups": groups,
        "--kv-channels": value(
            "--kv-channels", hidden // heads if hidden and heads else None, "--hidden-size / --num-attention-heads"
        ),
        "--swiglu": switch("--swiglu"),
        "--normalization": value("--normalization", "LayerNorm"),
        "--norm-epsilon": value("--norm-epsilon", 1e-5),
        "--position-embedding-type": position,
        "--rotary-base": value("--rotary-base", 10000.0),
        "--rotary-percent": value("--rotary-percent", 1.0),
        "--max-position-embeddings": value("--max-position-embeddings"),
        "--vocab-size": value("--vocab-size"),
        "--untie-embeddings-and-output-weights": switch("--untie-embeddings-and-output-weights"),
        "--use-rope-scaling": switch("--use-rope-scaling"),
        "--rope-scaling-factor": value("--rope-scaling-factor", 8.0),
        "--qk-layernorm": switch("--qk-layernorm"),
        "--add-qkv-bias": switch("--add-qkv-bias"),
        "--disable-bias-linear": switch("--disable-bias-linear"),
        "--multi-latent-attention": switch("--multi-latent-attention"),
        "--q-lora-rank": value("--q-lora-rank", None, "queries without a low-rank projection"),
        "--kv-lora-rank": value("--kv-lora-rank", 32),
        "--qk-head-dim": value("--qk-head-dim", 128),
        "--qk-pos-emb-head-dim": value("--qk-pos-emb-head-dim", 64),
        "--v-head-dim": value("--v-head-dim", 128),
        "--rotary-scaling-factor": value("--rotary-scaling-factor", 1.0),
        "--mscale": value("--mscale", 1.0),
        "--mscale-all-dim": value("--mscale-all-dim", 0.0),
        "--num-experts": experts,
    }
    if experts.value is not None:
        ffn = out["--ffn-hidden-size"].value
        out.update(
            {
                "--moe-router-topk": value("--moe-router-topk", 2),
                "--moe-ffn-hidden-size": value("--moe-ffn-hidden-size", ffn, "--ffn-hidden-size"),
                "--moe-layer-freq": Effective(
                    _moe_freq(ns.moe_layer_freq or "1", ns.num_layers), ns.moe_layer_freq is not None, "every layer"
                ),
                "--moe-shared-expert-intermediate-size": value(
                    "--moe-shared-expert-intermediate-size", None, "no shared expert"
                ),
                "--moe-router-score-function": value("--moe-router-score-function", "softmax"),
                "--moe-router-enable-expert-bias": switch("--moe-router-enable-expert-bias"),
                "--moe-router-topk-scaling-factor": value(
                    "--moe-router-topk-scaling-factor", 1.0, "the chosen experts' weights unscaled"
                ),
                "--moe-router-num-groups": value("--moe-router-num-groups", None, "no expert groups"),
                "--moe-router-group-topk": value("--moe-router-group-topk", None, "no expert groups"),
            }
        )
    return out


# Megatron-LM's None for these means "no such part" (a dense model, no shared expert), which config.json may
# contradict; for every other flag a None default (--vocab-size, --max-position-embeddings, ...) means "taken from
# elsewhere", and the flag is compared only when given.
NONE_MEANS_ABSENT = (
    "--num-experts",
    "--moe-shared-expert-intermediate-size",
    "--q-lora-rank",
    "--moe-router-num-groups",
    "--moe-router-group-topk",
)


def _dest(name: str) -> str:
    return name.lstrip("-").replace("-", "_")


def _same(name: str, ours: Any, theirs: Any, ns: argparse.Namespace) -> bool:
    if name == "--vocab-size":
        multiple = ns.make_vocab_size_divisible_by
        return ours in (theirs, math.ceil(theirs / multiple) * multiple)
    if isinstance(theirs, float) or isinstance(ours, float):
        return ours is not None and math.isclose(float(ours), float(theirs), rel_tol=1e-9)
    return ours == theirs


def _shown(name: str, eff: Effective) -> str:
    if isinstance(eff.value, bool):
        return name if eff.value else f"no {name}"
    if eff.given:
        return f"{name} {eff.value}"
    note = f": {eff.default_note}" if eff.default_note else ""
    return f"{name} not given (Megatron-LM then uses {eff.value}{note})"


def _wanted(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return name if value else f"no {name}"
    return f"{name} {value}"


def mismatches(ns: argparse.Namespace, hf: Mapping[str, Any], where: str) -> list[str]:
    """Every architecture flag whose value (given, or Megatron-LM's default) contradicts config.json."""
    wanted = megatron_args(hf)
    problems = []
    for name, eff in effective_args(ns).items():
        if name not in wanted or (eff.value is None and not eff.given and name not in NONE_MEANS_ABSENT):
            continue
        if not _same(name, eff.value, wanted[name], ns):
            problems.append(
                f"{_shown(name, eff)} does not match {where}: {config_source(hf, ROWS[name].keys)} "
                f"(that is {_wanted(name, wanted[name])})"
            )
    return problems


def unchecked(ns: argparse.Namespace, hf: Mapping[str, Any], where: str) -> list[str]:
    """A warning for each architecture flag the launcher gave whose config.json key is missing (DeepSeek-V4's has
    no intermediate_size): that flag is not compared."""
    _, missing = read_rows(hf)
    given = {name: eff for name, eff in effective_args(ns).items() if eff.given and name in missing}
    model_type = text_model(hf).get("model_type")
    return [
        f"{_shown(name, eff)} is not checked: {where} (model_type {model_type}) has no {missing[name]!r}, which "
        f"determines it"
        for name, eff in given.items()
    ]


# -- the flags and the check ------------------------------------------------------------------------
def _archflag(name: str, type_: Callable | None = None, **options: Any):
    """An architecture flag: no default of its own (None, "not given"), so a launcher's value is told apart from
    Megatron-LM's default in messages."""
    if type_ is None:
        return flag(name, action="store_true", **options)
    return flag(name, type=type_, default=None, **options)


def hf_config_json(ns: argparse.Namespace) -> dict:
    """--hf-checkpoint's config.json as written; {} when there is none to read (--hf-checkpoint's own check names
    why). For the checks that must not wait on transformers (``load_hf_config`` fills in its defaults)."""
    if ns.hf_checkpoint is None:
        return {}
    try:
        return text_model(json.loads((Path(str(ns.hf_checkpoint)) / "config.json").read_text()))
    except (OSError, ValueError, AttributeError):
        return {}


def _yarn_model(ns: argparse.Namespace) -> bool:
    hf = hf_config_json(ns)
    return bool(hf) and uses_yarn(hf)


# --rotary-scaling-factor, --mscale and --mscale-all-dim describe YaRN; slime's Llama launcher gives
# --rotary-scaling-factor for Llama 3's own scaling, which is --use-rope-scaling --rope-scaling-factor.
YARN_MODEL = When("a model with multi-latent attention and YaRN RoPE (DeepSeek-V3's rope_scaling)", _yarn_model)

VALUE_FLAGS = (
    "--num-layers",
    "--hidden-size",
    "--ffn-hidden-size",
    "--num-attention-heads",
    "--num-query-groups",
    "--kv-channels",
    "--norm-epsilon",
    "--rotary-base",
    "--max-position-embeddings",
    "--vocab-size",
    "--num-experts",
)

GROUPS = (
    group(
        "model architecture (Megatron-LM's flags, checked against --hf-checkpoint's config.json)",
        _archflag(
            "--num-layers",
            int,
            check=at_least(1),
            help="transformer layers (Megatron-LM's spelling; checked against config.json's num_hidden_layers)",
        ),
        _archflag(
            "--hidden-size", int, check=at_least(1), help="hidden size (checked against config.json's hidden_size)"
        ),
        _archflag("--ffn-hidden-size", int, check=at_least(1), help="Megatron-LM's default: 4 x --hidden-size"),
        _archflag(
            "--num-attention-heads",
            int,
            check=at_least(1),
            help="attention heads (checked against config.json's num_attention_heads)",
        ),
        _archflag("--group-query-attention", help="grouped-query attention, with --num-query-groups key/value heads"),
        _archflag("--num-query-groups", int, check=at_least(1), help="with --group-query-attention"),
        _archflag(
            "--kv-channels",
            int,
            check=at_least(1),
            help="head dimension; Megatron-LM's default: --hidden-size / --num-attention-heads",
        ),
        _archflag("--swiglu", help="gated SiLU MLP (without it Megatron-LM builds a GELU MLP)"),
        _archflag(
            "--qk-layernorm", help="normalise queries and keys per head (Qwen3), as config.json's model type says"
        ),
        _archflag(
            "--disable-bias-linear",
            help="no biases on the linear layers (checked against config.json's attention_bias / mlp_bias)",
        ),
        _archflag("--add-qkv-bias", help="biases on the query/key/value projections only (Qwen2)"),
        _archflag("--normalization", str, choices=("LayerNorm", "RMSNorm"), help="Megatron-LM's default: LayerNorm"),
        _archflag("--norm-epsilon", float, help="Megatron-LM's default: 1e-5"),
        _archflag(
            "--position-embedding-type",
            str,
            choices=("learned_absolute", "rope", "yarn", "mrope", "relative", "none"),
            help="Megatron-LM's default: learned_absolute",
        ),
        _archflag(
            "--use-rotary-position-embeddings", help="Megatron-LM's older spelling of --position-embedding-type rope"
        ),
        _archflag("--rotary-base", float, help="RoPE theta; Megatron-LM's default: 10000"),
        _archflag("--rotary-percent", float, help="Megatron-LM's default: 1.0"),
        _archflag("--use-rope-scaling", help="llama3-style RoPE frequency scaling"),
        _archflag("--rope-scaling-factor", float, help="with --use-rope-scaling; Megatron-LM's default: 8.0"),
        _archflag(
            "--max-position-embeddings",
            int,
            check=at_least(1),
            help="the longest sequence (checked against config.json's max_position_embeddings)",
        ),
        _archflag(
            "--vocab-size",
            int,
            check=at_least(1),
            help="config.json's vocab_size, or that padded to --make-vocab-size-divisible-by",
        ),
        flag(
            "--make-vocab-size-divisible-by",
            type=int,
            default=128,
            check=at_least(1),
            help="Megatron-LM's vocabulary padding, used to compare --vocab-size with config.json (the backends "
            "pad the embedding to a multiple of TP and never train or sample the padding)",
        ),
        _archflag(
            "--untie-embeddings-and-output-weights",
            help="separate input embedding and output head (config.json's tie_word_embeddings false)",
        ),
        _archflag("--num-experts", int, check=at_least(1), help="MoE: experts per MoE layer"),
        _archflag("--moe-router-topk", int, check=at_least(1), help="MoE; Megatron-LM's default: 2"),
        _archflag("--moe-ffn-hidden-size", int, check=at_least(1), help="MoE; default: --ffn-hidden-size"),
        _archflag(
            "--moe-shared-expert-intermediate-size",
            int,
            check=at_least(1),
            help="MoE: the shared expert's hidden size (Qwen2-MoE)",
        ),
        _archflag("--moe-layer-freq", str, help="MoE: an int N (every N-th layer) or a list such as [0]*3+[1]*45"),
        _archflag(
            "--moe-router-score-function",
            str,
            choices=("softmax", "sigmoid"),
            help="MoE: the router's score function; Megatron-LM's default: softmax",
        ),
        _archflag(
            "--moe-router-enable-expert-bias",
            help="MoE: experts chosen by score plus a learned per-expert bias (GLM-4.5's e_score_correction_bias)",
        ),
        _archflag(
            "--moe-router-topk-scaling-factor",
            float,
            help="MoE: the chosen experts' weights scaled by it (config.json's routed_scaling_factor)",
        ),
        _archflag(
            "--moe-router-num-groups",
            int,
            check=at_least(1),
            help="MoE: group-limited routing's expert groups (DeepSeek-V3's n_group)",
        ),
        _archflag(
            "--moe-router-group-topk",
            int,
            check=at_least(1),
            help="MoE: the groups each token chooses its experts from (DeepSeek-V3's topk_group)",
        ),
        _archflag("--multi-latent-attention", help="multi-latent attention (DeepSeek-V3)"),
        _archflag(
            "--q-lora-rank", int, check=at_least(1), help="MLA: the queries' low rank (config.json's q_lora_rank)"
        ),
        _archflag("--kv-lora-rank", int, check=at_least(1), help="MLA: the keys' and values' latent (kv_lora_rank)"),
        _archflag("--qk-head-dim", int, check=at_least(1), help="MLA: each head's query/key part without RoPE"),
        _archflag("--qk-pos-emb-head-dim", int, check=at_least(1), help="MLA: each head's RoPE part"),
        _archflag("--v-head-dim", int, check=at_least(1), help="MLA: each head's value size"),
        _archflag(
            "--rotary-scaling-factor",
            float,
            effect_needs=YARN_MODEL,
            help="MLA: YaRN's scaling factor (config.json's rope factor)",
        ),
        _archflag("--mscale", float, effect_needs=YARN_MODEL, help="MLA: YaRN's mscale; Megatron-LM's default: 1.0"),
        _archflag(
            "--mscale-all-dim",
            float,
            effect_needs=YARN_MODEL,
            help="MLA: YaRN's mscale_all_dim; Megatron-LM's default: 0.0",
        ),
    ),
)


def describes_model(ns: argparse.Namespace) -> bool:
    """The launcher gave a model description (MODEL_ARGS): then every architecture flag is compared."""
    return any(getattr(ns, _dest(name)) is not None for name in VALUE_FLAGS)


def load_hf_config(path: str) -> dict[str, Any]:
    """config.json with every default transformers fills in, as the backends will read it."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path).to_dict()
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"--hf-checkpoint: transformers cannot read {path}/config.json: {e}") from e


def validate(ns: argparse.Namespace) -> list[str]:
    """A model description (MODEL_ARGS) that is not --hf-checkpoint's model fails here, naming each flag; the
    warnings for flags config.json cannot check."""
    if not describes_model(ns):
        return []
    where = f"{ns.hf_checkpoint}/config.json"
    hf = load_hf_config(ns.hf_checkpoint)
    problems = mismatches(ns, hf, where)
    if problems:
        raise ConfigError("the model flags do not describe --hf-checkpoint's model:\n  " + "\n  ".join(problems))
    return unchecked(ns, hf, where)
