"""For the multi-turn tests: tool registries (imported by real tool workers, so stdlib only at module level) and a
tiny "scripted" model that writes a tool call deterministically on a real engine.

The scripted model is a real Llama checkpoint whose next token depends only on the current one: embeddings are
one-hot, every layer's output projections are zero (so the residual stream is the embedding) and ``lm_head`` maps
each token to its successor with a margin of ~90 logits, so greedy and temperature-1 sampling both follow the
script. After a newline (the end of an assistant header) it writes

    <tool_call>{"name": "s u m", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>

where ``s``, ``u``, ``m`` are three separate character tokens although the vocabulary also holds ``sum`` as one
token: re-tokenizing the decoded text would merge them, so a response built by re-tokenization is told apart from
one built from the sampled ids. After ``!`` it writes ``ok<|im_end|>`` (no tool call); after anything else,
``<|im_end|>``.
"""

from __future__ import annotations

import os
import string
import time
from pathlib import Path

# -- tool registries ---------------------------------------------------------------------------------


def sum_tool(a: int, b: int) -> int:
    """Add two integers.

    Used by the scripted model's tool call."""
    return a + b


def hang(a: int, b: int) -> int:
    time.sleep(3600)
    return a + b


def crash(a: int, b: int) -> int:
    os._exit(3)


def echo(text: str, times: int = 1) -> str:
    return text * times


def boom() -> str:
    raise ValueError("no luck")


def chatty() -> dict:
    print("this goes to stderr, not into the protocol")
    return {"ok": True}


def spawn_and_hang() -> str:
    """Starts a child that would outlive a plain kill of the worker, then hangs."""
    import subprocess

    child = subprocess.Popen(["sleep", "3600"])
    Path(os.environ["MULTI_TURN_CHILD_PID_FILE"]).write_text(str(child.pid))
    time.sleep(3600)
    return "never"


TOOLS = {"sum": sum_tool}
HANGING = {"sum": hang}
CRASHING = {"sum": crash}
MANY = [echo, boom, chatty, hang, crash, spawn_and_hang]
NOT_A_REGISTRY = 42
EMPTY: dict = {}
NAMELESS = [lambda: 1]
NOT_CALLABLE = {"x": 3}

# -- the scripted model --------------------------------------------------------------------------------

SPECIALS = ("<pad>", "<unk>", "<s>", "<|im_end|>", "<|im_start|>")
CALL_HEAD = '{"name": "'
CALL_TAIL = '", "arguments": {"a": 2, "b": 3}}'
ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", CALL_HEAD, CALL_TAIL, "sum")
CHARS = tuple(string.printable[:95]) + ("\n",)
TOOL_CALL_SCRIPT = ("<tool_call>", CALL_HEAD, "s", "u", "m", CALL_TAIL, "</tool_call>", "<|im_end|>")
PLAIN_SCRIPT = ("o", "k", "<|im_end|>")
VOCAB = 128
HIDDEN = 128

# A Qwen2.5-like template: the tools in a system turn, tool messages as <tool_response> inside a user turn.
QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Plain ChatML (SmolLM2's shape): no tool role, no tools.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer(chat_template: str = QWEN_LIKE_TEMPLATE):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=4096,
        chat_template=chat_template,
    )
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in ADDED])
    assert len(tokenizer) <= VOCAB
    return tokenizer


def successor_ids(tokenizer) -> dict[int, int]:
    ids = tokenizer.convert_tokens_to_ids
    nxt = {i: tokenizer.eos_token_id for i in range(VOCAB)}
    for script, start in ((TOOL_CALL_SCRIPT, "\n"), (PLAIN_SCRIPT, "!")):
        chain = (start, *script)
        for a, b in zip(chain, chain[1:]):
            nxt[ids(a)] = ids(b)
    return nxt


def tool_call_ids(tokenizer) -> list[int]:
    """What the model samples for one tool-calling turn."""
    return [tokenizer.convert_tokens_to_ids(t) for t in TOOL_CALL_SCRIPT]


def make_scripted_model(out_dir: Path, chat_template: str = QWEN_LIKE_TEMPLATE) -> Path:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from miles_async.assets.tiny_model import _tidy_tokenizer_config

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(chat_template)
    special = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        **special,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(VOCAB, HIDDEN))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        head = torch.zeros(VOCAB, HIDDEN)
        for cur, nxt in successor_ids(tokenizer).items():
            head[nxt, cur] = 8.0
        model.lm_head.weight.copy_(head)
    model.generation_config = GenerationConfig(**special)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _tidy_tokenizer_config(out_dir)  # loadable by the engines' older transformers too
    return out_dir


# -- the scripted vision-language model ------------------------------------------------------------------------
# QWEN_LIKE_TEMPLATE whose user content may be a list of parts, an image part being Qwen2-VL's placeholder.
QWEN_LIKE_VLM_TEMPLATE = QWEN_LIKE_TEMPLATE.replace(
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}",
    "{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{ message.content }}{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'text' %}{{ part.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{ '<|im_end|>\\n' }}",
)


def make_scripted_vlm(out_dir: Path) -> Path:
    """The scripted model as a Qwen2-VL (a vision tower of one block, 4-pixel patches) with its processor: its
    language model follows the same script, and nothing the image holds changes what it writes, since every
    layer's output projections are zero. What a test of it checks is that images travel with every request."""
    import torch
    from tokenizers import AddedToken
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    from miles_async.assets.tiny_vlm import VISION_TOKENS, save_vlm, special_ids, vlm_token_ids

    assert QWEN_LIKE_VLM_TEMPLATE != QWEN_LIKE_TEMPLATE
    tokenizer = build_tokenizer(QWEN_LIKE_VLM_TEMPLATE)
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=True) for t in VISION_TOKENS], special_tokens=True)
    assert len(tokenizer) <= VOCAB
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            tie_word_embeddings=False,
            **special_ids(tokenizer),
        ),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=HIDDEN, num_heads=2, mlp_ratio=2, patch_size=4),
        tie_word_embeddings=False,
        **vlm_token_ids(tokenizer),
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).float()
    language = model.model.language_model
    with torch.no_grad():
        language.embed_tokens.weight.copy_(torch.eye(VOCAB, HIDDEN))
        for layer in language.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        language.norm.weight.fill_(1.0)
        head = torch.zeros(VOCAB, HIDDEN)
        for cur, nxt in successor_ids(tokenizer).items():
            head[nxt, cur] = 8.0
        model.lm_head.weight.copy_(head)
    return save_vlm(
        model, tokenizer, Path(out_dir), Qwen2VLProcessor, patch_size=4, min_pixels=8 * 8, max_pixels=32 * 32
    )
