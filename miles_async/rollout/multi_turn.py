"""Multi-turn generation with tool calls: the generate function ``--tools-path`` selects.

How a sample is generated: the model writes an assistant turn; if the turn calls tools (``<tool_call>{"name":
..., "arguments": {...}}</tool_call>``, the Qwen / Hermes format), each call runs in the sample's own sandboxed
worker process (``rollout.tools``; killed when this call of the generate function returns) and the results are
appended as the chat template's tool message; the model then writes the next turn, until a turn calls no tool
(COMPLETED), ``--max-turns`` turns were written and the last still calls a tool (TRUNCATED), or the token budget
is spent (TRUNCATED).

Token ids are built incrementally: every model token in the response is exactly one the engine sampled, never a
re-tokenization of the conversation. Only the new tool segment is tokenized: the text the chat template adds
after the assistant turn (the end of the turn the model did not write itself, e.g. ChatML's newline after
``<|im_end|>``, the tool message, and the next assistant header), found as the difference between the template
rendered with and without the tool message. Model tokens have loss mask 1; tool tokens loss mask 0, rollout
log-prob 0.0 and the weight version of the turn before them, so every per-token list stays aligned with the
response.

A template with a tool role (Qwen2.5, Qwen3, Hermes: ``role == "tool"``, rendered as ``<tool_response>`` in a user
turn) gets ``{"role": "tool"}`` messages; a template without one (SmolLM2, plain ChatML) gets one user message
holding each result in ``<tool_response>...</tool_response>`` tags. A template that uses ``tools`` sees the
registry's JSON schemas in the prompt (the prompt is rendered again with ``tools=``); with any other template
the prompt must describe the tools itself.

Budget: all turns share ``max_new_tokens`` (``--rollout-max-response-len``): model and tool tokens together are at
most that many; each request asks for what is left, and a tool segment that does not fit is cut and the sample
ends TRUNCATED.

Partial rollouts (``--partial-rollout``): a turn aborted by an abort-mode pause comes back ABORTED with everything
so far (earlier turns, tool segments, the partial turn's tokens). Called again, this continues that turn (prompt
+ response as the engine's input, the budget shrunk by the response so far) and goes on with its tool calls and
further turns. The state needed is on the sample: its tokens, loss mask (the current turn is the tokens after
the last masked one) and ``turns``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

from miles_async.config.tools import ToolsConfig
from miles_async.rollout import routing
from miles_async.rollout.generate import GenerateContext, finish_status
from miles_async.rollout.sample import Sample, SampleStatus
from miles_async.rollout.sandbox import describe, probe
from miles_async.rollout.tools import ToolCall, ToolRunner, ToolSession, load_tools, parse_tool_calls, tool_schema

logger = logging.getLogger(__name__)
# Stands for the assistant's content when the template is rendered to find what surrounds a turn.
_TURN_MARK = "\x00turn\x00"
_DUMMY_USER = {"role": "user", "content": "?"}


class Toolbox:
    """The tools of one rollout process: the registry, its schemas and the runner that gives each sample a
    worker. Made at the rollout process's start, where it fails if the machine lacks the sandbox asked for."""

    def __init__(self, cfg: ToolsConfig):
        self.cfg = cfg
        self.tools = load_tools(cfg.path)
        self.schemas = [tool_schema(name, fn) for name, fn in self.tools.items()]
        probe(cfg.sandbox)
        logger.info("tool sandbox (--tool-sandbox) %s", describe(cfg.sandbox))
        self.runner = ToolRunner(cfg.path, cfg.timeout, cfg.max_output_chars, cfg.workers, cfg.sandbox)

    def session(self) -> ToolSession:
        return self.runner.session()

    async def run(self, session: ToolSession, call: ToolCall) -> str:
        """The call's result, or an error message for the model; a tool's failure never raises here."""
        if call.error is not None:
            return f"error: {call.error}"
        if call.name not in self.tools:
            return f"error: unknown tool '{call.name}'; the tools are: {', '.join(sorted(self.tools))}"
        return await session.call(call.name, call.arguments)

    def close(self) -> None:
        self.runner.close()


# -- the chat template ----------------------------------------------------------------------------------
def _template(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return " ".join(template.values()) if isinstance(template, dict) else template


def has_tool_role(tokenizer: Any) -> bool:
    """The template renders ``{"role": "tool"}`` messages itself (it compares a role with 'tool')."""
    return re.search(r"""['"]tool['"]""", _template(tokenizer)) is not None


def shows_tools(tokenizer: Any) -> bool:
    """The template renders the ``tools=`` schemas (it reads a ``tools`` variable)."""
    return re.search(r"\btools\b", _template(tokenizer)) is not None


def tool_messages(results: list[tuple[str, str]], tool_role: bool) -> list[dict[str, str]]:
    """The messages holding each (tool name, result): tool messages, or one user message with the results in
    ``<tool_response>`` tags when the template has no tool role."""
    if tool_role:
        return [{"role": "tool", "name": name, "content": content} for name, content in results]
    body = "\n".join(f"<tool_response>\n{content}\n</tool_response>" for _, content in results)
    return [{"role": "user", "content": body}]


def tool_segment_text(
    tokenizer: Any, messages: list[dict[str, str]], turn_text: str, template_kwargs: dict[str, Any] | None = None
) -> str:
    """The text to append after an assistant turn whose decoded text is ``turn_text``: what the template writes
    after the turn that the model did not (e.g. ChatML's newline after ``<|im_end|>``), the tool messages, and
    the header of the next assistant turn."""
    convo = [_DUMMY_USER, {"role": "assistant", "content": _TURN_MARK}]
    kwargs = template_kwargs or {}
    before = tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=False, **kwargs)
    after = tokenizer.apply_chat_template(convo + messages, tokenize=False, add_generation_prompt=True, **kwargs)
    if not after.startswith(before):
        raise ValueError(
            "the chat template renders earlier turns differently once a tool message follows, so a tool response "
            "cannot be appended to the tokens already generated; use a template that only appends"
        )
    turn_end = before[before.index(_TURN_MARK) + len(_TURN_MARK) :]
    written = max(k for k in range(len(turn_end) + 1) if turn_text.endswith(turn_end[:k]))
    return turn_end[written:] + after[len(before) :]


def prompt_with_tools(
    tokenizer: Any, prompt: Any, schemas: list[dict], template_kwargs: dict[str, Any] | None = None
) -> list[int]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    text = tokenizer.apply_chat_template(
        messages, tools=schemas, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
    )
    return tokenizer.encode(text, add_special_tokens=False)


# -- the sample ---------------------------------------------------------------------------------------------
def _current_turn(sample: Sample) -> list[int]:
    """The tokens of the turn being written: those after the last tool token (loss mask 0)."""
    mask = sample.loss_mask or []
    start = max((i + 1 for i, m in enumerate(mask) if m == 0), default=0)
    return sample.response_tokens[start:]


def _append_model_tokens(sample: Sample, out: dict) -> SampleStatus:
    meta = out["meta_info"]
    tokens = list(out["output_ids"])
    logprobs = [float(item[0]) for item in meta.get("output_token_logprobs") or []]
    versions = meta.get("output_token_weight_versions")
    versions = list(versions) if versions else [int(meta.get("weight_version", 0))] * len(tokens)
    sample.append_output(tokens, logprobs, versions)  # extends the loss mask with 1s
    return finish_status(meta)


def _append_tool_tokens(sample: Sample, tokens: list[int]) -> None:
    # The version of the generation they follow: tool tokens do not make a sample look staler than its model tokens.
    version = sample.weight_versions[-1] if sample.weight_versions else 0
    sample.response_tokens.extend(tokens)
    sample.rollout_logprobs.extend([0.0] * len(tokens))
    sample.weight_versions.extend([version] * len(tokens))
    sample.loss_mask.extend([0] * len(tokens))


def _start(ctx: GenerateContext, sample: Sample, box: Toolbox) -> None:
    """A fresh generation: no response, no turns; the prompt shows the tools if the template can."""
    sample.response_tokens, sample.rollout_logprobs, sample.weight_versions = [], [], []
    sample.response, sample.loss_mask, sample.turns = "", [], 0
    sample.routed_experts = None
    sample.started_at = time.time()
    if box.schemas and shows_tools(ctx.tokenizer):
        if sample.images:
            # The processor's own template with the tools, each image's placeholder expanded to its patches.
            from miles_async.vision.hf import encode_prompt as encode_with_images
            from miles_async.vision.images import load_image

            images = [load_image(r) for r in sample.images]
            kwargs = {**ctx.template_kwargs, "tools": box.schemas}
            sample.prompt_tokens = encode_with_images(ctx.processor, sample.prompt, images, True, kwargs)
        else:
            sample.prompt_tokens = prompt_with_tools(ctx.tokenizer, sample.prompt, box.schemas, ctx.template_kwargs)


async def generate_multi_turn(ctx: GenerateContext, sample: Sample, sampling_params: dict) -> Sample:
    """Generate (or, for an ABORTED sample, continue) one multi-turn conversation with tool calls; see the
    module docstring. Needs ``ctx.tools`` (``--tools-path``) and ``sampling_params['max_new_tokens']``."""
    box = ctx.tools
    if box is None:
        raise ValueError("generate_multi_turn needs a tool registry: give --tools-path")
    if "max_new_tokens" not in sampling_params:
        raise ValueError("generate_multi_turn needs sampling_params['max_new_tokens'], the budget of all turns")
    budget = int(sampling_params["max_new_tokens"])
    if sample.status != SampleStatus.ABORTED or sample.loss_mask is None:
        _start(ctx, sample, box)
    session = box.session()
    try:
        return await _turns(ctx, sample, sampling_params, box, session, budget)
    finally:
        await session.aclose()


async def _turns(
    ctx: GenerateContext, sample: Sample, sampling_params: dict, box: Toolbox, session: ToolSession, budget: int
) -> Sample:
    tool_role = has_tool_role(ctx.tokenizer)
    while True:
        left = budget - sample.response_length
        if left <= 0:
            sample.status = SampleStatus.TRUNCATED
            break
        params = {**sampling_params, "max_new_tokens": left}
        if sample.response_length:  # a lower bound on the length is the first request's only
            params.pop("min_new_tokens", None)
        # Every turn's request carries the prompt's images: the engine sees the whole conversation each time.
        extra = {"image_data": list(sample.images)} if sample.images else {}
        if ctx.routing is not None:
            extra.update(routing.request_fields(sample))
        out = await ctx.router.generate(sample.tokens, params, return_logprob=True, **extra)
        sample.status = _append_model_tokens(sample, out)
        if ctx.routing is not None:
            routing.record(sample, out, ctx.routing)
        if sample.status == SampleStatus.ABORTED:
            return sample  # continued when called again; nothing else to do now
        if sample.status != SampleStatus.COMPLETED:
            break
        sample.turns += 1
        turn_text = ctx.tokenizer.decode(_current_turn(sample), skip_special_tokens=False)
        calls = parse_tool_calls(turn_text)
        if not calls:
            break
        if sample.turns >= box.cfg.max_turns:
            sample.status = SampleStatus.TRUNCATED  # the model still wanted a tool: cut by --max-turns
            break
        outputs = await asyncio.gather(*(box.run(session, call) for call in calls))
        results = [(call.name, output) for call, output in zip(calls, outputs, strict=True)]
        text = tool_segment_text(ctx.tokenizer, tool_messages(results, tool_role), turn_text, ctx.template_kwargs)
        segment = ctx.tokenizer.encode(text, add_special_tokens=False)
        room = budget - sample.response_length
        _append_tool_tokens(sample, segment[:room])
        if len(segment) > room:
            sample.status = SampleStatus.TRUNCATED
            break
    sample.response = ctx.tokenizer.decode(
        sample.response_tokens, skip_special_tokens=sampling_params.get("skip_special_tokens", True)
    )
    sample.finished_at = time.time()
    return sample
