"""Turning prompts into samples: tokenisation and the default per-sample generate function.

A custom generate function (``--custom-generate-function-path``) has the same signature as
``generate_sample``: ``async fn(ctx, sample, sampling_params) -> Sample``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from miles_async.inference.router import Router
from miles_async.rollout.sample import Sample, SampleStatus

GenerateFn = Callable[["GenerateContext", Sample, dict], Awaitable[Sample]]

_FINISH = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


@dataclass
class GenerateContext:
    router: Router
    tokenizer: Any


def encode_prompt(tokenizer: Any, prompt: Any, apply_chat_template: bool) -> list[int]:
    if apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    if not isinstance(prompt, str):
        raise ValueError("a chat-message prompt needs --apply-chat-template")
    return tokenizer.encode(prompt)


def apply_engine_output(sample: Sample, out: dict) -> Sample:
    """Fill a sample from an SGLang-shaped /generate response."""
    meta = out["meta_info"]
    sample.response_tokens = list(out["output_ids"])
    sample.response = out.get("text", "")
    sample.rollout_logprobs = [float(item[0]) for item in meta.get("output_token_logprobs") or []]
    n = len(sample.response_tokens)
    versions = meta.get("output_token_weight_versions")
    sample.weight_versions = list(versions) if versions else [int(meta.get("weight_version", 0))] * n
    sample.status = _FINISH.get(meta["finish_reason"]["type"], SampleStatus.FAILED)
    return sample


async def generate_sample(ctx: GenerateContext, sample: Sample, sampling_params: dict) -> Sample:
    sample.started_at = time.time()
    out = await ctx.router.generate(sample.prompt_tokens, sampling_params, return_logprob=True)
    apply_engine_output(sample, out)
    sample.finished_at = time.time()
    return sample
