"""--apply-chat-template-kwargs (Miles' flag): a JSON object given to every rendering of the chat template, as
Qwen3's launchers pass '{"enable_thinking": false}': the prompts a rollout sends (through RolloutContext, as
the executor builds it), the prompt that shows the tools and each tool turn of a multi-turn sample."""

from __future__ import annotations

import asyncio

import pytest

from miles_async.arguments import parse_args
from miles_async.rollout.data_source import PromptItem
from miles_async.rollout.generate import GenerateContext, generate_sample
from miles_async.rollout.multi_turn import prompt_with_tools, tool_segment_text
from miles_async.rollout.rollout import RolloutContext
from tests.flag_helpers import minimal_flags
from tests.multi_turn_helpers import QWEN_LIKE_TEMPLATE, build_tokenizer

# Qwen3's template writes an empty thinking block after the generation prompt when enable_thinking is false.
NO_THINKING = "<think>\n\n</think>\n\n"
TEMPLATE = QWEN_LIKE_TEMPLATE.replace(
    "{{ '<|im_start|>assistant\\n' }}",
    "{{ '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '" + NO_THINKING.replace("\n", "\\n") + "' }}{%- endif %}",
)
KWARGS = '{"enable_thinking": false}'


def _cfg(tmp_path, *extra: str):
    return parse_args([*minimal_flags(tmp_path), "--num-rollout", "1", *extra])


def _prompt_text(tokenizer, template_kwargs: dict) -> str:
    ctx = RolloutContext(
        data_source=None,
        generate_ctx=GenerateContext(None, tokenizer, template_kwargs=template_kwargs),
        generate_fn=generate_sample,
        reward=None,
        apply_chat_template=True,
        n_samples_per_prompt=1,
        sampling_params={},
        semaphore=asyncio.Semaphore(1),
    )
    return tokenizer.decode(ctx.prompt_tokens(PromptItem("p0", "what is 1 + 1?", "2", {})))


def test_the_kwargs_reach_the_rendered_prompt(tmp_path):
    tokenizer = build_tokenizer(TEMPLATE)
    cfg = _cfg(tmp_path, "--apply-chat-template", "--apply-chat-template-kwargs", KWARGS)
    assert cfg.rollout.data.chat_template_kwargs == {"enable_thinking": False}
    assert not [w for w in cfg.warnings if "--apply-chat-template-kwargs" in w]
    assert _prompt_text(tokenizer, cfg.rollout.data.chat_template_kwargs).endswith("assistant\n" + NO_THINKING)
    (tmp_path / "plain").mkdir()
    plain = _cfg(tmp_path / "plain", "--apply-chat-template")
    assert _prompt_text(tokenizer, plain.rollout.data.chat_template_kwargs).endswith("assistant\n")


def test_the_kwargs_reach_the_tool_prompt_and_each_tool_turn():
    tokenizer, kwargs = build_tokenizer(TEMPLATE), {"enable_thinking": False}
    schemas = [{"type": "function", "function": {"name": "sum", "parameters": {}}}]
    assert tokenizer.decode(prompt_with_tools(tokenizer, "1 + 1?", schemas, kwargs)).endswith(NO_THINKING)
    assert not tokenizer.decode(prompt_with_tools(tokenizer, "1 + 1?", schemas)).endswith(NO_THINKING)
    tool = [{"role": "tool", "name": "sum", "content": "2"}]
    assert tool_segment_text(tokenizer, tool, "<|im_end|>", kwargs).endswith("assistant\n" + NO_THINKING)


@pytest.mark.parametrize(("bad", "why"), [("{enable_thinking: false}", "is not JSON"), ("[1]", "not a JSON object")])
def test_a_value_that_is_not_a_json_object_is_refused_naming_the_flag(tmp_path, capsys, bad, why):
    with pytest.raises(SystemExit):
        _cfg(tmp_path, "--apply-chat-template", "--apply-chat-template-kwargs", bad)
    err = capsys.readouterr().err
    assert "argument --apply-chat-template-kwargs" in err and why in err, err


def test_without_the_chat_template_a_warning_names_the_flag(tmp_path):
    cfg = _cfg(tmp_path, "--apply-chat-template-kwargs", KWARGS)
    assert any(
        w.startswith("--apply-chat-template-kwargs") and "only takes effect with --apply-chat-template" in w
        for w in cfg.warnings
    ), cfg.warnings
