"""Multi-turn generation with tool calls on SGLang's real server (CPU): the scripted tiny model of
``tests/multi_turn_helpers.py`` calls a tool each turn, and the response is exactly the tokens SGLang sampled plus
the masked tool segments, with a weight version per token."""

from __future__ import annotations

import asyncio

import pytest

from miles_async.arguments import parse_args
from miles_async.config import SandboxConfig, ToolsConfig
from miles_async.inference.engines import make_engine_process
from miles_async.inference.router import make_router
from miles_async.rollout.generate import GenerateContext, encode_prompt
from miles_async.rollout.multi_turn import Toolbox, generate_multi_turn
from miles_async.rollout.sample import Sample, SampleStatus
from tests.multi_turn_helpers import make_scripted_model, tool_call_ids

SEGMENT = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def backend() -> str:
    return "sglang"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_scripted_model(tmp_path_factory.mktemp("scripted_model"))


def test_tool_turns_on_sglang(engine_python, model, tmp_path):
    from transformers import AutoTokenizer

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "add 2 and 3", "label": "5"}\n' * 2)
    cfg = parse_args(["--use-tis", "--hf-checkpoint", str(model), "--prompt-data", str(data),
                      "--rollout-batch-size", "1", "--num-rollout", "1", "--rm-type", "integer",
                      "--rollout-dtype", "float32", "--rollout-backend", "sglang", "--sglang-python", engine_python,
                      "--engine-startup-timeout", "400", "--output-dir", str(tmp_path / "out")])  # fmt: skip
    tok = AutoTokenizer.from_pretrained(str(model))
    box = Toolbox(ToolsConfig("tests.multi_turn_helpers.TOOLS", 2, 20.0, 200, 1, SandboxConfig(mode="none")))
    sample = Sample(uid="p0", group_index=0, index=0, prompt="add 2 and 3")
    sample.prompt_tokens = encode_prompt(tok, sample.prompt, True)
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 200}

    async def go(url: str) -> Sample:
        router = make_router([url], 120.0, backend="sglang", api_key=cfg.engine.api_key)
        try:
            return await generate_multi_turn(GenerateContext(router, tok, box), sample, params)
        finally:
            await router.close()

    try:
        with make_engine_process(cfg.engine, 0, str(tmp_path / "logs")) as proc:
            s = asyncio.run(go(proc.url))
    finally:
        box.close()
    turn = tool_call_ids(tok)
    segment = tok.encode(SEGMENT, add_special_tokens=False)
    assert s.response_tokens == turn + segment + turn
    assert s.loss_mask == [1] * len(turn) + [0] * len(segment) + [1] * len(turn)
    assert s.turns == 2 and s.status == SampleStatus.TRUNCATED  # the second turn still called a tool
    assert len(s.rollout_logprobs) == len(s.weight_versions) == s.response_length
    assert len(set(s.weight_versions)) == 1
    assert all(-1e-3 < lp <= 0.0 for lp, m in zip(s.rollout_logprobs, s.loss_mask, strict=True) if m)
