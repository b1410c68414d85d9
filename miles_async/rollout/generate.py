"""Turning prompts into samples: tokenisation and the default per-sample generate function.

A custom generate function (``--custom-generate-function-path``) has the same signature as
``generate_sample``: ``async fn(ctx, sample, sampling_params) -> Sample``; see
``generate_sample`` for what it must do to support ``--partial-rollout``. Under ``--use-tis``
or ``--use-rollout-logprobs`` it must also fill ``rollout_logprobs`` with the engine's log-prob
of each response token (any number where the loss mask is 0): the trainer fails the step on a
sample whose trained tokens lack one.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from miles_async.inference.router import Router
from miles_async.rollout import routing
from miles_async.rollout.data_source import DataError, PromptItem
from miles_async.rollout.routing import RoutingShape
from miles_async.rollout.sample import Sample, SampleStatus

GenerateFn = Callable[["GenerateContext", Sample, dict], Awaitable[Sample]]

_FINISH = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


def finish_status(meta: dict) -> SampleStatus:
    """The status a generation's ``meta_info.finish_reason`` gives; an unknown reason is an error, never a sample
    silently marked failed (the engine clients name the engine that sent one: ``check_finish_reason``)."""
    reason = meta.get("finish_reason")
    status = _FINISH.get(reason.get("type")) if isinstance(reason, dict) else None
    if status is None:
        raise ValueError(f"unknown finish reason {reason!r} (expected a type of {', '.join(_FINISH)})")
    return status


@dataclass
class GenerateContext:
    router: Router
    tokenizer: Any
    tools: Any = None  # a rollout.multi_turn.Toolbox under --tools-path; None: no tools
    processor: Any = None  # a vision-language model's processor (vision/hf.py): image prompts' tokens
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # --apply-chat-template-kwargs
    routing: RoutingShape | None = None  # --use-rollout-routing-replay: samples record their experts (routing.py)


def encode_prompt(
    tokenizer: Any, prompt: Any, apply_chat_template: bool, template_kwargs: dict[str, Any] | None = None
) -> list[int]:
    if apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
        )
        return tokenizer.encode(text, add_special_tokens=False)
    if not isinstance(prompt, str):
        raise ValueError("a chat-message prompt needs --apply-chat-template")
    return tokenizer.encode(prompt)


def encode_item(
    tokenizer: Any,
    processor: Any,
    item: PromptItem,
    apply_chat_template: bool,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """A data source item's prompt tokens; with images, through the model's processor, each image's placeholder
    expanded to its patches. ``DataError`` naming the record when its images do not fit its prompt."""
    if not item.images:
        return encode_prompt(tokenizer, item.prompt, apply_chat_template, template_kwargs)
    from miles_async.vision.hf import PromptImageMismatch
    from miles_async.vision.hf import encode_prompt as encode_with_images
    from miles_async.vision.images import ImageError, load_image

    if processor is None:
        raise DataError(f"{item.where}: the prompt has images but the model has no vision tower (no vision_config)")
    try:
        images = [load_image(r) for r in item.images]
        return encode_with_images(processor, item.prompt, images, apply_chat_template, template_kwargs)
    except (PromptImageMismatch, ImageError, ValueError) as e:
        raise DataError(f"--prompt-data: {item.where}: {e}") from e


def apply_engine_output(sample: Sample, out: dict, append: bool = False) -> Sample:
    """Fill a sample from an SGLang-shaped /generate response.

    ``append``: the response continues the sample's tokens (a resumed partial rollout), so its
    tokens, log-probs and weight versions are added after the existing ones instead of
    replacing them.
    """
    meta = out["meta_info"]
    tokens = list(out["output_ids"])
    text = out.get("text", "")
    logprobs = [float(item[0]) for item in meta.get("output_token_logprobs") or []]
    versions = meta.get("output_token_weight_versions")
    versions = list(versions) if versions else [int(meta.get("weight_version", 0))] * len(tokens)
    if append:
        sample.append_output(tokens, logprobs, versions)
        sample.response += text
    else:
        sample.response_tokens, sample.response = tokens, text
        sample.rollout_logprobs, sample.weight_versions = logprobs, versions
    sample.status = finish_status(meta)
    return sample


def continuation_request(sample: Sample, sampling_params: dict) -> tuple[list[int], dict] | None:
    """The /generate input and sampling params that continue an aborted sample.

    The engine sees prompt + response so far as its prompt, and ``max_new_tokens`` (and
    ``min_new_tokens``) shrink by what was already generated, so the finished response obeys
    the original budget. None when the budget is already spent.
    """
    if "max_new_tokens" not in sampling_params:
        raise ValueError(
            "partial rollouts need an explicit sampling_params['max_new_tokens'] to know how many "
            "tokens a resumed sample may still generate"
        )
    remaining = sample.remaining_budget(int(sampling_params["max_new_tokens"]))
    if remaining <= 0:
        return None
    params = {**sampling_params, "max_new_tokens": remaining}
    if params.get("min_new_tokens"):
        params["min_new_tokens"] = max(0, int(params["min_new_tokens"]) - sample.response_length)
    return sample.tokens, params


async def generate_sample(ctx: GenerateContext, sample: Sample, sampling_params: dict) -> Sample:
    """Generate (or continue) one sample's response.

    A sample whose status is ABORTED is a partial rollout to continue: the engines were paused
    in abort mode and returned what they had. The rollout driver hands such a sample back only
    under ``--partial-rollout`` (otherwise it clears the response and resets the status first).
    Continuing means: request ``prompt_tokens + response_tokens`` with ``max_new_tokens``
    reduced by the tokens already generated (``continuation_request``), then APPEND the new
    tokens, log-probs and per-token weight versions (``apply_engine_output(..., append=True)``)
    and keep ``loss_mask``, if set, aligned with the response. If no budget is left, finish
    the sample as TRUNCATED without a request.

    A custom generate function supports partial rollouts by doing the same. One that does
    not should clear the response of an ABORTED sample and start over; it is then correct,
    only wasteful.
    """
    resuming = sample.status == SampleStatus.ABORTED
    if resuming:
        request = continuation_request(sample, sampling_params)
        if request is None:
            sample.status = SampleStatus.TRUNCATED
            sample.finished_at = time.time()
            return sample
        input_ids, params = request
    else:
        # A resumed sample keeps its first start time: the metrics measure the whole generation.
        sample.started_at = time.time()
        input_ids, params = sample.prompt_tokens, sampling_params
        sample.routed_experts = None
    extra = {"image_data": list(sample.images)} if sample.images else {}  # a text-only router need not take it
    if ctx.routing is not None:
        extra.update(routing.request_fields(sample))
    out = await ctx.router.generate(input_ids, params, return_logprob=True, **extra)
    apply_engine_output(sample, out, append=resuming)
    if ctx.routing is not None:
        routing.record(sample, out, ctx.routing)
    if resuming and ctx.tokenizer is not None:
        # Decoding pieces separately can split a multi-byte character at the resume point.
        sample.response = ctx.tokenizer.decode(
            sample.response_tokens, skip_special_tokens=params.get("skip_special_tokens", True)
        )
    sample.finished_at = time.time()
    return sample
