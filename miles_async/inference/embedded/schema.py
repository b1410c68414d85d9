"""The embedded engine's side of SGLang's native API: a request body parsed and checked (``BadRequest`` names the
field), a result formatted as SGLang answers it. Pure: no HTTP, no engine."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from miles_async.inference import routed_experts
from miles_async.inference.embedded.records import GenerationResult, SamplingParams

# Sampling params we accept only at their neutral value: silently ignoring a
# penalty the caller relies on would change the rollout policy unnoticed.
_NEUTRAL_PARAMS: dict[str, float] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "n": 1,
}
# Accepted and ignored: they only shape text, which we barely produce.
_IGNORED_PARAMS = {"no_stop_trim", "spaces_between_special_tokens"}


class BadRequest(Exception):
    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def parse_sampling_params(raw: Any) -> SamplingParams:
    """Validate an SGLang ``sampling_params`` dict; raises ``BadRequest`` naming the field."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params", "must be an object")
    p = SamplingParams()
    for key, value in raw.items():
        name = f"sampling_params.{key}"
        if value is None:
            continue  # SGLang treats null as "use the default"
        if key == "temperature":
            if not _is_number(value) or value < 0:
                raise BadRequest(name, "must be a number >= 0")
            p.temperature = float(value)
        elif key == "top_p":
            if not _is_number(value) or not 0 < value <= 1:
                raise BadRequest(name, "must be in (0, 1]")
            p.top_p = float(value)
        elif key == "top_k":
            if not _is_int(value) or value == 0 or value < -1:
                raise BadRequest(name, "must be a positive int or -1 (disabled)")
            p.top_k = int(value)
        elif key == "max_new_tokens":
            if not _is_int(value) or value < 0:
                raise BadRequest(name, "must be an int >= 0")
            p.max_new_tokens = int(value)
        elif key == "min_new_tokens":
            if not _is_int(value) or value < 0:
                raise BadRequest(name, "must be an int >= 0")
            p.min_new_tokens = int(value)
        elif key == "stop_token_ids":
            if not isinstance(value, list) or not all(_is_int(t) for t in value):
                raise BadRequest(name, "must be a list of ints")
            p.stop_token_ids = [int(t) for t in value]
        elif key == "ignore_eos":
            if not isinstance(value, bool):
                raise BadRequest(name, "must be a bool")
            p.ignore_eos = value
        elif key == "skip_special_tokens":
            if not isinstance(value, bool):
                raise BadRequest(name, "must be a bool")
            p.skip_special_tokens = value
        elif key == "stop":
            if value not in ("", []):
                raise BadRequest(name, "string stops are not supported by the embedded engine; use stop_token_ids")
        elif key in _NEUTRAL_PARAMS:
            if not _is_number(value) or value != _NEUTRAL_PARAMS[key]:
                raise BadRequest(name, f"only the neutral value {_NEUTRAL_PARAMS[key]} is supported")
        elif key in _IGNORED_PARAMS:
            pass
        else:
            raise BadRequest(name, "unsupported sampling parameter")
    return p


@dataclass(frozen=True)
class GenerateRequest:
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    rid: str | None
    image_data: list[str]  # a VLM prompt's images (paths, data: URIs or base64), in placeholder order
    # Rollout routing replay: return each position's experts from routed_experts_start_len on (SGLang's fields).
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0


def parse_image_data(raw: Any) -> list[str]:
    """SGLang's ``image_data`` of one request: one image reference or a list of them (none: ``[]``)."""
    if raw is None or raw == []:
        return []
    refs = [raw] if isinstance(raw, str) else raw
    if not isinstance(refs, list) or not all(isinstance(r, str) and r for r in refs):
        raise BadRequest("image_data", "must be an image reference (path, data: URI or base64) or a list of them")
    return list(refs)


def parse_generate(body: dict[str, Any], vocab_size: int, context_len: int | None) -> GenerateRequest:
    """Validate a /generate body; raises ``BadRequest`` naming the offending field."""
    if "input_ids" not in body:
        raise BadRequest("input_ids", "is required (text prompts are not supported)")
    ids = body["input_ids"]
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids", "must be a non-empty list of ints (batched requests are not supported)")
    if not all(_is_int(t) and 0 <= t < vocab_size for t in ids):
        raise BadRequest("input_ids", f"must contain ints in [0, {vocab_size})")
    if context_len is not None and len(ids) >= context_len:
        raise BadRequest("input_ids", f"prompt of {len(ids)} tokens does not fit the context length {context_len}")
    params = parse_sampling_params(body.get("sampling_params"))
    return_logprob = body.get("return_logprob", False)
    if not isinstance(return_logprob, bool):
        raise BadRequest("return_logprob", "must be a bool")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest("rid", "must be a string")
    for key in ("text", "input_embeds", "stream"):
        if body.get(key):
            raise BadRequest(key, "is not supported by the embedded engine")
    routed = body.get("return_routed_experts", False)
    if not isinstance(routed, bool):
        raise BadRequest("return_routed_experts", "must be a bool")
    start = body.get("routed_experts_start_len", 0)
    if start is None:
        start = 0
    if not _is_int(start):
        raise BadRequest("routed_experts_start_len", "must be an int")
    if routed and not 0 <= start <= len(ids):
        raise BadRequest("routed_experts_start_len", f"{start} is outside [0, {len(ids)}] (the prompt's length)")
    return GenerateRequest(
        list(ids), params, return_logprob, rid, parse_image_data(body.get("image_data")), routed, int(start)
    )


def format_result(res: GenerationResult, return_logprob: bool) -> dict[str, Any]:
    finish: dict[str, Any] = {"type": res.finish_type}
    if res.finish_type == "stop":
        finish["matched"] = res.finish_matched
    elif res.finish_type == "length":
        finish["length"] = len(res.output_ids)
    meta: dict[str, Any] = {
        "id": res.rid,
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": len(res.output_ids),
        "cached_tokens": 0,
        "finish_reason": finish,
        "weight_version": res.weight_version,
        "output_token_weight_versions": res.output_weight_versions,
        "e2e_latency": res.e2e_latency,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(res.output_logprobs, res.output_ids)]
    if res.routed_experts is not None:
        meta["routed_experts"] = routed_experts.encode(res.routed_experts)
    return {"text": res.text, "output_ids": res.output_ids, "meta_info": meta}


def parse_version(value: Any, field: str) -> int | None:
    if value is None or value == "":
        return None
    if _is_int(value):
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise BadRequest(field, "must be an int")
