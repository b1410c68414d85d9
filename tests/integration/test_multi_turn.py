"""Multi-turn generation with tool calls against a real embedded engine and real tool worker processes.

The engine serves the scripted tiny model of ``tests/multi_turn_helpers.py``: after an assistant header it writes
a ``<tool_call>`` to ``sum`` (with ``sum`` sampled as three character tokens, which re-tokenizing the text would
merge into one), then ``<|im_end|>``; so every turn calls the tool again and the expected response is known to the
token.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import ray
import requests

from benchmarks.engine_doubles import fixed_step_cost_env
from miles_async.arguments import parse_args
from miles_async.config import EngineConfig, SandboxConfig, ToolsConfig
from miles_async.inference.auth import auth_headers
from miles_async.inference.embedded.client import EmbeddedEngineClient
from miles_async.inference.embedded.launcher import EmbeddedEngineProcess
from miles_async.inference.router import make_router
from miles_async.ray.rollout_executor import RolloutExecutor
from miles_async.rollout.generate import GenerateContext, encode_prompt
from miles_async.rollout.multi_turn import Toolbox, generate_multi_turn, prompt_with_tools
from miles_async.rollout.rollout import RolloutContext, generate_one
from miles_async.rollout.sample import Sample, SampleStatus
from miles_async.utils.api_key import new_api_key
from tests.multi_turn_helpers import CHATML_TEMPLATE, make_scripted_model, make_scripted_vlm, tool_call_ids
from tests.sandbox_helpers import TIGHT, require_namespaces

H = "tests.multi_turn_helpers"
PROMPT = "add 2 and 3"
NO_SANDBOX = SandboxConfig(mode="none")  # what these test is not the sandbox (test_tool_sandbox.py is): any machine
STEP_SECONDS = 0.04  # per decode step, so an abort-mode pause can land inside a turn
# The tool turn the Qwen-like template adds after a turn ending in <|im_end|>, for a result R.
QWEN_SEGMENT = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


KEY = new_api_key()  # the engine's key, which every call below sends


class SlowEngine(EmbeddedEngineProcess):
    def env(self) -> dict:
        return {**super().env(), **fixed_step_cost_env(STEP_SECONDS)}


class ZeroReward:
    async def score(self, sample: Sample) -> float:
        return 0.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_scripted_model(tmp_path_factory.mktemp("scripted_model"))


def _serving(engine_cls: type, model, logs) -> Iterator[EmbeddedEngineProcess]:
    """An embedded engine serving ``model`` (float32, one thread, the module's API key) for a fixture's length."""
    cfg = EngineConfig(
        backend="embedded",
        model_path=str(model),
        num_engines=1,
        dtype="float32",
        max_running_requests=8,
        num_threads=1,
        host="127.0.0.1",
        startup_timeout=120.0,
        request_timeout=60.0,
        seed=0,
        api_key=KEY,
    )
    proc = engine_cls(cfg, 0, str(logs))
    proc.start()
    try:
        proc.wait_healthy(120)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    yield from _serving(SlowEngine, model, tmp_path_factory.mktemp("engine_logs"))


@pytest.fixture(scope="module")
def qwen_tok(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


@pytest.fixture(scope="module")
def chatml_tok(model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    tok.chat_template = CHATML_TEMPLATE
    return tok


@pytest.fixture
def toolbox():
    made = []

    def make(registry="TOOLS", max_turns=3, timeout=20.0, sandbox=NO_SANDBOX, module=H):
        made.append(Toolbox(ToolsConfig(f"{module}.{registry}", max_turns, timeout, 200, 2, sandbox)))
        return made[-1]

    yield make
    for box in made:
        box.close()


def _sample(tok, prompt=PROMPT, chat=True) -> Sample:
    return Sample(uid="p0", group_index=0, index=0, prompt=prompt, prompt_tokens=encode_prompt(tok, prompt, chat))


def _params(budget: int = 200) -> dict:
    return {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": budget}


def _generate(url, tok, box, sample, params) -> Sample:
    async def go():
        router = make_router([url], 60.0, api_key=KEY)
        try:
            return await generate_multi_turn(GenerateContext(router, tok, box), sample, params)
        finally:
            await router.close()

    return asyncio.run(go())


def _expected(tok, results: list[str], last_turn: bool = True) -> tuple[list[int], list[int]]:
    """Tokens and loss mask of len(results) tool turns (each followed by its tool segment), then a last turn."""
    turn = tool_call_ids(tok)
    tokens, mask = [], []
    for result in results:
        segment = tok.encode(QWEN_SEGMENT.format(result), add_special_tokens=False)
        tokens += turn + segment
        mask += [1] * len(turn) + [0] * len(segment)
    if last_turn:
        tokens, mask = tokens + turn, mask + [1] * len(turn)
    return tokens, mask


def _check_aligned(s: Sample) -> None:
    n = s.response_length
    assert len(s.loss_mask) == len(s.rollout_logprobs) == len(s.weight_versions) == n
    for m, lp in zip(s.loss_mask, s.rollout_logprobs, strict=True):
        # The scripted model is certain of each token it writes; tool tokens carry 0.0.
        assert lp == 0.0 if m == 0 else (math.isfinite(lp) and -1e-3 < lp <= 0.0)


def test_tool_turns_are_the_sampled_tokens_plus_masked_tool_segments(engine, qwen_tok, toolbox):
    box = toolbox(max_turns=3)
    s = _generate(engine.url, qwen_tok, box, _sample(qwen_tok), _params())
    # The template reads `tools`: the prompt was rendered again with the registry's schema.
    prompt = qwen_tok.decode(s.prompt_tokens, skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>system\n<tools>\n") and '"name": "sum"' in prompt
    assert prompt.endswith("<|im_start|>user\nadd 2 and 3<|im_end|>\n<|im_start|>assistant\n")
    tokens, mask = _expected(qwen_tok, ["5", "5"])
    assert s.response_tokens == tokens and s.loss_mask == mask
    # Re-tokenizing the conversation would have merged the sampled s, u, m into the one token "sum".
    text = qwen_tok.decode(s.response_tokens, skip_special_tokens=False)
    assert qwen_tok.encode(text, add_special_tokens=False) != s.response_tokens
    assert s.turns == 3 and s.status == SampleStatus.TRUNCATED  # the third turn still called a tool: --max-turns
    assert s.weight_versions == [0] * s.response_length
    _check_aligned(s)
    assert "<tool_response>\n5\n</tool_response>" in s.response and "<|im_end|>" not in s.response


@pytest.fixture(scope="module")
def vlm_engine(tmp_path_factory):
    model = make_scripted_vlm(tmp_path_factory.mktemp("scripted_vlm"))
    for proc in _serving(EmbeddedEngineProcess, model, tmp_path_factory.mktemp("vlm_engine_logs")):
        yield model, proc


def test_an_image_in_the_first_turn_goes_with_every_turn(vlm_engine, toolbox, tmp_path):
    """A VLM conversation with tools: the prompt is rendered by the processor with the tools and the image's
    placeholders expanded, and every turn's request carries the image (the engine refuses placeholders sent
    without it), so the tool turns come out as for a text prompt."""
    from PIL import Image

    from miles_async.vision.hf import load_processor

    model, proc = vlm_engine
    Image.new("RGB", (16, 16), (200, 30, 30)).save(tmp_path / "red.png")
    processor = load_processor(str(model))
    tok = processor.tokenizer
    sample = Sample(
        uid="v0", group_index=0, index=0, prompt=PROMPT, prompt_tokens=[], images=[str(tmp_path / "red.png")]
    )

    async def go():
        router = make_router([proc.url], 60.0, api_key=KEY)
        try:
            ctx = GenerateContext(router, tok, toolbox(max_turns=2), processor=processor)
            return await generate_multi_turn(ctx, sample, _params())
        finally:
            await router.close()

    s = asyncio.run(go())
    prompt = tok.decode(s.prompt_tokens, skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>system\n<tools>\n") and '"name": "sum"' in prompt
    # 16x16 pixels: 4x4 patches of 4, merged 2x2 into 4 image tokens.
    assert "<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>add 2 and 3" in prompt
    tokens, mask = _expected(tok, ["5"])
    assert s.response_tokens == tokens and s.loss_mask == mask
    assert s.turns == 2 and s.status == SampleStatus.TRUNCATED
    _check_aligned(s)


def test_a_template_without_a_tool_role_gets_the_results_as_a_user_message(engine, chatml_tok, toolbox):
    sample = _sample(chatml_tok)
    prompt_tokens = list(sample.prompt_tokens)
    s = _generate(engine.url, chatml_tok, toolbox(max_turns=2), sample, _params())
    assert s.prompt_tokens == prompt_tokens  # no `tools` in this template: the prompt is left as it was
    # ChatML renders the fallback user message exactly as the Qwen-like template renders a tool message.
    tokens, mask = _expected(chatml_tok, ["5"])
    assert s.response_tokens == tokens and s.loss_mask == mask
    assert s.turns == 2 and s.status == SampleStatus.TRUNCATED


def test_a_turn_without_a_tool_call_ends_the_conversation(engine, chatml_tok, toolbox):
    box = toolbox()
    s = _generate(engine.url, chatml_tok, box, _sample(chatml_tok, "say ok!", chat=False), _params())
    assert s.response == "ok" and s.response_length == 3  # o, k, <|im_end|>
    assert s.status == SampleStatus.COMPLETED and s.turns == 1 and s.loss_mask == [1, 1, 1]
    assert box.runner.worker_pids() == []  # no tool ran


@pytest.mark.parametrize(
    "registry, error",
    [
        ("HANGING", "error: tool 'sum' timed out after 1 s (--tool-timeout) and was killed"),
        ("CRASHING", "error: tool 'sum' crashed (its worker process exited with code 3)"),
    ],
)
def test_a_hanging_or_crashing_tool_costs_one_turn(engine, qwen_tok, toolbox, registry, error):
    box = toolbox(registry, max_turns=3, timeout=1.0)
    s = _generate(engine.url, qwen_tok, box, _sample(qwen_tok), _params(1000))  # room for two error messages
    tokens, mask = _expected(qwen_tok, [error, error])
    assert s.response_tokens == tokens and s.loss_mask == mask  # the conversation went on after each failure
    assert s.turns == 3 and s.status == SampleStatus.TRUNCATED
    assert box.runner.restarts == 2


@pytest.mark.parametrize(
    "registry, timeout, error",
    [
        ("FORK_BOMB", 1.0, "error: tool 'sum' timed out after 1 s (--tool-timeout) and was killed"),
        # The memory limit must end it, not the timeout: 32 allocations of 8 MiB took more than 1 s on a machine
        # with a load of 12 on two cores (2 failures in 6 runs, the timeout's message instead).
        ("MEMORY_HOG", 30.0, "error: tool 'sum' ran out of memory (its limit is --tool-memory-mb)"),
    ],
)
def test_a_hostile_tool_is_contained_and_the_conversation_goes_on(engine, qwen_tok, toolbox, registry, timeout, error):
    """In the default sandbox with tight limits (tests/sandbox_helpers.py): the fork bomb ends at the process limit
    and the timeout, the memory hog at the memory limit; the sample gets the error and its next turn."""
    require_namespaces()
    box = toolbox(registry, max_turns=2, timeout=timeout, sandbox=TIGHT, module="tests.hostile_tools")
    s = _generate(engine.url, qwen_tok, box, _sample(qwen_tok), _params(1000))
    tokens, mask = _expected(qwen_tok, [error])
    assert s.response_tokens == tokens and s.loss_mask == mask
    assert s.turns == 2 and s.status == SampleStatus.TRUNCATED
    assert box.runner.worker_pids() == []  # the sample's worker ended with it


def test_the_budget_covers_all_turns(engine, qwen_tok, toolbox):
    box = toolbox()
    full, full_mask = _expected(qwen_tok, ["5"], last_turn=False)
    # The tool segment does not fit: it is cut at the budget.
    s = _generate(engine.url, qwen_tok, box, _sample(qwen_tok), _params(len(full) - 3))
    assert s.response_tokens == full[:-3] and s.loss_mask == full_mask[:-3]
    assert s.status == SampleStatus.TRUNCATED and s.turns == 1
    # The budget ends inside the second turn: the engine stops at it.
    s = _generate(engine.url, qwen_tok, box, _sample(qwen_tok), _params(len(full) + 4))
    assert s.response_tokens == full + tool_call_ids(qwen_tok)[:4]
    assert s.status == SampleStatus.TRUNCATED and s.turns == 1
    _check_aligned(s)


async def _engine_idle(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        load = await asyncio.to_thread(
            lambda: requests.get(url + "/get_load", headers=auth_headers(KEY), timeout=10).json()
        )
        if load["num_running_reqs"] == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine is still busy after {timeout} s: {load}")
        await asyncio.sleep(0.05)


async def _pause_inside_turn_two(url: str, model: str, prompt_len: int, first_turns: int) -> int:
    """Once the engine is 2 tokens into the second turn, pause it in abort mode, load ``model`` as the next
    weight version and resume; returns that version."""
    client = EmbeddedEngineClient(url, timeout=60.0, api_key=KEY)
    try:
        load = {}
        for _ in range(4000):
            load = await asyncio.to_thread(
                lambda: requests.get(url + "/get_load", headers=auth_headers(KEY), timeout=10).json()
            )
            if load["num_running_reqs"] == 1 and load["num_tokens"] >= prompt_len + first_turns + 2:
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError(f"the sample never reached its second turn: {load}")
        version = (await client.model_info())["weight_version"] + 1
        await client.pause("abort")
        try:
            await client.update_weights_from_disk(model, version)
        finally:
            await client.resume()
        return version
    finally:
        await client.close()


def test_a_partial_rollout_resumes_mid_conversation(engine, model, qwen_tok, toolbox):
    box = toolbox(max_turns=3)
    before, _ = _expected(qwen_tok, ["5"], last_turn=False)

    async def go():
        router = make_router([engine.url], 60.0, api_key=KEY)
        try:
            ctx = RolloutContext(
                data_source=None,
                generate_ctx=GenerateContext(router, qwen_tok, box),
                generate_fn=generate_multi_turn,
                reward=ZeroReward(),
                apply_chat_template=True,
                n_samples_per_prompt=1,
                sampling_params=_params(),
                semaphore=asyncio.Semaphore(1),
                partial_rollout=True,
            )
            # An earlier test's aborted request may still be decoding on this module's engine; its tokens would
            # count as this sample's below, and the pause would land in turn one (seen under a loaded machine).
            await _engine_idle(engine.url)
            sample = _sample(qwen_tok)
            # The first call renders the prompt with the tools; measure it the same way.
            prompt_len = len(prompt_with_tools(qwen_tok, PROMPT, box.schemas))
            task = asyncio.create_task(generate_one(ctx, sample, _params()))
            version = await _pause_inside_turn_two(engine.url, str(model), prompt_len, len(before))
            return await asyncio.wait_for(task, 60), version
        finally:
            await router.close()

    old = (requests.get(engine.url + "/get_model_info", headers=auth_headers(KEY), timeout=10).json())["weight_version"]
    s, new = asyncio.run(go())
    # Resumed where it was cut: the same conversation, to the token, as without the pause.
    tokens, mask = _expected(qwen_tok, ["5", "5"])
    assert s.response_tokens == tokens and s.loss_mask == mask
    assert s.partial_resumes == 1 and s.turns == 3 and s.status == SampleStatus.TRUNCATED
    _check_aligned(s)
    # Per-token versions: the switch lies inside turn two, and the tool segment after it has the new version.
    switch = s.weight_versions.index(int(new))
    assert int(old) + 1 == int(new) and set(s.weight_versions[:switch]) == {int(old)}
    assert set(s.weight_versions[switch:]) == {int(new)}
    assert len(before) + 2 <= switch < len(before) + len(tool_call_ids(qwen_tok))


# -- through the rollout executor: --tools-path selects the multi-turn generate function ------------------------


def test_tools_path_selects_multi_turn_in_the_executor(shared_ray, engine, model, qwen_tok, tmp_path):
    """As a run starts it, in the default sandbox (namespace) inside the Ray actor."""
    require_namespaces()
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": PROMPT, "label": "5"}) + "\n" for _ in range(2)))
    cfg = parse_args(["--use-tis", "--hf-checkpoint", str(model), "--prompt-data", str(data),
                      "--rollout-batch-size", "2", "--n-samples-per-prompt", "1", "--num-rollout", "1",
                      "--apply-chat-template", "--rollout-max-response-len", "200", "--rollout-dtype", "float32",
                      "--rm-type", "integer", "--output-dir", str(tmp_path),
                      "--tools-path", f"{H}.TOOLS", "--max-turns", "2"])  # fmt: skip
    ex = ray.remote(RolloutExecutor).remote(
        cfg.rollout, cfg.eval, replace(cfg.engine, request_timeout=60.0, api_key=KEY), [engine.url], None, None,
        str(tmp_path),
        tools=cfg.tools,
    )  # fmt: skip
    batch = ray.get(ray.get(ex.generate.remote(0))["data"][0])
    tokens, mask = _expected(qwen_tok, ["5"])
    for toks, p, r, m in zip(batch.tokens, batch.prompt_lengths, batch.response_lengths, batch.loss_masks):
        assert toks[p:] == tokens and r == len(tokens) and m == mask
