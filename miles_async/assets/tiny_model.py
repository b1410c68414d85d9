"""A tiny random causal LM plus an offline character-level tokenizer, for fast tests.

Everything is built locally from code (no hub, no downloads) in well under a
second, yet the folder is an ordinary HF model folder: AutoTokenizer,
AutoModelForCausalLM, chat templates and generation_config all behave as they
do for a real checkpoint, so the whole pipeline can be exercised cheaply.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
# Beyond the brief's digits/letters/operators: "\n" is required by the ChatML
# template itself and the punctuation lets ordinary prompts round-trip.
CHARACTERS = tuple("0123456789abcdefghijklmnopqrstuvwxyz") + tuple(" +-*=?\n.,:!'")

# ChatML without a default system prompt: every prompt token costs the tiny
# model context it cannot use.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# No qwen2: transformers 5's AutoTokenizer forces Qwen2Tokenizer for that
# model_type, which rebuilds a byte-level BPE pipeline from the vocab and
# silently drops this tokenizer's spaces and newlines. The MoE ones have 4
# experts of hidden size 32 in every layer, 2 routed per token (Qwen3-MoE with
# norm_topk_prob, as Qwen3-30B-A3B).
ARCHES = ("llama", "qwen3", "qwen3_moe", "mixtral")
TINY_MOE = dict(num_experts_per_tok=2)


def build_tiny_tokenizer():
    """A character-level PreTrainedTokenizerFast; input is lower-cased so any English prompt encodes."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    # WordLevel's default decoding joins tokens with spaces; characters must
    # be glued back together instead.
    backend.decoder = decoders.Fuse()
    # Registering the specials makes "<|im_start|>" one token instead of 12
    # characters, which the chat template relies on.
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=["</s>", "<|im_start|>"],
        model_max_length=512,
        chat_template=CHATML_TEMPLATE,
    )
    return tokenizer


def _tiny_config(arch: str, vocab_size: int, special_ids: dict[str, int], head_dim: int = 16, tied: bool = True):
    if 64 % head_dim or head_dim > 32:
        raise ValueError(f"head_dim {head_dim}: expected 16 or 32 (the hidden size is 64, with at least 2 heads)")
    heads = 64 // head_dim
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        **special_ids,
    )
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(head_dim=head_dim, **common)
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            head_dim=head_dim, num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, **TINY_MOE, **common
        )
    if arch == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(head_dim=head_dim, num_local_experts=4, **TINY_MOE, **{**common, "intermediate_size": 32})
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHES}")


def make_tiny_model(out_dir: Path, seed: int = 0, arch: str = "llama", head_dim: int = 16, tied: bool = True) -> Path:
    """Write a random tiny causal LM (hidden 64, 2 layers) with its tokenizer to ``out_dir``.

    The same ``seed``, ``arch``, ``head_dim`` and ``tied`` always give the same weights. ``head_dim`` 32 (2 query
    heads, 1 KV head) is for vLLM's CPU attention, which has no kernel for head size 16. ``tied`` False gives the
    model an output layer of its own, as Qwen3-30B-A3B has: SGLang's CPU server gave a tied tiny Qwen3-MoE uniform
    logits.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out_dir = Path(out_dir)
    tokenizer = build_tiny_tokenizer()
    special_ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = _tiny_config(arch, len(tokenizer), special_ids, head_dim, tied)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(**special_ids)

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _tidy_tokenizer_config(out_dir)
    return out_dir


def _tidy_tokenizer_config(out_dir: Path) -> None:
    # transformers 5 records its internal class name, which transformers 4
    # (used by some inference engines) cannot resolve; the public alias loads
    # in both.
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def make_tiny_task_dataset(
    out_dir: Path,
    n_train: int = 256,
    n_eval: int = 64,
    seed: int = 0,
    digits: Sequence[int] = tuple(range(1, 10)),
    parquet: bool = False,
) -> tuple[Path, Path]:
    """Write a "repeat <digit>" copy task: prompt ``"repeat 7"``, label ``"7"``.

    Scored by exact integer match on the response's first number
    (``--rm-type first_integer``). Why this task: it needs no knowledge, only
    the right digit at the start of the answer, so a random model already hits
    it by chance (about 3-8% of samples with 4-8 response tokens) and GRPO has
    a signal from the first step. How fast it is learned depends on the label
    set (measured with GRPO, 8 prompts x 4-8 samples, lr 3e-3, on the llama
    tiny model):

    - ``digits=(7,)``: only an output bias is needed; mean reward goes from
      ~0.06 to >0.5 within ~20 steps and greedy accuracy is 1.0 by ~40.
    - the default 1..9: the policy must copy the digit from the prompt, which
      needs attention to the prompt digit; within 300 steps reward stayed
      around chance (~0.05-0.2, drifting towards one constant digit). Use it to
      check plumbing and prompt/label pairing, not for "reward goes up"
      assertions (a format reward such as "starts with a digit", or
      ``digits=(7,)``, is the fast signal).

    0 is left out by default because "0000" also parses as 0, a shortcut that
    makes one label far easier than the others. Splits draw from the same
    digits, so eval checks learning rather than generalisation; uids are
    unique across both.
    """
    from miles_async.assets.arith_dataset import write_splits

    if not digits or any(not 0 <= d <= 9 for d in digits):
        raise ValueError(f"digits must be a non-empty set of 0..9, got {digits}")
    rng = random.Random(seed)

    def records(split: str, n: int) -> list[dict[str, str]]:
        # Cycling through the digits keeps every label equally represented
        # even in small splits; the shuffle keeps batches mixed.
        labels = [digits[i % len(digits)] for i in range(n)]
        rng.shuffle(labels)
        return [{"prompt": f"repeat {d}", "label": str(d), "uid": f"tiny-{split}-{i}"} for i, d in enumerate(labels)]

    return write_splits(Path(out_dir), records("train", n_train), records("eval", n_eval), parquet=parquet)
