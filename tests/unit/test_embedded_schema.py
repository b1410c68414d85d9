"""The embedded engine's /generate body as SGLang's API defines it (inference/embedded/schema.py): each accepted
field lands in the request, and every field it cannot honour is refused naming the field, never silently ignored
(a penalty or a string stop the caller relies on would change the rollout policy unnoticed)."""

from __future__ import annotations

import pytest

from miles_async.inference.embedded.schema import BadRequest, parse_generate

VOCAB, CONTEXT = 50, 16


def test_a_full_body_is_parsed_field_by_field():
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 5,
            "max_new_tokens": 8,
            "min_new_tokens": 2,
            "stop_token_ids": [4],
            "ignore_eos": True,
            "skip_special_tokens": False,
            "stop": [],
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "n": 1,
            "no_stop_trim": True,
            "min_p": None,
        },
        "return_logprob": True,
        "rid": "r1",
        "image_data": "data:image/png;base64,AAAA",
    }
    req = parse_generate(body, VOCAB, CONTEXT)
    p = req.params
    assert (req.input_ids, req.return_logprob, req.rid, req.image_data) == ([1, 2, 3], True, "r1", [body["image_data"]])
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.min_new_tokens) == (0.7, 0.9, 5, 8, 2)
    assert (p.stop_token_ids, p.ignore_eos, p.skip_special_tokens) == ([4], True, False)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "input_ids: is required"),
        ({"input_ids": []}, "input_ids: must be a non-empty list"),
        ({"input_ids": [[1, 2]]}, "input_ids: must contain ints in [0, 50)"),
        ({"input_ids": [50]}, "input_ids: must contain ints in [0, 50)"),
        ({"input_ids": list(range(16))}, "input_ids: prompt of 16 tokens does not fit the context length 16"),
        ({"input_ids": [1], "sampling_params": [1]}, "sampling_params: must be an object"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature: must be a number"),
        ({"input_ids": [1], "sampling_params": {"temperature": float("nan")}}, "sampling_params.temperature"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p: must be in (0, 1]"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "sampling_params.top_k: must be a positive int or -1"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1.5}}, "sampling_params.max_new_tokens: must be"),
        ({"input_ids": [1], "sampling_params": {"min_new_tokens": -1}}, "sampling_params.min_new_tokens: must be"),
        ({"input_ids": [1], "sampling_params": {"stop_token_ids": [True]}}, "sampling_params.stop_token_ids"),
        ({"input_ids": [1], "sampling_params": {"ignore_eos": 1}}, "sampling_params.ignore_eos: must be a bool"),
        ({"input_ids": [1], "sampling_params": {"skip_special_tokens": "no"}}, "sampling_params.skip_special_tokens"),
        ({"input_ids": [1], "sampling_params": {"stop": "\n"}}, "sampling_params.stop: string stops are not"),
        ({"input_ids": [1], "sampling_params": {"presence_penalty": 0.5}}, "sampling_params.presence_penalty: only"),
        ({"input_ids": [1], "sampling_params": {"n": 2}}, "sampling_params.n: only the neutral value 1"),
        ({"input_ids": [1], "sampling_params": {"beam_width": 2}}, "sampling_params.beam_width: unsupported"),
        ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob: must be a bool"),
        ({"input_ids": [1], "rid": 3}, "rid: must be a string"),
        ({"input_ids": [1], "stream": True}, "stream: is not supported by the embedded engine"),
        ({"input_ids": [1], "text": "hi"}, "text: is not supported by the embedded engine"),
        ({"input_ids": [1], "image_data": ["", "x"]}, "image_data: must be an image reference"),
    ],
)
def test_a_field_it_cannot_honour_is_refused_naming_it(body, message):
    with pytest.raises(BadRequest) as refused:
        parse_generate(body, VOCAB, CONTEXT)
    assert str(refused.value).startswith(message), str(refused.value)
