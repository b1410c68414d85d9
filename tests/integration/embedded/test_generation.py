"""The embedded server generates what the model says: SGLang-shaped answers, stop tokens, batching that changes no
output, log-probs of the distribution sampled from, one prefill per distinct prompt, bad requests refused."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch

from miles_async.inference.client import EngineError
from miles_async.inference.embedded.client import EmbeddedEngineClient
from miles_async.inference.embedded.model import CausalLM
from tests.integration.embedded.helpers import GREEDY, ServerProc, hf_greedy, load_local, make_prompts, run
from tests.tolerance import StepBounds, assert_rejected, assert_within


def test_health_model_info_and_generate(server: ServerProc, model_dirs: dict[str, Path]) -> None:
    async def body(c: EmbeddedEngineClient) -> tuple[bool, dict, dict]:
        return (
            await c.health(),
            await c.model_info(),
            await c.generate([1, 5, 6, 7], {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}),
        )

    healthy, info, res = run(body, server.url)
    assert healthy
    assert info["model_path"] == str(model_dirs["base"])
    assert info["is_generation"] is True
    assert isinstance(info["weight_version"], int)

    meta = res["meta_info"]
    assert len(res["output_ids"]) == meta["completion_tokens"] == 8
    assert meta["prompt_tokens"] == 4
    assert meta["finish_reason"]["type"] == "length"
    lps = meta["output_token_logprobs"]
    assert len(lps) == meta["completion_tokens"]
    assert all(lp <= 0.0 for lp, _, _ in lps)
    assert [tok for _, tok, _ in lps] == res["output_ids"]
    assert meta["weight_version"] == info["weight_version"]
    assert meta["output_token_weight_versions"] == [info["weight_version"]] * 8
    assert res["text"] == ""  # no tokenizer in the folder


def test_stop_token_included_and_min_new_tokens(server: ServerProc) -> None:
    prompt = [1, 9, 10, 11]

    async def body(c: EmbeddedEngineClient) -> tuple[dict, dict, dict]:
        free = await c.generate(prompt, {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True})
        stop_at = free["output_ids"][3]
        stopped = await c.generate(
            prompt, {"temperature": 0.0, "max_new_tokens": 10, "stop_token_ids": [stop_at], "ignore_eos": True}
        )
        forced = await c.generate(
            prompt,
            {"temperature": 1.0, "max_new_tokens": 30, "min_new_tokens": 30, "stop_token_ids": [stop_at]},
        )
        return free, stopped, forced

    free, stopped, forced = run(body, server.url)
    stop_at = free["output_ids"][3]
    first = free["output_ids"].index(stop_at)
    assert stopped["output_ids"] == free["output_ids"][: first + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    assert len(forced["output_ids"]) == 30
    assert stop_at not in forced["output_ids"] and 2 not in forced["output_ids"]


def test_greedy_alone_equals_batched(server: ServerProc, model_dirs: dict[str, Path]) -> None:
    prompts = make_prompts(8)
    target = prompts[3]

    async def body(c: EmbeddedEngineClient) -> tuple[dict, list[dict], dict, dict]:
        alone = await c.generate(target, GREEDY)
        before = await c.load()

        async def staggered(i: int, p: list[int]) -> dict:
            # The second half arrives while the first half is decoding, so it
            # is merged into a running batch rather than prefilled with it.
            await asyncio.sleep(0.0 if i < 4 else 0.03)
            return await c.generate(p, GREEDY)

        batched = await asyncio.gather(*(staggered(i, p) for i, p in enumerate(prompts)))
        after = await c.load()
        return alone, batched, before, after

    alone, batched, before, after = run(body, server.url)
    assert batched[3]["output_ids"] == alone["output_ids"]
    # Real batching happened: several rows per forward.
    steps = after["decode_steps"] - before["decode_steps"]
    tokens = after["decode_tokens"] - before["decode_tokens"]
    assert after["max_batch_size"] >= 4
    assert tokens > steps * 2
    # And every row matches a plain unbatched HF greedy decode.
    ref = load_local(model_dirs["base"])
    for p, res in zip(prompts, batched):
        assert res["output_ids"] == hf_greedy(ref, p, GREEDY["max_new_tokens"])


def test_logprobs_match_hf_forward(server: ServerProc, model_dirs: dict[str, Path]) -> None:
    prompts = make_prompts(5)
    params = [
        # A greedy row in the batch exercises the mixed greedy/sampled path;
        # its log-probs are documented to be at temperature 1.
        {"temperature": 0.0, "max_new_tokens": 16},
        {"temperature": 1.0, "max_new_tokens": 16},
        {"temperature": 1.0, "max_new_tokens": 16},
        {"temperature": 0.7, "top_k": 5, "max_new_tokens": 16},
        {"temperature": 1.3, "top_p": 0.8, "max_new_tokens": 16},
    ]

    async def body(c: EmbeddedEngineClient) -> list[dict]:
        return await asyncio.gather(*(c.generate(p, sp) for p, sp in zip(prompts, params)))

    results = run(body, server.url)
    ref = load_local(model_dirs["base"])
    for prompt, sp, res in zip(prompts, params, results):
        out = res["output_ids"]
        assert out, "expected at least one token"
        got = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]])
        with torch.no_grad():
            logits = ref(input_ids=torch.tensor([prompt + out])).logits[0].float()
        step_logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(out)] / (sp["temperature"] or 1.0)
        if sp["temperature"] == 0.0:
            assert out == step_logits.argmax(-1).tolist()
        if "top_k" in sp:
            kth = step_logits.topk(sp["top_k"], dim=-1).values[:, -1:]
            step_logits = step_logits.masked_fill(step_logits < kth, float("-inf"))
        if "top_p" in sp:
            probs = step_logits.softmax(-1)
            sorted_p, order = probs.sort(-1, descending=True)
            drop_sorted = (sorted_p.cumsum(-1) - sorted_p) > sp["top_p"]
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            step_logits = step_logits.masked_fill(drop, float("-inf"))
        expected = step_logits.log_softmax(-1).gather(-1, torch.tensor(out)[:, None]).squeeze(-1)
        _assert_logprobs_agree(model_dirs["base"], prompt + out, got, expected, sp.get("temperature") or 1.0)


def _assert_logprobs_agree(model_dir, row: list[int], got, expected, temperature: float) -> None:
    """The engine decodes with a KV cache, the reference runs the whole row: float32 sums in other orders
    (tests/tolerance.py), whose terms grow by 1 / temperature. One token off, they do not agree."""
    tol = StepBounds.of(model_dir, [row]).logprob / temperature
    assert_within(got, expected, tol, "the engine's log-probs vs transformers'")
    if len(got) > 1:
        assert_rejected(got.roll(1), expected, tol, "log-probs one token off")


def test_identical_prompts_share_one_prefill(server: ServerProc, model_dirs: dict[str, Path]) -> None:
    """A GRPO group sends one prompt n times: it is prefilled once, and every copy still decodes correctly."""
    prompt = make_prompts(6)[5]
    params = {"temperature": 1.0, "max_new_tokens": 12}

    async def body(c: EmbeddedEngineClient) -> tuple[list[dict], dict, dict]:
        before = await c.load()
        outs = await asyncio.gather(*(c.generate(prompt, params) for _ in range(8)))
        after = await c.load()
        return outs, before, after

    outs, before, after = run(body, server.url)
    assert after["prefill_rows_deduplicated"] > before["prefill_rows_deduplicated"]
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # the copies sample independently
    ref = load_local(model_dirs["base"])
    for res in outs:
        out = res["output_ids"]
        got = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]])
        with torch.no_grad():
            logits = ref(input_ids=torch.tensor([prompt + out])).logits[0].float()
        expected = logits[len(prompt) - 1 : len(prompt) - 1 + len(out)].log_softmax(-1)
        expected = expected.gather(-1, torch.tensor(out)[:, None]).squeeze(-1)
        _assert_logprobs_agree(model_dirs["base"], prompt + out, got, expected, 1.0)


def test_bad_requests_are_400(server: ServerProc) -> None:
    async def body(c: EmbeddedEngineClient) -> list[EngineError]:
        errors = []
        for payload in (
            {"sampling_params": {"max_new_tokens": 4}},
            {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}},
            {"input_ids": [1, 999]},
            {"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 0.5}},
        ):
            try:
                await c._request("POST", "/generate", json_body=payload)
            except EngineError as exc:
                errors.append(exc)
        return errors

    errors = run(body, server.url)
    assert len(errors) == 4
    assert all(e.status == 400 and e.endpoint == "/generate" for e in errors)
    assert "input_ids" in str(errors[0])
    assert "sampling_params.temperature" in str(errors[1])
    assert "input_ids" in str(errors[2])
    assert "sampling_params.frequency_penalty" in str(errors[3])


def test_a_tokenizer_that_does_not_load_fails_the_engine_at_start(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The model the engine starts with (``CausalLM``, in this process): tokenizer files that do not load are an
    error naming the folder and the files, not an engine that serves "" as every text."""
    folder = tmp_path / "model"
    shutil.copytree(model_dirs["base"], folder)
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(RuntimeError) as err:
        CausalLM(str(folder), torch.float32)
    assert str(err.value).startswith(f"embedded engine: the tokenizer in {folder} (tokenizer.json) does not load: "), (
        err.value
    )
